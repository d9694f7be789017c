"""`retrofit gates`: SeerAttention decode-gate training on real calibration text with the real SmolLM2 frozen."""
from __future__ import annotations

import torch
from click.testing import CliRunner

from retrofit.sparse.methods.seer.training import calibration_chunks, capture_gate_losses, train_gates, with_repeated_span
from retrofit.sparse.methods.seer import SeerGates

SETTINGS = dict(seq_len=128, block_size=16, hidden=32, queries=8, lr=3e-3, progress=False)


def _kl_on(model, gates, chunk, queries=8):
    with capture_gate_losses(model, gates, queries) as losses, torch.no_grad():
        model(chunk[None], use_cache=False)
    return torch.stack(losses).mean().item()


def test_train_gates_learns_resumes_and_saves_atomically(smollm2, calib_data_dir, tmp_path):
    model, tokenizer = smollm2
    data = [calib_data_dir / "dracula.txt"]
    out = tmp_path / "smol.gates"
    weights_before = [p.detach().clone() for p in model.parameters()][:3]
    # at the held-out chunk's own positions (offsets are tested below: after 2 steps at random positions the
    # gates have not yet learned to generalise across positions, 8% lower KL here instead of 49%)
    fixed = dict(SETTINGS, position_offsets=False)
    _, first = train_gates(model, tokenizer, data, 128, out, save_every=1, **fixed)  # 1 step
    assert len(first) == 1
    checkpoint = torch.load(tmp_path / "smol.gates.ckpt", weights_only=True)
    assert checkpoint["step"] == 1
    gates, resumed = train_gates(model, tokenizer, data, 256, out, resume=True, save_every=1, **fixed)
    assert len(resumed) == 1  # step 2 only: resume continued where the checkpoint stopped
    assert torch.load(tmp_path / "smol.gates.ckpt", weights_only=True)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol.gates", "smol.gates.ckpt"]  # no temp files left
    # the base model stays frozen
    assert all(torch.equal(a, b) for a, b in zip(weights_before, list(model.parameters())[:3]))
    loaded = SeerGates.load(out)
    assert loaded.config == gates.config and len(loaded.gates) == 30
    # learning: on a held-out chunk (the 6th), the trained gates match the block-pooled attention better than
    # freshly initialised ones. Observed: KL 1.07 nat at init, 0.54 after these 2 steps; requiring a 20% drop
    # leaves a wide margin while an untrained or mis-wired gate (no drop) fails
    held_out = calibration_chunks(tokenizer, data, [128] * 6)[5]
    torch.manual_seed(0)
    fresh = SeerGates(**loaded.config)
    assert _kl_on(model, loaded, held_out) < 0.8 * _kl_on(model, fresh, held_out)


def test_gates_cli_errors_are_one_line(tmp_path):
    from retrofit._entry import cli_module

    result = CliRunner().invoke(cli_module().main, ["gates", "smollm2-135m", "--data", str(tmp_path), "--out",
                                                    str(tmp_path / "g.gates"), "--resume"])
    assert result.exit_code == 2
    assert result.output.strip().endswith("g.gates.ckpt'") and "no checkpoint" in result.output


def test_repeated_span_copies_an_earlier_span_and_keeps_the_rest():
    import random

    chunk = torch.arange(1000, 1000 + 300)  # distinct tokens: a copy can be located exactly
    for seed in range(20):
        out = with_repeated_span(chunk, 40, random.Random(seed))
        assert torch.equal(out[:260], chunk[:260])
        start = int(out[260]) - 1000
        assert 0 <= start <= 300 - 80  # the copy's source lies wholly before the span it replaces
        assert torch.equal(out[260:], chunk[start:start + 40])
    assert torch.equal(with_repeated_span(chunk[:70], 40, random.Random(0)), chunk[:70])  # too short: unchanged


def test_retrieval_fraction_out_of_range_is_one_line(smollm2, calib_data_dir, tmp_path):
    import pytest

    from retrofit.errors import RetrofitError

    model, tokenizer = smollm2
    with pytest.raises(RetrofitError, match="retrieval-fraction 1.5 must be between 0 and 1"):
        train_gates(model, tokenizer, [calib_data_dir], 4096, tmp_path / "g.gates", retrieval_fraction=1.5)


def test_training_sequences_start_at_seeded_random_positions(smollm2, calib_data_dir, tmp_path):
    # gates read post-RoPE queries and keys: trained at one set of positions they do not carry to others (CPU,
    # niah_single@2048: 100% of dense at the trained positions, 10% at positions 5952-8000), so each training
    # sequence starts at a random position within the model's 8192
    from retrofit.sparse.methods.seer.training import position_offsets_for

    model, tokenizer = smollm2
    config = model.config
    offsets = position_offsets_for([128] * 50, config, seed=0)
    assert offsets == position_offsets_for([128] * 50, config, seed=0)  # seeded: a resumed run sees the same ones
    assert all(0 <= o <= 8192 - 128 for o in offsets) and len(set(offsets)) > 40
    assert max(offsets) > 4096 > min(offsets)
    starts = []
    forward = model.forward

    def recording_forward(*args, **kwargs):
        starts.append(int(kwargs["position_ids"][0, 0]))
        return forward(*args, **kwargs)

    model.forward = recording_forward
    try:
        train_gates(model, tokenizer, [calib_data_dir / "dracula.txt"], 256, tmp_path / "a.gates", **SETTINGS)
        train_gates(model, tokenizer, [calib_data_dir / "dracula.txt"], 256, tmp_path / "b.gates",
                    position_offsets=False, **SETTINGS)
    finally:
        del model.forward
    assert starts == position_offsets_for([128] * 2, config, seed=0) + [0, 0]


def test_sequence_lengths_between_min_and_max_cover_the_tokens(smollm2, calib_data_dir, tmp_path):
    # GPU table (BENCHMARKS.md, Sparse decoding: accuracy, 2026-11-30): gates trained on sequences of 4096 keep 45% of dense on niah_single@8000; prompts that
    # long need long training sequences, which still have to start at varied positions (see above)
    from retrofit.sparse.methods.seer.training import position_offsets_for, sequence_lengths

    lengths = sequence_lengths(10_000, 512, 128, 64, seed=0)
    assert lengths == sequence_lengths(10_000, 512, 128, 64, seed=0)  # seeded: resume sees the same sequences
    assert all(length % 64 == 0 and 128 <= length <= 512 for length in lengths)
    assert len(set(lengths)) >= 5 and sum(lengths) - max(lengths) < 10_000 <= sum(lengths)
    assert sequence_lengths(1000, 256, None, 64, seed=0) == [256] * 4
    model, tokenizer = smollm2
    offsets = position_offsets_for(lengths, model.config, seed=0)
    assert all(0 <= o <= 8192 - length for o, length in zip(offsets, lengths))
    seen = []
    forward = model.forward

    def recording_forward(ids, **kwargs):
        seen.append((ids.shape[1], int(kwargs["position_ids"][0, 0])))
        return forward(ids, **kwargs)

    model.forward = recording_forward
    try:
        train_gates(model, tokenizer, [calib_data_dir / "dracula.txt"], 300, tmp_path / "a.gates",
                    **dict(SETTINGS, min_seq_len=32))
    finally:
        del model.forward
    expected = sequence_lengths(300, 128, 32, 16, seed=0)
    assert [length for length, _ in seen] == expected
    assert [start for _, start in seen] == position_offsets_for(expected, model.config, seed=0)


def test_min_seq_len_out_of_range_is_one_line(smollm2, calib_data_dir, tmp_path):
    import pytest

    from retrofit.errors import RetrofitError

    model, tokenizer = smollm2
    with pytest.raises(RetrofitError, match="--min-seq-len 2048 must be .* at most --seq-len 1024"):
        train_gates(model, tokenizer, [calib_data_dir], 4096, tmp_path / "g.gates", min_seq_len=2048)


def test_gates_cli_default_lengths_follow_the_model():
    # without --seq-len: sequences of 2048-8192 on SmolLM2 (the setting that kept >= 90% of dense up to 8000 on the
    # H200), shorter for models with a shorter maximum length, in whole blocks
    from types import SimpleNamespace

    from retrofit.sparse.methods.seer.training import default_seq_lens

    assert default_seq_lens(SimpleNamespace(max_position_embeddings=8192), 64) == (8192, 2048)
    assert default_seq_lens(SimpleNamespace(max_position_embeddings=131072), 64) == (8192, 2048)
    assert default_seq_lens(SimpleNamespace(max_position_embeddings=2000), 64) == (1984, 448)
    assert default_seq_lens(SimpleNamespace(max_position_embeddings=100), 64) == (128, 128)
    assert default_seq_lens(SimpleNamespace(), 16) == (8192, 2048)
