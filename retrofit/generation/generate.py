"""``retrofit.generate``: the one generation entry point for a dense model, a hybrid, and a model inside
``retrofit.sparse_decoding(...)``; ``retrofit generate``, eval's generation tasks and ``retrofit bench`` use it."""
from __future__ import annotations

from typing import Any

import torch

from retrofit.errors import RetrofitError
from retrofit.generation.engine import DEFAULT_PREFILL_CHUNK, DEFAULT_STOP_CHECK_EVERY, StaticGeneration
from retrofit.generation.graphs import CapturedStep, warm_up
from retrofit.generation.inputs import SamplingOptions, checked_prompt, eos_token_ids
from retrofit.generation.inputs import pad_token_id as default_pad_token_id
from retrofit.generation.kept import KeptGeneration, captured_and_dropped, keep, reuse_key, take
from retrofit.generation.sampling import TokenChooser
from retrofit.model_info import attention_layout
from retrofit.sparse.patch import active_session


def graphs_wanted(generation: StaticGeneration, cuda_graph: bool | None) -> bool:
    """Whether the decode step is captured: on CUDA by default, unless the sparse method's step cannot be (its
    selection runs on the host) or the model's MLP is a mixture of experts (transformers routes tokens with host-side
    bookkeeping: its architecture record's ``experts``); ``cuda_graph=True`` off CUDA or with such a step is a
    RetrofitError."""
    session = generation.session
    experts = generation.layout.architecture.experts
    if cuda_graph and experts:
        raise RetrofitError(f"{generation.layout.architecture.model_type}'s mixture of experts routes tokens on the "
                            "host: its decode step cannot be captured as a CUDA graph (cuda_graph=False runs it eagerly)")
    capturable = (session is None or session.method.capturable) and not experts
    on_cuda = generation.device.type == "cuda"
    if cuda_graph is None:
        return on_cuda and capturable
    if cuda_graph and not on_cuda:
        raise RetrofitError("cuda_graph=True needs the model on a CUDA device")
    if cuda_graph and not capturable:
        raise RetrofitError(f"sparse method {session.method.name!r} searches on the host at every step: its decode "
                            "step cannot be captured as a CUDA graph (cuda_graph=False runs it eagerly)")
    return bool(cuda_graph)


class DecodeLoop:
    """Runs the decode steps of a prefilled :class:`StaticGeneration`: eagerly, or the first one eagerly and the
    rest as replays of a captured graph; the host reads the device only every ``stop_check_every`` steps."""

    def __init__(self, generation: StaticGeneration, stop_check_every: int = DEFAULT_STOP_CHECK_EVERY,
                 use_graph: bool = False, streamer=None, captured: CapturedStep | None = None):
        """``captured``: the step already captured for this generation's tensors (by an earlier batch loaded into
        them): every step replays it, the first one too."""
        self.generation, self.stop_check_every, self.use_graph = generation, stop_check_every, use_graph
        self.streamer = streamer
        self.captured = captured
        self.streamed = 0

    def run(self, steps: int, stop_at_end: bool = True) -> None:
        """Up to ``steps`` decode steps; with ``stop_at_end`` they stop (at the next check) once every row ended."""
        generation = self.generation
        for done in range(steps):
            if done % self.stop_check_every == 0 and (stop_at_end or self.streamer is not None):
                if self._check() and stop_at_end:
                    break
            self._one_step()
            generation.after_step()
        if self.streamer is not None:
            self._stream(generation.produced())

    def _one_step(self) -> None:
        generation = self.generation
        if not self.use_graph:
            generation.step()
        elif self.captured is not None:
            self.captured.replay()
        elif generation.steps_done == 0:
            warm_up(generation.step, generation.device)  # the first step runs eagerly: kernels compile, ring built
        else:
            self.captured = CapturedStep(generation.step, generation.device, generation.chooser.generator)
            self.captured.replay()

    def _check(self) -> bool:
        """One host read: have all rows ended? Streams the tokens produced since the last check."""
        generation = self.generation
        if self.streamer is not None:
            self._stream(generation.steps_done + 1)
        return bool(generation.finished.all())

    def _stream(self, upto: int) -> None:
        generation = self.generation
        if upto > self.streamed:
            end = min(upto, int(generation.finished_at[0]) + 1)
            if end > self.streamed:
                self.streamer.put(generation.out[:, self.streamed:end].cpu())
            self.streamed = max(self.streamed, end)


def resolve_eos(model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        return eos_token_ids(model)
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(token) for token in eos_token_id]


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32,
             do_sample: bool = False, temperature: float | None = None, top_p: float | None = None,
             eos_token_id: int | list[int] | None = None, streamer: Any = None, seed: int | None = None, *,
             pad_token_id: int | None = None, stop_check_every: int = DEFAULT_STOP_CHECK_EVERY,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, cuda_graph: bool | None = None,
             keep_state: bool = True, fuse_layers: bool = True) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` after ``input_ids [B, T]`` -> ``[B, T + N]`` (prompt first), as
    transformers' ``model.generate`` would with the same options (greedy tokens are identical).

    Rows may be left-padded (``attention_mask [B, T]``, 0 on padding). A row that produced an ``eos_token_id``
    (default: the model's generation config) continues with ``pad_token_id``; the output ends at the last row's end
    token (or after N tokens). ``do_sample`` samples at ``temperature`` (default 1) with nucleus ``top_p``
    (default 1), reproducibly from ``seed``; greedy decoding takes neither. ``streamer`` (transformers'
    ``TextStreamer`` protocol, batch 1) gets the prompt, then the new tokens every ``stop_check_every`` steps, the
    interval at which the host checks whether every row has ended (the only device reads while decoding).
    The prompt runs in chunks of ``prefill_chunk`` tokens (activation memory bounded by one chunk). On CUDA the
    decode step is captured as a CUDA graph and replayed (``cuda_graph``: None = on CUDA when the sparse method
    allows it). Works the same inside ``retrofit.sparse_decoding(model, ...)``, which then selects in its layers.

    With ``keep_state`` (default), greedy decoding outside a sparse session keeps the static cache and the captured
    step on the side for the model's next call of the same batch size and cache-length bucket (prompt + new tokens
    rounded up to 256 positions), which then only loads its prompt and replays; one state per model, freed by a
    call of another shape, by the model's deletion, or by ``retrofit.generation.release(model)``.

    ``fuse_layers`` (default on): where the kernels run on Triton, decode steps run Llama, Mistral and Qwen2 decoder
    layers through fused kernels (11 per layer instead of 40; :mod:`retrofit.generation.fused_layers`); greedy
    tokens equal transformers' on the real SmolLM2 in float32 on CUDA, as the unfused engine's do. ``False`` keeps the
    model's own layers.
    """
    input_ids, attention_mask = checked_prompt(model, input_ids, attention_mask, max_new_tokens)
    attention_layout(model).require_interface("retrofit's generation engine")
    options = SamplingOptions.checked(do_sample, temperature, top_p, seed)
    if isinstance(stop_check_every, bool) or not isinstance(stop_check_every, int) or stop_check_every <= 0:
        raise RetrofitError(f"stop_check_every must be a positive number of tokens, got {stop_check_every!r}")
    if streamer is not None and input_ids.shape[0] != 1:
        raise RetrofitError(f"a streamer takes one row at a time; the batch has {input_ids.shape[0]}")
    eos = resolve_eos(model, eos_token_id)
    pad = default_pad_token_id(model=model) if pad_token_id is None else int(pad_token_id)
    # greedy decoding outside a sparse session reuses the previous call's cache and graph (retrofit.generation.kept)
    keepable = keep_state and not options.do_sample and active_session(model) is None
    step_options = (tuple(eos), pad, prefill_chunk, cuda_graph, fuse_layers)
    key = reuse_key(model, step_options) if keepable else None
    kept = take(model, key, input_ids, max_new_tokens)  # frees a kept state that does not fit (or is not wanted)
    if kept is not None:
        generation = kept.generation
        generation.load(input_ids, attention_mask, max_new_tokens)
    else:
        generation = StaticGeneration(model, input_ids, attention_mask, max_new_tokens,
                                      TokenChooser(options, input_ids.device), eos, pad, prefill_chunk,
                                      fuse_layers=fuse_layers)
    use_graph = graphs_wanted(generation, cuda_graph)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    loop = DecodeLoop(generation, stop_check_every, use_graph, streamer, kept.captured if kept else None)
    with generation.installed():
        generation.prefill()
        loop.run(max_new_tokens - 1)
    if streamer is not None:
        streamer.end()
    tokens = torch.cat([input_ids, generation.out[:, : generation.produced()]], dim=1)
    if keepable:
        # keyed by the weights where the kept step reads them: installing the fused layers may have moved some into
        # merged buffers during this call (they stay there, so the next call's key matches this one)
        keep(model, KeptGeneration(reuse_key(model, step_options), generation, loop.captured))
    elif loop.captured is not None:
        del loop
        captured_and_dropped(generation.device)
    return tokens
