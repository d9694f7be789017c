"""`retrofit bench`: prefill/decode latency, tokens/s and memory versus context length and batch size."""
from __future__ import annotations

import time
from pathlib import Path

import click

from retrofit.bench.measure import ENGINES
from retrofit.errors import RetrofitError
from retrofit.prefill_defaults import MIN_LENGTH_HELP

BENCH_HELP = """Measure prefill latency, decode latency per token, tokens/s, peak memory really allocated and the
bytes held by the KV/state cache, for dense MODEL_OR_CONFIG and each variant, at every --context x --batch.

\b
MODEL_OR_CONFIG: a model (directory, .gguf, hub id, alias smollm2-135m) or a config
  name built with random weights in the target dtype directly on the device:
  llama3-8b, qwen2.5-7b, smollm2-135m  (--layers N keeps the first N layers)
\b
Variants (dense always runs first, each variant after it; one model on the device at a time):
  --sparse quest --budget 1024 [--sparse-arg page_size=16]   (repeatable)
  --variant "quest:budget=1024,page_size=16"                  (repeatable)
  --hybrid DIR                                                (repeatable)
  --variant convert:KIND:LAYERS                               (repeatable)
      converts the benched model in memory (no checkpoint, no distillation: for speed and memory only):
      KIND gdn or kda; LAYERS 0,2,4 | 3-6 | every:K[:OFFSET] | sliding | not:SPEC (every layer SPEC leaves out),
      e.g. convert:gdn:not:every:4 = 3 of 4 layers GDN, every 4th layer (3, 7, ...) softmax.
      Weights other than the new layers are shared with the dense model, and freed after the variant.
\b
  --variant "convert:gdn:not:every:4+quest:budget=2048"       (repeatable)
      A+B: variant B opened on the model variant A yields, e.g. sparse decoding on a converted hybrid's
      softmax layers. seer:budget=N,random_gates=true: untrained gates of the right shape (speed only).
\b
  --prefill xattention [--prefill-arg threshold=0.9]          (repeatable)
  --variant "prefill:xattention:max_density=0.1"              (repeatable)
      block-sparse prefill on the softmax layers; the table gives the prefill seconds and time to first
      token beside dense, and a second table the share of the blocks each layer computed. Prefill
      MIN_LENGTH_HELP.
      On random weights the scores say little: max_density fixes the share of blocks for a speed run.
\b
Engines (--engine, repeatable): retrofit (default; static cache, decode step captured as a CUDA graph on
  CUDA, the decoder layers of families with a fused decode path through fused kernels where they run on Triton;
  the table's notes say which layers ran unfused), retrofit-unfused
  (the same with the model's own decoder layers: fuse_layers=False), transformers (model.generate, growing
  cache), transformers-compile (model.generate with transformers' static cache and torch.compile; sparse
  variants are refused in their rows). Each point: --warmup runs, then --repeats timed runs; the table shows the medians, the spread, and
  the bytes floor of a step (weights + keys/values or states read, over the copy bandwidth measured at the
  start of the run).
\b
Examples:
  retrofit bench llama3-8b --context 4k,32k --batch 1,8 --device cuda --dtype bfloat16 --json bench.json \\
      --plot bench.png    (decode tokens/s and prefill s against context, a line per variant, engine and batch)
  retrofit bench llama3-8b --context 4k,32k,127k --batch 1,8 --device cuda --dtype bfloat16 \\
      --variant quest:budget=2048 --variant clusterkv:budget=2048 --variant seer:budget=2048,random_gates=true \\
      --variant streaming:budget=2048 --variant convert:gdn:not:every:4 --variant convert:kda:not:every:4 \\
      --variant "convert:gdn:not:every:4+quest:budget=2048" --engine retrofit --json bench_retrofit.json
  (the same with --engine transformers and --engine transformers-compile; 127k: the prompt and the
  decode tokens + 3 must fit in the config's 131072 positions)
  retrofit bench smollm2-135m --layers 4 --context 256 --batch 1,2 --decode-tokens 8 \\
      --variant convert:gdn:not:every:4 --variant quest:budget=64
""".replace("MIN_LENGTH_HELP", MIN_LENGTH_HELP)

DEFAULT_CONTEXTS = "1k,4k,16k"


@click.command("bench", help=BENCH_HELP)
@click.argument("model_or_config")
@click.option("--context", "contexts", default=None,
              help=f"Comma-separated prompt lengths in tokens (1k = 1024) [default: {DEFAULT_CONTEXTS}, those that "
                   "fit the model's positions].")
@click.option("--batch", "batches", default="1", show_default=True, help="Comma-separated batch sizes.")
@click.option("--decode-tokens", type=int, default=32, show_default=True, help="Decode steps timed per point.")
@click.option("--layers", type=int, default=None, help="Truncate a named config to its first N layers.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option("--dtype", default=None, help="float32, bfloat16 or float16 [default: float32 on CPU, bfloat16 on CUDA]")
@click.option("--sparse", "sparse_methods", multiple=True, metavar="METHOD", help="Sparse method (repeatable).")
@click.option("--budget", "budgets", multiple=True, type=int, metavar="N", help="Token budget (repeatable).")
@click.option("--sparse-arg", "sparse_args", multiple=True, metavar="KEY=VALUE", help="Extra sparse keyword.")
@click.option("--prefill", "prefill_methods", multiple=True, metavar="METHOD",
              help="Sparse prefill method (repeatable): xattention or vertical_slash.")
@click.option("--prefill-arg", "prefill_args", multiple=True, metavar="KEY=VALUE",
              help="Sparse prefill parameter (see above).")
@click.option("--hybrid", "hybrid_dirs", multiple=True, metavar="DIR", help="Hybrid checkpoint dir (repeatable).")
@click.option("--variant", "variant_specs", multiple=True, metavar="SPEC",
              help="Variant spec (repeatable): METHOD:budget=N[,key=value...], prefill:METHOD[:key=value,...], "
                   "hybrid:DIR or convert:KIND:LAYERS.")
@click.option("--engine", "engines", type=click.Choice(list(ENGINES)), multiple=True, default=("retrofit",),
              show_default=True, help="What generates (repeatable: the engines run one after another in this run; "
                                      "see above).")
@click.option("--repeats", type=int, default=3, show_default=True, help="Timed runs per point (median reported).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed runs per point before the timed ones.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the results here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a PNG chart here: decode tokens/s and prefill s against context (needs matplotlib).")
def bench_command(model_or_config: str, contexts: str, batches: str, decode_tokens: int, layers: int | None,
                  device: str, dtype: str | None, sparse_methods: tuple[str, ...], budgets: tuple[int, ...],
                  sparse_args: tuple[str, ...], prefill_methods: tuple[str, ...], prefill_args: tuple[str, ...],
                  hybrid_dirs: tuple[str, ...], variant_specs: tuple[str, ...],
                  engines: tuple[str, ...], repeats: int, warmup: int, json_path: Path | None,
                  plot_path: Path | None) -> None:
    from retrofit.atomic import write_json
    import torch

    from retrofit.bench.configs import MODEL_CONFIGS, build_random_model, check_fits
    from retrofit.bench.floor import copy_bandwidth
    from retrofit.bench.measure import run_bench
    from retrofit.bench.report import fusion_note, markdown_table, variant_notes
    from retrofit.generation.fused_layers import fusion_coverage
    from retrofit.cliargs import parse_lengths
    from retrofit.devices import default_dtype, parse_device, parse_dtype
    from retrofit.load import ALIASES, load
    from retrofit.memory import reported
    from retrofit.run_info import library_versions
    from retrofit.variants import variants_from_options

    if plot_path is not None:
        from retrofit.plotting import pyplot

        pyplot()  # a missing matplotlib is told before the run, not after it
    context_list = list(parse_lengths(contexts or DEFAULT_CONTEXTS, "--context"))
    batch_list = list(parse_lengths(batches, "--batch"))
    if decode_tokens <= 0:
        raise RetrofitError(f"--decode-tokens must be positive, got {decode_tokens}")
    if repeats <= 0 or warmup < 0:
        raise RetrofitError(f"--repeats must be positive and --warmup not negative, got {repeats} and {warmup}")
    variants = variants_from_options(list(sparse_methods), list(budgets), list(sparse_args), list(hybrid_dirs),
                                     list(variant_specs), list(prefill_methods), list(prefill_args))
    dtype = dtype or default_dtype(device)
    torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
    built = time.perf_counter()
    if model_or_config in MODEL_CONFIGS:
        # shapes only (meta tensors): variants, lengths and memory are checked before any weight is allocated
        skeleton = build_random_model(model_or_config, torch_dtype, torch.device("meta"), layers)
        for variant in variants:
            variant.describe(skeleton)
        context_list = context_list if contexts else default_contexts(skeleton, context_list, decode_tokens)
        check_lengths(skeleton, context_list, decode_tokens)
        check_fits(skeleton, torch_device, torch_dtype)
        with reported(f"building {model_or_config} with random weights", device=torch_device,
                      advice="--dtype bfloat16, --layers N, or another --device"):
            model, tokenizer = build_random_model(model_or_config, torch_dtype, torch_device, layers), None
        source = f"config {model_or_config} (random weights)"
    else:
        if layers is not None:
            raise RetrofitError("--layers applies to a config name (llama3-8b, qwen2.5-7b, smollm2-135m) only")
        if "/" not in model_or_config and not Path(model_or_config).expanduser().exists() \
                and model_or_config not in ALIASES:  # a bare name is meant as a config: no 30 s of hub retries
            raise RetrofitError(MODEL_CONFIGS.unknown_message(model_or_config)
                                + "; or a model directory, a .gguf file, or a hub id org/name")
        with reported(f"loading {model_or_config}", advice="--dtype bfloat16 or another --device", device=torch_device):
            model, tokenizer = load(model_or_config, dtype=torch_dtype, device=torch_device)
        source = model_or_config
    build_seconds = time.perf_counter() - built
    details = {variant.name: variant.describe(model) for variant in variants}  # bad variants fail before any run
    context_list = context_list if contexts else default_contexts(model, context_list, decode_tokens)
    check_lengths(model, context_list, decode_tokens)
    bandwidth = copy_bandwidth(torch_device)
    config = {"model": model_or_config, "source": source, "layers": model.config.num_hidden_layers,
              "contexts": context_list, "batches": batch_list, "decode_tokens": decode_tokens,
              "engine": ",".join(engines), "repeats": repeats, "warmup": warmup, "copy_bandwidth_bytes_per_s": bandwidth,
              "device": str(torch_device), "dtype": dtype, "build_seconds": build_seconds,
              "parameters": sum(p.numel() for p in model.parameters()),
              "variants": ["dense"] + [variant.name for variant in variants],
              "variant_details": {name: facts for name, facts in details.items() if facts},
              "decode_fusion": fusion_coverage(model),
              "versions": library_versions()}
    if torch_device.type == "cuda":
        config["gpu"] = torch.cuda.get_device_name(torch_device)

    def save(points, complete: bool) -> None:
        if json_path is not None:  # rewritten after every point: a run cut short keeps what it measured
            write_json(json_path, {"results": [point.to_json() for point in points],
                                   "config": {**config, "complete": complete}})

    points = []
    for engine in dict.fromkeys(engines):  # each engine once, in the order given
        points += run_bench(model, variants, tokenizer, context_list, batch_list, decode_tokens, engine=engine,
                            repeats=repeats, warmup=warmup, bandwidth=bandwidth,
                            on_point=lambda engine_points: save(points + engine_points, complete=False))
    save(points, complete=True)
    notes = variant_notes(details)
    if "retrofit" in engines:
        notes.append(fusion_note(config["decode_fusion"]))
    click.echo(markdown_table(points, notes, bandwidth))
    if plot_path is not None:
        from retrofit.bench.plot import chart_title, save_bench_plot

        save_bench_plot([point.to_json() for point in points], plot_path, title=chart_title(config))


def default_contexts(model, contexts: list[int], decode_tokens: int) -> list[int]:
    """The default ``contexts`` that fit the model's positions with the new tokens, the others named on stderr;
    RetrofitError if none does."""
    from retrofit.bench.measure import SETTLE_STEPS
    from retrofit.model_info import max_model_length

    limit, new_tokens = max_model_length(model), decode_tokens + SETTLE_STEPS + 1
    fitting = [context for context in contexts if context + new_tokens <= limit]
    if not fitting:
        raise RetrofitError(f"none of the default contexts ({DEFAULT_CONTEXTS}) fits the model's {limit:,} positions "
                            f"with {new_tokens} new tokens: give --context")
    if len(fitting) < len(contexts):
        left_out = ", ".join(f"{context:,}" for context in contexts if context not in fitting)
        click.echo(f"retrofit: bench: contexts of {left_out} tokens left out of the defaults: over the model's "
                   f"{limit:,} positions (--context names others)", err=True)
    return fitting


def check_lengths(model, contexts: list[int], decode_tokens: int) -> None:
    """RetrofitError unless every prompt length plus the new tokens fits the model's positions."""
    from retrofit.bench.measure import SETTLE_STEPS
    from retrofit.model_info import max_model_length

    limit = max_model_length(model)
    new_tokens = decode_tokens + SETTLE_STEPS + 1
    for context in contexts:
        if context + new_tokens > limit:
            raise RetrofitError(f"--context {context} + {new_tokens} new tokens is over the model's limit of "
                                f"{limit} positions (max_position_embeddings)")
