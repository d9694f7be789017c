"""Running out of memory: one line naming the device, the work and what to try, exit code 2, no traceback and nothing
half-written, in eval, generate, bench and convert (a conversion keeps its last checkpoint, and --resume reaches the
weights of an uninterrupted run); and ``retrofit eval --batch-size auto``, which halves a batch that does not fit and
then scores exactly as that fixed batch does.

Memory runs out on purpose here: real allocations made by PyTorch operators are refused past a byte limit
(``_testing.AllocationCap``, torch.OutOfMemoryError with the CPU allocator's words) inside a chosen function.
"""
from __future__ import annotations

import json

import pytest
import torch
from _cli_runner import assert_one_line_error, run
from _testing import AllocationCap, allocations_capped_in
from safetensors.torch import load_file

import retrofit.bench.configs
import retrofit.bench.measure
import retrofit.eval.generation
from retrofit.convert.checkpoint import STATE_FILE, saved_position, work_dir_for
from retrofit.convert.distill import Distiller
from retrofit.errors import RetrofitError
from retrofit.generation.engine import StaticGeneration
from retrofit.memory import OutOfMemory, is_out_of_memory, out_of_memory

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# passkey at 256 tokens: SmolLM2 finds every key at this length, so equal scores are scores of real answers
PASSKEY = ("eval", "smollm2-135m", "--tasks", "passkey", "--context-length", "256", "--limit", "4",
           "--num-seeds", "2", "--device", "cpu")


def test_a_real_allocation_failure_reads_as_one_line():
    with pytest.raises(RuntimeError) as caught:  # 1 EiB: the CPU allocator refuses it at once
        torch.empty(2 ** 60, dtype=torch.uint8)
    assert is_out_of_memory(caught.value)
    line = str(out_of_memory(caught.value, "making a tensor", "a smaller one"))
    assert line == ("out of memory on cpu (tried to allocate 1073741824.00 GiB) while making a tensor: try a "
                    "smaller one")
    # CUDA's caching allocator words it so (torch 2.x); the line keeps the size, the device and what was in use
    cuda = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 18.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 3.81 GiB "
        "is free. Including non-PyTorch memory, this process has 75.37 GiB memory in use. Of the allocated memory "
        "73.02 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated.")
    assert str(out_of_memory(cuda, "prefilling")) == ("out of memory on cuda:0 (tried to allocate 18.00 GiB; 73.02 "
                                                      "GiB allocated of 79.19 GiB) while prefilling")
    assert not is_out_of_memory(RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only the errors devices raise


@pytest.fixture(scope="module")
def batch_of_two_limit():
    """The largest single allocation of passkey@256's generation at batch 2 (bytes): a device limit at which a batch
    of 2 fits and a batch of 4 (twice the rows in every per-row tensor) does not."""
    with allocations_capped_in(retrofit.eval.generation, "generate", limit=None) as caps:
        result = run(*PASSKEY, "--batch-size", "2")
    assert result.exit_code == 0, result.output
    return max(cap.largest for cap in caps)


def test_batch_size_auto_halves_to_the_batch_that_fits_and_scores_as_that_fixed_batch(batch_of_two_limit, tmp_path):
    with allocations_capped_in(retrofit.eval.generation, "generate", limit=batch_of_two_limit) as caps:
        auto = run(*PASSKEY, "--json", str(tmp_path / "auto.json"), "--log-samples", str(tmp_path / "auto.jsonl"))
    assert auto.exit_code == 0, auto.output
    # 8 items: the first guess (all 8, memory being plentiful) and then 4 were refused; 2 ran every batch
    assert [cap.raised for cap in caps] == [1, 1, 0, 0, 0, 0]
    auto_json = json.loads((tmp_path / "auto.json").read_text())
    assert auto_json["config"]["batch_size"] == "auto"
    assert auto_json["config"]["batch_sizes"] == {"dense": {"passkey@256": 2}}
    assert auto.stdout.strip().splitlines()[-1] == "| batch size (auto) | 2 |"

    fixed = run(*PASSKEY, "--batch-size", "2", "--json", str(tmp_path / "fixed.json"), "--log-samples",
                str(tmp_path / "fixed.jsonl"))
    assert fixed.exit_code == 0, fixed.output
    fixed_json = json.loads((tmp_path / "fixed.json").read_text())
    assert auto_json["results"] == fixed_json["results"]  # identical, not close: the same batches ran
    assert auto_json["results"]["dense"]["passkey@256"]["score"] == 1.0
    outputs = [[json.loads(line)["output"] for line in (tmp_path / name).read_text().splitlines()]
               for name in ("auto.jsonl", "fixed.jsonl")]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8
    assert "batch size (auto)" not in fixed.stdout  # a fixed batch is the user's own: no row for it


def test_batch_size_auto_counts_the_blocks_of_the_batches_that_ran(batch_of_two_limit, tmp_path):
    """Under a sparse prefill the share of blocks computed is that of the batches that ran: the calls of the refused
    first attempts (8 and 4 rows, their prefill under way when memory ran out) are dropped with them, so auto reports
    exactly what a fixed batch of 2 does."""
    sparse = "prefill:xattention:block_size=32,min_length=0,threshold=0.5"
    with allocations_capped_in(retrofit.eval.generation, "generate", limit=batch_of_two_limit) as caps:
        auto = run(*PASSKEY, "--variant", sparse, "--json", str(tmp_path / "auto.json"))
    assert auto.exit_code == 0, auto.output
    assert [cap.raised for cap in caps][:2] == [1, 1] and sum(cap.raised for cap in caps) == 4  # dense's and sparse's
    fixed = run(*PASSKEY, "--variant", sparse, "--batch-size", "2", "--json", str(tmp_path / "fixed.json"))
    assert fixed.exit_code == 0, fixed.output
    auto_json, fixed_json = (json.loads((tmp_path / name).read_text()) for name in ("auto.json", "fixed.json"))
    assert auto_json["config"]["batch_sizes"]["prefill:xattention,block_size=32,min_length=0,threshold=0.5"] == {
        "passkey@256": 2}
    shares = [payload["prefill_blocks_computed"] for payload in (auto_json, fixed_json)]
    assert 0 < next(iter(shares[1].values()))["passkey@256"] < 1
    assert shares[0] == shares[1]  # equal, not close: the same calls pooled


def test_eval_out_of_memory_is_one_line_and_writes_nothing(batch_of_two_limit, tmp_path):
    out = tmp_path / "eval.json"
    with allocations_capped_in(retrofit.eval.generation, "generate", limit=batch_of_two_limit):
        fixed = run(*PASSKEY, "--batch-size", "4", "--json", str(out))
    assert_one_line_error(fixed, "out of memory on cpu (tried to allocate ", " GiB) while evaluating dense on "
                          "passkey@256 at batch 4: try --batch-size auto (or a smaller --batch-size), fewer "
                          "--num-seeds or --limit, a shorter --context-length, or another --device")
    assert "Traceback" not in fixed.output and not out.exists()
    with allocations_capped_in(retrofit.eval.generation, "generate", limit=0):  # not even one row fits
        auto = run(*PASSKEY, "--json", str(out))
    assert_one_line_error(auto, "while evaluating dense on passkey@256 at batch 1: try a shorter --context-length, "
                          "--dtype bfloat16, or another --device")
    assert not out.exists()


def test_generate_out_of_memory_is_one_line():
    with allocations_capped_in(StaticGeneration, "prefill", limit=0) as caps:
        result = run("generate", "smollm2-135m", "--prompt", "Once upon a time", "--max-new-tokens", "4",
                     "--device", "cpu")
    assert caps[0].raised == 1
    assert_one_line_error(result, "out of memory on cpu (tried to allocate ", ") while generating 4 tokens: try a "
                          "shorter --prompt, fewer --max-new-tokens, --dtype bfloat16, or another --device")
    assert result.stdout == "" and "Traceback" not in result.output


def test_bench_records_a_point_that_does_not_fit_and_says_what_did(tmp_path):
    out = tmp_path / "bench.json"
    batch_of_two = lambda model, input_ids, *args, **kwargs: input_ids.shape[0] == 2  # noqa: E731
    with allocations_capped_in(retrofit.bench.measure, "time_retrofit", limit=0, when=batch_of_two):
        result = run("bench", "smollm2-135m", "--layers", "2", "--context", "64", "--batch", "1,2",
                     "--decode-tokens", "2", "--repeats", "1", "--warmup", "0", "--device", "cpu", "--json", str(out))
    assert result.exit_code == 0, result.output
    points = json.loads(out.read_text())["results"]
    assert [(p["batch"], p["error"] is None) for p in points] == [(1, True), (2, False)]
    assert points[1]["error"].startswith("out of memory (tried to allocate ")
    note = next(line for line in result.stdout.splitlines() if line.startswith("dense (retrofit) at 64:"))
    peak = points[0]["peak_bytes"] / 2 ** 30
    assert note == (f"dense (retrofit) at 64: batch 2 ran out of memory; batch 1 fit (peak {peak:.2f} GiB): run "
                    "--batch 1 at this length, or another --device.")


def test_bench_out_of_memory_outside_a_point_is_one_line(tmp_path):
    out = tmp_path / "bench.json"
    on_cpu = lambda name, dtype, device, *args: device.type == "cpu"  # noqa: E731 - the meta skeleton allocates nothing
    with allocations_capped_in(retrofit.bench.configs, "build_random_model", limit=0, when=on_cpu):
        result = run("bench", "smollm2-135m", "--layers", "2", "--context", "64", "--device", "cpu", "--json",
                     str(out))
    assert_one_line_error(result, "out of memory on cpu (tried to allocate ", ") while building smollm2-135m with "
                          "random weights: try --dtype bfloat16, --layers N, or another --device")
    assert not out.exists() and "Traceback" not in result.output


def test_loading_a_model_that_does_not_fit_is_one_line_and_not_a_damaged_checkpoint():
    """An allocation refused while the weights load reads as out of memory (what to try: a smaller dtype, another
    device), not as "cannot load the model" (which says the checkpoint is at fault)."""
    import importlib

    loading = importlib.import_module("retrofit.load")  # the module (``retrofit.load`` is also the function)
    with allocations_capped_in(loading, "_load_resolved", limit=0):
        result = run("inspect", "smollm2-135m", "--device", "cpu")
    assert_one_line_error(result, "out of memory on cpu (tried to allocate ", ") while loading smollm2-135m: try "
                          "--dtype bfloat16 or another --device")


def test_a_command_that_does_not_name_its_work_still_says_it_in_one_line(calib_data_dir):
    """select does not name its scoring: the command group's line names the command and its own advice."""
    import retrofit.convert.selection

    with allocations_capped_in(retrofit.convert.selection, "rank_layers", limit=0):
        result = run("select", "smollm2-135m", "--fraction", "0.25", "--data", str(calib_data_dir / "walden.txt"),
                     "--seq-len", "128", "--align-steps", "1", "--batch-size", "8", "--probe-windows", "1",
                     "--retrieval-probes", "1", "--probe-context", "512", "--quiet", "--device", "cpu")
    assert_one_line_error(result, "out of memory on cpu (tried to allocate ", ") while running retrofit select: try "
                          "a smaller --batch-size, a shorter --seq-len or --probe-context, or another --device")
    assert "Traceback" not in result.output


def test_gates_out_of_memory_keeps_its_checkpoint_and_resume_finishes(calib_data_dir, tmp_path):
    """Memory runs out in the second step of gate training (the first step's checkpoint is written): one line that
    names the checkpoint, no gate file, and --resume trains the one step left."""
    import itertools

    from retrofit.sparse.methods.seer import training

    out = tmp_path / "smol.gates"
    gates = ("gates", "smollm2-135m", "--data", str(calib_data_dir / "walden.txt"), "--tokens", "256", "--seq-len",
             "128", "--block-size", "16", "--hidden", "32", "--queries", "8", "--save-every", "1", "--device", "cpu",
             "--out", str(out))
    calls = itertools.count()
    second_step = lambda *args, **kwargs: next(calls) >= 30  # one gate loss per layer, 30 layers a step
    with allocations_capped_in(training, "gate_loss", limit=0, when=second_step) as caps:
        stopped = run(*gates)
    assert len(caps) == 1 and caps[0].raised == 1
    checkpoint = tmp_path / "smol.gates.ckpt"
    assert_one_line_error(stopped, "out of memory on cpu (tried to allocate ", f") while training gates for {out}; "
                          f"its last checkpoint (step 1) is kept in {checkpoint}, and the same command with --resume "
                          "continues from it: try --resume where more memory is free, or start over with a shorter "
                          "--seq-len, fewer --queries, --dtype bfloat16, or another --device")
    assert "Traceback" not in stopped.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol.gates.ckpt"]  # no half-written gate file
    assert torch.load(checkpoint, weights_only=True)["step"] == 1

    resumed = run(*gates, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert torch.load(checkpoint, weights_only=True)["step"] == 2 and out.is_file()


def test_lm_eval_out_of_memory_is_one_line(eval_data_dir):
    """A forward pass inside lm-evaluation-harness that does not fit: the bridge's last line says so, exit 2."""
    from retrofit.harness.model import RetrofitLM

    with allocations_capped_in(RetrofitLM, "_model_call", limit=0) as caps:
        result = run("lm-eval", "--model", "retrofit", "--model_args", "pretrained=smollm2-135m", "--tasks",
                     "retrofit_piqa", "--limit", "2", "--metadata", f"data_dir={eval_data_dir}", "--device", "cpu")
    assert len(caps) == 1 and caps[0].raised == 1
    assert result.exit_code == 2, result.output
    # lm-eval's own INFO log lines may come first; the error is the last line, and no traceback
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("retrofit: error: out of memory on cpu (tried to allocate "), last
    assert last.endswith(" while running retrofit lm-eval: try a smaller --batch_size (or auto), --limit, or another "
                         "--device"), last
    assert "Traceback" not in result.stderr


CONVERT = ("smollm2-135m", "--recipe", "smollm2-135m/cpu-small", "--layers", "22", "--tokens", "512", "--seq-len",
           "32", "--batch-size", "2", "--stage1-fraction", "0.5", "--checkpoint-every", "2", "--no-report", "--quiet")


def test_convert_out_of_memory_keeps_its_checkpoint_and_resume_reaches_the_same_weights(calib_data_dir, tmp_path):
    data = ("--data", str(calib_data_dir / "walden.txt"))
    straight = run("convert", *CONVERT, *data, "--out", str(tmp_path / "straight"))
    assert straight.exit_code == 0, straight.output

    out = tmp_path / "stopped"
    last_step = lambda self, stage, step, micro: (stage, step) == (2, 3)  # noqa: E731 - after the step-2 checkpoint
    with allocations_capped_in(Distiller, "_batch", limit=0, when=last_step) as caps:
        stopped = run("convert", *CONVERT, *data, "--out", str(out))
    assert len(caps) == 1 and caps[0].raised == 1
    work_dir = work_dir_for(out)
    assert_one_line_error(stopped, "out of memory on cpu (tried to allocate ", f") while converting to {out}; its "
                          f"last checkpoint (stage 2, step 2) is kept in {work_dir}, and the same command with "
                          "--resume continues from it: try --resume where more memory is free, or start over with "
                          "a smaller --batch-size")
    assert "Traceback" not in stopped.output
    assert not out.exists()  # no half-written hybrid
    assert saved_position(work_dir) == (2, 2) and (work_dir / STATE_FILE).is_file()

    resumed = run("convert", *CONVERT, *data, "--out", str(out), "--resume")
    assert resumed.exit_code == 0, resumed.output
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6  # the resume test's bar: the same weights


def test_out_of_memory_is_a_retrofit_error_and_the_cap_refuses_only_new_storage():
    assert issubclass(OutOfMemory, RetrofitError) and str(OutOfMemory(None, "")) == "out of memory"
    cap = AllocationCap(limit=16)
    with pytest.raises(torch.OutOfMemoryError), cap:
        torch.zeros(5)  # 20 bytes
    assert cap.raised == 1 and cap.largest == 20
    x = torch.zeros(100)
    with AllocationCap(limit=16) as cap:
        x.view(10, 10).add_(1)  # a view and an in-place update allocate nothing
    assert cap.raised == 0 and cap.largest == 0
