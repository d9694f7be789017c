"""`retrofit bench`: published model shapes, exact cache bytes, a real peak-memory probe, and the CLI."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from retrofit._entry import cli_module
from retrofit.bench.configs import build_random_model
from retrofit.bench.measure import measure_point
from retrofit.bench.memory import MemoryProbe, tensor_bytes


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
    # 2 layers x (K and V) x 3 KV heads x head dim 64 x 4 bytes x batch 3 x (40 prompt + 3 fed-back tokens)
    assert point.cache_bytes == 2 * 2 * 3 * 64 * 4 * 3 * (40 + 3)
    assert point.prefill_s > 0 and point.decode_s_per_token > 0
    assert point.peak_bytes >= point.peak_delta_bytes


def test_tensor_bytes_counts_each_storage_once():
    big = torch.zeros(1000, dtype=torch.float32)
    holder = {"a": big, "b": [big[:10], torch.zeros(5, dtype=torch.float16)]}
    assert tensor_bytes(holder) == 4000 + 10


def test_cpu_probe_sees_a_real_allocation():
    # 256 MiB is above glibc's largest mmap threshold (32 MiB), so it is fresh memory, not a reused free block
    with MemoryProbe(torch.device("cpu")) as probe:
        block = torch.ones(256 * 1024 * 1024 // 4)  # touched, so resident
        del block
    # the peak RSS rose by the block (page granularity and allocator slack can add a little, never subtract)
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
    lines = result.stdout.splitlines()
    assert lines[0].startswith("| variant | context | batch | prefill s |")
    assert len([line for line in lines if line.startswith("| dense |")]) == 4


def test_bench_context_over_limit_is_one_line_error():
    result = run("bench", "smollm2-135m", "--layers", "1", "--context", "8k", "--device", "cpu")
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "over the model's limit of 8192" in result.stderr


def test_bench_unknown_layers_for_a_model_path(tmp_path):
    result = run("bench", "smollm2-135m", "--layers", "99", "--context", "64", "--device", "cpu")
    assert result.exit_code == 2 and "--layers must be in 1..30" in result.stderr


@pytest.mark.gpu
def test_gpu_bench_memory_accounts_for_the_cache():
    """On CUDA the allocator peak over the weights must cover the KV cache that generate() kept."""
    model = build_random_model("llama3-8b", torch.bfloat16, torch.device("cuda"), layers=2)
    point = measure_point(model, "dense", context=4096, batch=2, decode_tokens=4)
    # 2 layers x K,V x 8 KV heads x 128 x 2 bytes x batch 2 x (4096 + 4)
    assert point.cache_bytes == 2 * 2 * 8 * 128 * 2 * 2 * (4096 + 4)
    assert point.peak_delta_bytes >= point.cache_bytes
    assert point.memory_kind == "cuda allocated"
