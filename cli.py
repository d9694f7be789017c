"""The `retrofit` command line: convert, generate, eval, bench, inspect, ... (installed as ``retrofit.commands.cli``)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import click

from retrofit.cliargs import refuse_without
from retrofit.errors import RetrofitError
from retrofit.prefill_defaults import MIN_LENGTH_HELP

MODEL_HELP = ("A local model directory, a .gguf file, a hub id (org/name), or an alias: smollm2-135m, qwen2.5-0.5b or "
              "gemma3-270m (fetched once; `retrofit inspect ALIAS` names its licence).")


# The commands that live beside their feature: name -> (module, command object, the line `retrofit --help` lists).
# A command's module is imported only when that command runs or shows its own help, so that `retrofit --help`,
# `retrofit --version` and the commands defined here import no model library before they need one.
COMMANDS = {
    "bench": ("retrofit.bench.command", "bench_command", "Latency, tokens/s and memory vs context length."),
    "convert": ("retrofit.eval.convert_command", "convert_command",
                "Convert layers to GDN/KDA, distil, save; then dense vs hybrid on held-out data."),
    "eval": ("retrofit.eval.command", "eval_command",
             "Accuracy of dense vs variants (ppl, multiple choice, RULER-style)."),
    "gates": ("retrofit.sparse.methods.seer.command", "gates_command",
              "Train SeerAttention's decode gates for a frozen model."),
    "lm-eval": ("retrofit.harness.command", "lm_eval_command",
                "lm-evaluation-harness with retrofit models (sparse, hybrid) and local tasks."),
    "lm-eval-task": ("retrofit.harness.command", "lm_eval_task_command",
                     "Write a synthetic long-context task for lm-eval (--include_path)."),
    "select": ("retrofit.convert.command", "select_command", "Rank a model's layers by the cost of converting each."),
}


# What to try when a command runs out of memory (its line names the device and the allocation that failed).
OUT_OF_MEMORY_ADVICE = {
    "eval": "--batch-size auto (or a smaller --batch-size), fewer --num-seeds or --limit, a shorter --context-length, "
            "or another --device",
    "generate": "a shorter --prompt, fewer --max-new-tokens, --dtype bfloat16, or another --device",
    "bench": "a smaller --batch, a shorter --context, --dtype bfloat16, --layers N, or another --device",
    "convert": "a smaller --batch-size (a larger --grad-accum keeps the tokens per step), a shorter --seq-len, "
               "--checkpoint-activations-from, or another --device",
    "select": "a smaller --batch-size, a shorter --seq-len or --probe-context, or another --device",
    "gates": "a shorter --seq-len, fewer --queries, --dtype bfloat16, or another --device",
    "lm-eval": "a smaller --batch_size (or auto), --limit, or another --device",
}
DEFAULT_OUT_OF_MEMORY_ADVICE = "a smaller setting or another --device"


class RetrofitGroup(click.Group):
    """Bad input of any kind ends in one line on stderr and exit code 2: a :class:`RetrofitError` (retrofit's own
    checks), click's usage errors (a missing or malformed option), and running out of memory (a setting too large
    for the device: the line names the device, the work and what to try; :mod:`retrofit.memory`) alike. The commands
    of :data:`COMMANDS` are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            module, attribute, short_help = COMMANDS[name]
            command = getattr(importlib.import_module(module), attribute)
            command.short_help = short_help
            self.add_command(command, name)
        return self.commands.get(name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list of ``--help``, without importing the commands of :data:`COMMANDS`."""
        limit = formatter.width - 6 - max(len(name) for name in self.list_commands(ctx))
        rows = [(name, self.commands[name].get_short_help_str(limit) if name in self.commands else COMMANDS[name][2])
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            command = err.ctx.command_path if err.ctx is not None else ctx.command_path
            message = " ".join(err.format_message().split())
            click.echo(f"retrofit: error: {message} (see: {command} --help)", err=True)
            ctx.exit(err.exit_code)
        except Exception as err:  # noqa: BLE001 - re-raised unless it is bad input or out of memory
            failure = self._one_line(ctx, err)
            if failure is None:
                raise
        click.echo(f"retrofit: error: {failure}", err=True)  # outside the except: the failed work is freed first
        ctx.exit(2)

    @staticmethod
    def _one_line(ctx: click.Context, err: Exception) -> Exception | None:
        """The error to print in one line: a RetrofitError as it is (an :class:`OutOfMemory` given the command's
        advice if it has none), any other out-of-memory error as an OutOfMemory naming the command; else None."""
        from retrofit.memory import OutOfMemory, is_out_of_memory, out_of_memory

        command = ctx.invoked_subcommand
        advice = OUT_OF_MEMORY_ADVICE.get(command, DEFAULT_OUT_OF_MEMORY_ADVICE)
        if isinstance(err, OutOfMemory):
            err.advice = err.advice or advice
            return err
        if isinstance(err, RetrofitError):
            return err
        if is_out_of_memory(err):
            return out_of_memory(err, f"running retrofit {command}", advice)
        return None


@click.group(cls=RetrofitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="retrofit")
def main() -> None:
    """Make long context cheap for a pretrained dense causal LM: convert it to a hybrid, patch it with sparse
    decoding, and measure what that cost and bought against the dense model.

    \b
    Examples:
      retrofit inspect smollm2-135m
      retrofit generate smollm2-135m --chat --prompt "What is the capital of France?"
    """


def model_options(command):
    command = click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")(command)
    command = click.option("--dtype", default="float32", show_default=True,
                           help="float32, bfloat16 or float16 (the dtype the weights are loaded in).")(command)
    return command


@main.command(help="Print MODEL's layers, attention type per layer, heads, KV heads, head dim, parameters and "
                   "KV-cache bytes per token at the model's dtype.\n\nMODEL: " + MODEL_HELP,
              short_help="Show a model's attention layout and KV-cache cost.")
@click.argument("model")
@model_options
def inspect(model: str, device: str, dtype: str) -> None:
    from retrofit.inspect import describe
    from retrofit.load import ALIASES, load

    loaded, _ = load(model, dtype=dtype, device=device)
    click.echo(describe(loaded, name=model, licence=ALIASES[model].licence if model in ALIASES else None))


@main.command(help="Generate from MODEL with retrofit's decode engine (static cache; on CUDA the decode step is "
                   "replayed as a CUDA graph), streaming the text to stdout; on stderr at the end, the prefill (the "
                   "prompt's tokens and their time to the first new token) and the decode steps after it, each with "
                   "its tokens/s.\n\nMODEL: "
                   + MODEL_HELP + "\n\n\b\nExamples:\n  retrofit generate smollm2-135m --chat --prompt "
                   "\"What is the capital of France?\"\n  retrofit generate smollm2-135m --prompt \"Once upon a time\" "
                   "--temperature 0.8 --top-p 0.95 --seed 1\n  retrofit generate smollm2-135m --prompt \"...\" "
                   "--sparse quest --budget 1024\n  retrofit generate smollm2-135m --prompt \"...\" --prefill xattention "
                   "--prefill-arg min_length=0\n  retrofit generate qwen2.5-0.5b --prompt-file notes.txt "
                   "--max-new-tokens 64",
              short_help="Generate text (dense, hybrid, sparse prefill or sparse decoding).")
@click.argument("model")
@click.option("--prompt", default=None, help="The text to continue (or the user message with --chat).")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Read the prompt from this UTF-8 text file instead of --prompt.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float,
              help="0 decodes greedily; above 0 samples at that temperature.")
@click.option("--top-p", default=None, type=float, help="Sample from the smallest set of tokens reaching this "
              "probability (needs --temperature > 0).")
@click.option("--seed", default=None, type=int, help="Seed of the sampling (needs --temperature > 0).")
@click.option("--sparse", "sparse_method", default=None,
              help="Sparse decoding method: streaming, quest, clusterkv, retrieval or seer (default: dense).")
@click.option("--budget", default=2048, show_default=True, type=int, help="Tokens read per KV head per step (--sparse).")
@click.option("--sparse-arg", "sparse_args", multiple=True, metavar="K=V",
              help="A method parameter, e.g. page_size=16 or gate_path=runs/smol.gates. Repeatable.")
@click.option("--prefill", "prefill_method", default=None,
              help="Sparse prefill method: xattention or vertical_slash (default: dense prefill); with --sparse, "
                   "both in one session.")
@click.option("--prefill-arg", "prefill_args", multiple=True, metavar="K=V",
              help=f"A sparse prefill parameter, e.g. threshold=0.9 or min_length=1024 ({MIN_LENGTH_HELP}). "
                   "Repeatable.")
@model_options
def generate(model: str, prompt: str | None, prompt_file: Path | None, chat: bool, max_new_tokens: int,
             temperature: float, top_p: float | None, seed: int | None, sparse_method: str | None, budget: int,
             sparse_args: tuple[str, ...], prefill_method: str | None, prefill_args: tuple[str, ...], device: str,
             dtype: str) -> None:
    from contextlib import nullcontext

    from retrofit.generation import SamplingOptions, stream_generate
    from retrofit.load import load
    from retrofit.cliargs import parse_pairs
    from retrofit.memory import reported
    from retrofit.sparse import build_method, parse_sparse_args, sparse_decoding, sparse_prefill
    from retrofit.sparse.prefill import build_prefill_method

    # bad options fail before the model is loaded
    refuse_without(click.get_current_context(), {"budget": (sparse_method is not None, "--sparse METHOD")})
    if (prompt is None) == (prompt_file is None):
        raise RetrofitError("give the text to continue as --prompt TEXT or --prompt-file PATH (one of them)")
    if prompt_file is not None:
        prompt = prompt_file.read_text(encoding="utf-8")
    if not prompt.strip():
        raise RetrofitError(f"{'--prompt' if prompt_file is None else f'--prompt-file {prompt_file}'} is empty: "
                            "give the text to continue")
    if max_new_tokens <= 0:
        raise RetrofitError(f"--max-new-tokens must be a positive number of tokens, got {max_new_tokens}")
    if temperature < 0:
        raise RetrofitError(f"--temperature must be 0 (greedy) or above, got {temperature}")
    sampling = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_p=top_p,
                    seed=seed)
    try:
        SamplingOptions.checked(**sampling)
    except RetrofitError:
        given = " and ".join(option for option, value in (("--top-p", top_p), ("--seed", seed)) if value is not None)
        if temperature == 0 and given:
            raise RetrofitError(f"{given} only apply to sampling: give a --temperature above 0 (0 is greedy)") from None
        raise
    if sparse_args and not sparse_method:
        raise RetrofitError("--sparse-arg needs --sparse METHOD")
    params = parse_sparse_args(sparse_args) if sparse_method else {}
    if sparse_method:
        build_method(sparse_method, budget, **{k: v for k, v in params.items() if k not in ("layers", "kernel")})
    if prefill_args and not prefill_method:
        raise RetrofitError("--prefill-arg needs --prefill METHOD")
    prefill_params = parse_pairs(prefill_args, "--prefill-arg")
    if prefill_method:
        build_prefill_method(prefill_method,
                             **{key: value for key, value in prefill_params.items() if key not in ("layers", "kernel")})
    loaded, tokenizer = load(model, dtype=dtype, device=device)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise RetrofitError(f"{model} has no chat template: drop --chat and give a prompt to continue")
    if sparse_method:
        prefill = {"prefill": prefill_method, "prefill_args": prefill_params} if prefill_method else {}
        patch = sparse_decoding(loaded, method=sparse_method, budget=budget, **prefill, **params)
    elif prefill_method:
        patch = sparse_prefill(loaded, method=prefill_method, **prefill_params)
    else:
        patch = nullcontext()
    what = f"generating {max_new_tokens} tokens" + (f" with {sparse_method}@{budget}" if sparse_method else "")
    with reported(what, device=next(loaded.parameters()).device), patch:
        streamed = stream_generate(loaded, tokenizer, prompt, chat=chat, max_new_tokens=max_new_tokens,
                                   out=sys.stdout, **sampling)
    click.echo(f"\n[{streamed.summary()}]", err=True)
