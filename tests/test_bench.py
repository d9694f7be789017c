"""`retrofit bench`: published model shapes, exact cache bytes (dense and converted in memory), a real peak-memory
probe, and the CLI."""
from __future__ import annotations

import contextlib
import gc
import json
import mmap
import weakref

import pytest
import torch
from click.testing import CliRunner

from retrofit._entry import cli_module
from retrofit.bench.configs import build_random_model
from retrofit.bench.measure import measure_point, run_bench
from retrofit.bench.memory import tensor_bytes
from retrofit.memory import MemoryProbe
from retrofit.errors import RetrofitError
from retrofit.variants import Variant, parse_variant_spec


def run(*args: str):
    return CliRunner().invoke(cli_module().main, list(args))


@pytest.mark.parametrize("name, parameters", [
    ("llama3-8b", 8_030_261_248),     # Meta-Llama-3-8B, as reported by transformers for the real checkpoint
    ("qwen2.5-7b", 7_615_616_512),    # Qwen2.5-7B model card: 7.61B
    ("smollm2-135m", 134_515_008),    # SmolLM2-135M (tied embeddings)
])
def test_named_configs_have_the_published_size(name, parameters):
    model = build_random_model(name, torch.bfloat16, torch.device("meta"))  # shapes only, no memory
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_layers_truncates_depth():
    model = build_random_model("llama3-8b", torch.bfloat16, torch.device("meta"), layers=2)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2


def test_cache_bytes_are_exactly_the_kv_held():
    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=2)
    point = measure_point(model, "dense", context=40, batch=3, decode_tokens=3)
    # retrofit's static cache: 2 layers x (K and V) x 3 KV heads x head dim 64 x 4 bytes x batch 3 x 256 positions
    # (40 prompt + 6 new tokens, rounded up to the 256-position bucket), plus each layer's int64 write counter
    assert point.cache_bytes == 2 * 2 * 3 * 64 * 4 * 3 * 256 + 2 * 8
    assert point.prefill_s > 0 and point.decode_s_per_token > 0
    assert point.peak_bytes >= point.peak_delta_bytes
    grown = measure_point(model, "dense", context=40, batch=3, decode_tokens=3, engine="transformers")
    # transformers' growing cache: the 40 prompt positions + 3 fed-back tokens
    assert grown.cache_bytes == 2 * 2 * 3 * 64 * 4 * 3 * (40 + 3)


def test_tensor_bytes_counts_each_storage_once():
    big = torch.zeros(1000, dtype=torch.float32)
    holder = {"a": big, "b": [big[:10], torch.zeros(5, dtype=torch.float16)]}
    assert tensor_bytes(holder) == 4000 + 10


def test_cpu_probe_sees_a_real_allocation():
    # A fresh anonymous mapping, every page touched: new resident memory whatever the process freed before. (A
    # malloc'ed block is not: glibc serves even a 256 MiB request from a free region of its heap when one is large
    # enough, and such a region is already resident, so the RSS need not rise.)
    size = 256 * 1024 * 1024
    with MemoryProbe(torch.device("cpu")) as probe:
        mapping = mmap.mmap(-1, size)
        pages = torch.frombuffer(mapping, dtype=torch.uint8)
        pages.fill_(1)
        del pages
        mapping.close()
    # the peak RSS rose by the mapping (page granularity and allocator slack can add a little, never subtract)
    assert probe.result.delta >= 250 * 1024 * 1024
    assert probe.result.kind == "process RSS"


def test_bench_cli_json_and_table(tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "smollm2-135m", "--layers", "2", "--context", "32,64", "--batch", "1,2",
                 "--decode-tokens", "2", "--device", "cpu", "--json", str(out))
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    points = payload["results"]
    assert [(p["context"], p["batch"]) for p in points] == [(32, 1), (32, 2), (64, 1), (64, 2)]
    assert all(p["variant"] == "dense" and p["error"] is None for p in points)
    assert payload["config"]["layers"] == 2 and payload["config"]["dtype"] == "float32"
    assert payload["config"]["complete"] is True
    lines = result.stdout.splitlines()
    assert lines[0].startswith("| variant | engine | context | batch | prefill s |")
    assert len([line for line in lines if line.startswith("| dense |")]) == 4


def test_bench_cli_plot_draws_the_points_it_saves(tmp_path):
    from retrofit.bench.plot import bench_series
    from retrofit.plotting import PNG_SIGNATURE

    out, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run("bench", "smollm2-135m", "--layers", "1", "--context", "16,32", "--batch", "1",
                 "--decode-tokens", "2", "--repeats", "1", "--warmup", "0", "--device", "cpu", "--json", str(out),
                 "--plot", str(picture))
    assert result.exit_code == 0, result.output
    assert picture.read_bytes().startswith(PNG_SIGNATURE)
    points = json.loads(out.read_text())["results"]
    drawn = {"context": [16, 32], "decode_tokens_per_s": [point["decode_tokens_per_s"] for point in points],
             "prefill_s": [point["prefill_s"] for point in points]}
    assert bench_series(points) == {"dense, batch 1": drawn}
    assert "--plot" in run("bench", "--help").output


def test_bench_cli_runs_each_engine_given_and_compares_each_with_its_own_dense(tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "smollm2-135m", "--layers", "2", "--context", "32", "--batch", "1", "--decode-tokens", "2",
                 "--device", "cpu", "--variant", "quest:budget=16", "--engine", "retrofit", "--engine",
                 "retrofit-unfused", "--json", str(out), "--repeats", "1", "--warmup", "0")
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert [(p["engine"], p["variant"]) for p in payload["results"]] == [
        ("retrofit", "dense"), ("retrofit", "quest@16"), ("retrofit-unfused", "dense"),
        ("retrofit-unfused", "quest@16")]
    assert payload["config"]["engine"] == "retrofit,retrofit-unfused" and payload["config"]["complete"] is True
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| dense |")]
    assert [row[1] for row in rows] == ["retrofit", "retrofit-unfused"]
    assert [row[11] for row in rows] == ["1.00x", "1.00x"]  # each dense row is its own engine's reference
    assert [row[7] for row in rows] == ["1.00x", "1.00x"]  # and its own prefill's


def test_bench_context_over_limit_is_one_line_error():
    result = run("bench", "smollm2-135m", "--layers", "1", "--context", "8k", "--device", "cpu")
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "over the model's limit of 8192" in result.stderr


def test_bench_unknown_layers_for_a_model_path(tmp_path):
    result = run("bench", "smollm2-135m", "--layers", "99", "--context", "64", "--device", "cpu")
    assert result.exit_code == 2 and "--layers must be in 1..30" in result.stderr


def hybrid_cache_bytes(batch: int, tokens: int, dtype_bytes: int, kv_layers: int, gdn_layers: int, q_heads: int,
                       kv_heads: int, head_dim: int, conv_size: int = 4, counters: bool = True) -> int:
    """What a hybrid's generation cache must hold, by arithmetic: each softmax layer keeps K and V
    ``[B, H_kv, tokens, D]`` in the model dtype (and, in a static cache, an int64 write counter); each GDN layer
    keeps a conv state ``[B, (H_q + 2 H_kv) D, W - 1]`` in the model dtype and a recurrent state ``[B, H_kv, D, D]``
    in float32, whatever the prompt length, and the int64 position counter that transformers' linear-attention cache
    layer holds from 5.25 on."""
    kv = kv_layers * (2 * batch * kv_heads * tokens * head_dim * dtype_bytes + (8 if counters else 0))
    conv = batch * (q_heads + 2 * kv_heads) * head_dim * (conv_size - 1) * dtype_bytes
    recurrent = batch * kv_heads * head_dim * head_dim * 4
    return kv + gdn_layers * (conv + recurrent + _linear_layer_counter_bytes())


def _linear_layer_counter_bytes() -> int:
    """8 where the installed transformers' ``LinearAttentionLayer`` keeps an int64 counter tensor (5.25 on), else 0."""
    from transformers.cache_utils import LinearAttentionLayer

    counter = getattr(LinearAttentionLayer(), "cumulative_length_linear", None)
    return counter.element_size() * counter.numel() if isinstance(counter, torch.Tensor) else 0


def test_converted_cache_bytes_are_one_kv_layer_plus_three_states():
    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=4)
    variant = parse_variant_spec("convert:gdn:not:every:4")
    assert variant.describe(model)["converted_layers"] == [0, 1, 2]
    with variant.open(model, None) as hybrid:
        point = measure_point(hybrid, variant.name, context=40, batch=3, decode_tokens=3)
    # SmolLM2: 9 q heads, 3 kv heads, head dim 64; layer 3 softmax over the 256-position static buffer (40 prompt +
    # 6 new tokens, rounded up), layers 0-2 GDN: 3 x (conv 3 x 960 x 3 + recurrent 3 x 3 x 64 x 64) float32 values;
    # equality: the cache holds nothing else
    assert point.cache_bytes == hybrid_cache_bytes(3, 256, 4, kv_layers=1, gdn_layers=3, q_heads=9, kv_heads=3,
                                                   head_dim=64)
    assert point.cache_bytes == (2 * 3 * 3 * 256 * 64 * 4 + 8
                                 + 3 * (3 * 960 * 3 * 4 + 3 * 3 * 64 * 64 * 4 + _linear_layer_counter_bytes()))


def test_converted_states_do_not_grow_with_the_prompt():
    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=4)
    variant = parse_variant_spec("convert:gdn:0-2")
    with variant.open(model, None) as hybrid:
        short = measure_point(hybrid, variant.name, context=16, batch=2, decode_tokens=2).cache_bytes
        long = measure_point(hybrid, variant.name, context=16 + 256, batch=2, decode_tokens=2).cache_bytes
    # 256 more prompt tokens (one more 256-position bucket) grow only the one softmax layer's K and V (batch 2,
    # 3 kv heads, dim 64, float32)
    assert long - short == 2 * 2 * 3 * 256 * 64 * 4


def test_convert_variant_shares_weights_leaves_dense_intact_and_is_released():
    from retrofit.layers import GatedDeltaNetAttention

    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=4)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with parse_variant_spec("convert:gdn:not:every:4").open(model, None) as hybrid:
        released = weakref.ref(hybrid)
        kinds = [type(layer.self_attn) for layer in hybrid.model.layers]
        assert kinds[:3] == [GatedDeltaNetAttention] * 3 and kinds[3] is type(model.model.layers[3].self_attn)
        dense_layers, hybrid_layers = model.model.layers, hybrid.model.layers
        # no copy of the weights the conversion keeps: same storage as the dense model
        assert hybrid.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert hybrid_layers[0].mlp.down_proj.weight.data_ptr() == dense_layers[0].mlp.down_proj.weight.data_ptr()
        assert hybrid_layers[3].self_attn.k_proj.weight.data_ptr() == dense_layers[3].self_attn.k_proj.weight.data_ptr()
        # converted layers start from (a copy of) the attention weights
        assert torch.equal(hybrid_layers[1].self_attn.q_proj.weight, dense_layers[1].self_attn.q_proj.weight)
        assert hybrid_layers[1].self_attn.q_proj.weight.data_ptr() != dense_layers[1].self_attn.q_proj.weight.data_ptr()
        assert next(hybrid.model.layers[0].self_attn.parameters()).dtype == torch.float32
        del hybrid, kinds, hybrid_layers
    gc.collect()
    assert released() is None  # nothing keeps the converted model alive after the variant closes
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_run_bench_releases_each_variant_before_the_next_opens():
    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=2)
    opened: list[weakref.ref] = []
    alive_at_open: list[list[bool]] = []

    def tracked(spec: str) -> Variant:
        inner = parse_variant_spec(spec)

        @contextlib.contextmanager
        def opener(dense, tokenizer):
            alive_at_open.append([ref() is not None for ref in opened])
            with inner.open(dense, tokenizer) as hybrid:
                opened.append(weakref.ref(hybrid))
                yield hybrid

        return Variant(inner.name, opener)

    points = run_bench(model, [tracked("convert:gdn:0"), tracked("convert:gdn:1")], None, [16], [1], 1)
    assert [p.variant for p in points] == ["dense", "convert:gdn:0", "convert:gdn:1"]
    # when the second converted model is built, the first one (its new layers) is already gone
    assert alive_at_open == [[], [False]]


def test_run_bench_reports_every_point_as_it_is_measured_so_a_crash_keeps_them():
    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=2)

    @contextlib.contextmanager
    def crashing(dense, tokenizer):
        raise RuntimeError("the variant fails to open")
        yield dense

    seen: list[list[tuple[str, int]]] = []
    with pytest.raises(RuntimeError, match="fails to open"):
        run_bench(model, [Variant("crashing", crashing)], None, [16, 32], [1], 1,
                  on_point=lambda points: seen.append([(p.variant, p.context) for p in points]))
    assert seen == [[("dense", 16)], [("dense", 16), ("dense", 32)]]


@pytest.mark.parametrize("spec, message", [
    ("convert:gdn", "expected convert:KIND:LAYERS"),
    ("convert:mamba:every:4", "unknown layer type 'mamba'"),
], ids=["no-layers", "bad-kind"])
def test_bad_convert_specs_fail_at_parse_time(spec, message):
    with pytest.raises(RetrofitError, match=message):
        parse_variant_spec(spec)


@pytest.mark.parametrize("layers, message", [
    ("0,9", "layer index 9 is out of range: the model has 4 layers"),
    ("fraction:0.5", "a scored fraction needs calibration data"),
    ("not:0-3", "leaves no layer to convert"),
], ids=["out-of-range", "fraction", "nothing-left"])
def test_bench_bad_convert_layers_fail_before_any_measurement(layers, message):
    result = run("bench", "smollm2-135m", "--layers", "4", "--context", "16", "--device", "cpu",
                 "--variant", f"convert:gdn:{layers}")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr
    assert "| dense |" not in result.stdout  # the dense model was not measured first


def test_bench_cli_dense_and_converted_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "smollm2-135m", "--layers", "4", "--context", "32,64", "--batch", "1,2",
                 "--decode-tokens", "2", "--device", "cpu", "--variant", "convert:gdn:not:every:4",
                 "--json", str(out))
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    points = {(p["variant"], p["context"], p["batch"]): p for p in payload["results"]}
    name = "convert:gdn:not:every:4"
    assert [p["variant"] for p in payload["results"]] == ["dense"] * 4 + [name] * 4
    assert payload["config"]["variant_details"] == {
        name: {"layer_type": "gdn", "converted_layers": [0, 1, 2], "num_layers": 4}}
    for context in (32, 64):
        for batch in (1, 2):
            dense, hybrid = points[("dense", context, batch)], points[(name, context, batch)]
            assert dense["error"] is None and hybrid["error"] is None
            # static caches of 256 positions (context + 5 new tokens, rounded up), an int64 counter per layer
            assert dense["cache_bytes"] == 4 * (2 * batch * 3 * 256 * 64 * 4 + 8)
            assert hybrid["cache_bytes"] == hybrid_cache_bytes(batch, 256, 4, kv_layers=1, gdn_layers=3,
                                                               q_heads=9, kv_heads=3, head_dim=64)
            assert hybrid["prefill_s"] > 0 and hybrid["decode_tokens_per_s"] > 0
    lines = result.stdout.splitlines()
    assert len([line for line in lines if line.startswith(f"| {name} |")]) == 4
    assert f"{name}: gdn in 3 of 4 layers (0-2); softmax attention in 3." in lines


@pytest.mark.gpu
def test_gpu_converted_cache_bytes_in_bfloat16():
    """bf16 on CUDA (Triton kernels): KV and conv states in bf16, the recurrent state in float32."""
    model = build_random_model("llama3-8b", torch.bfloat16, torch.device("cuda"), layers=4)
    with parse_variant_spec("convert:gdn:not:every:4").open(model, None) as hybrid:
        point = measure_point(hybrid, "convert", context=4096, batch=2, decode_tokens=4)
    # Llama-3-8B: 32 q heads, 8 kv heads, head dim 128; layer 3 softmax over 4096 + 7 tokens rounded up to 4352
    # positions, layers 0-2 GDN
    assert point.cache_bytes == hybrid_cache_bytes(2, 4352, 2, kv_layers=1, gdn_layers=3, q_heads=32, kv_heads=8,
                                                   head_dim=128)
    assert point.peak_delta_bytes >= point.cache_bytes


@pytest.mark.gpu
def test_gpu_bench_memory_accounts_for_the_cache():
    """On CUDA the allocator peak over the weights must cover the KV cache that generate() kept."""
    model = build_random_model("llama3-8b", torch.bfloat16, torch.device("cuda"), layers=2)
    point = measure_point(model, "dense", context=4096, batch=2, decode_tokens=4)
    # 2 layers x (K,V x 8 KV heads x 128 x 2 bytes x batch 2 x (4096 + 7 rounded up to 4352) + an int64 counter)
    assert point.cache_bytes == 2 * (2 * 8 * 128 * 2 * 2 * 4352 + 8)
    assert point.peak_delta_bytes >= point.cache_bytes
    assert point.memory_kind == "cuda allocated"


def test_floor_is_the_weights_and_the_valid_keys_over_the_bandwidth():
    from retrofit.bench.floor import weight_bytes_read

    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=2)
    parameters = sum(p.numel() for p in model.parameters())  # tied embeddings: each weight counted once
    assert weight_bytes_read(model) == parameters * 4  # every weight is read once per step (the output layer too)
    point = measure_point(model, "dense", context=40, batch=3, decode_tokens=4, bandwidth=1e9)
    # 2 layers x K and V x 3 kv heads x 64 dims x 4 bytes x 3 rows x (40 + 4 / 2) positions on average
    kv = 2 * 2 * 3 * 64 * 4 * 3 * (40 + 2)
    assert point.floor_s_per_token == pytest.approx((parameters * 4 + kv) / 1e9, rel=1e-12)
    assert point.floor_ratio == point.decode_s_per_token / point.floor_s_per_token


def test_repeats_report_the_median_and_its_spread():
    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=1)
    point = measure_point(model, "dense", context=16, batch=1, decode_tokens=2, repeats=3, warmup=1)
    assert point.repeats == 3 and point.decode_spread >= 0 and point.prefill_spread >= 0
    assert point.captured is False  # no CUDA here: the step ran eagerly


def test_transformers_compile_refuses_sparse_variants_in_their_rows():
    from retrofit.sparse import sparse_decoding

    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=1)
    with sparse_decoding(model, method="quest", budget=64):
        point = measure_point(model, "quest@64", context=16, batch=1, decode_tokens=2, engine="transformers-compile")
    assert point.error.startswith("refused: transformers' static cache and torch.compile cannot run sparse decoding")


def test_composed_variant_sparsifies_the_converted_hybrids_softmax_layers():
    from retrofit.sparse.patch import active_session

    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=4)
    variant = parse_variant_spec("convert:gdn:not:every:4+quest:budget=64,dense_layers=")
    assert variant.name == "convert:gdn:not:every:4+quest@64,dense_layers="
    assert variant.describe(model)["converted_layers"] == [0, 1, 2]
    with variant.open(model, None) as opened:
        assert list(active_session(opened).layers) == [3]  # the one softmax layer left
        point = measure_point(opened, variant.name, context=40, batch=1, decode_tokens=3)
    assert point.error is None and point.decode_s_per_token > 0
    assert active_session(opened) is None  # closed with the variant


def test_the_help_example_on_the_reference_model_runs(tmp_path):
    """The `retrofit bench --help` example a CPU can run (the reference model's shapes, 4 layers) runs as printed."""
    import shlex

    from retrofit.bench.command import BENCH_HELP

    text = BENCH_HELP.replace("\\\n", " ")
    (example,) = [line.strip() for line in text.splitlines() if line.strip().startswith("retrofit bench smollm2-135m")]
    args = shlex.split(example)[1:] + ["--device", "cpu", "--repeats", "1", "--warmup", "0",
                                       "--json", str(tmp_path / "b.json")]
    result = run(*args)
    assert result.exit_code == 0, result.output
    variants = [point["variant"] for point in json.loads((tmp_path / "b.json").read_text())["results"]]
    assert variants == ["dense"] * 2 + ["convert:gdn:not:every:4"] * 2 + ["quest@64"] * 2  # batch 1 and 2 each


def test_default_contexts_that_do_not_fit_are_left_out_and_named(tmp_path):
    """The defaults (1k, 4k, 16k) on a model of 8,192 positions: 16k is left out with a line saying so."""
    result = run("bench", "smollm2-135m", "--layers", "1", "--decode-tokens", "2", "--device", "cpu", "--repeats", "1",
                 "--warmup", "0", "--json", str(tmp_path / "b.json"))
    assert result.exit_code == 0, result.output
    assert "contexts of 16,384 tokens left out of the defaults: over the model's 8,192 positions" in result.stderr
    contexts = [point["context"] for point in json.loads((tmp_path / "b.json").read_text())["results"]]
    assert contexts == [1024, 4096]


def test_a_bad_convert_variant_names_the_variant_not_convert_s_layers_flag():
    result = run("bench", "smollm2-135m", "--layers", "2", "--context", "64", "--device", "cpu",
                 "--variant", "convert:gdn:not:every:4")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("retrofit: error: --variant convert:gdn:not:every:4: layers 'every:4'")
    assert "--layers" not in result.stderr
