"""The lm-evaluation-harness model ``retrofit``: lm-eval's own Hugging Face model class (``HFLM``) on a model that
``retrofit.load`` opened, optionally decoding sparsely.

    lm_eval.simple_evaluate(model="retrofit",
                            model_args="pretrained=smollm2-135m,sparse=quest,budget=1024,page_size=16", ...)

``model_args``: ``pretrained`` (an alias, a model directory, a hybrid checkpoint directory, a ``.gguf`` file or a
hub id: anything ``retrofit.load`` takes), ``dtype`` (default: float32 on the CPU, bfloat16 on CUDA), ``device``,
``sparse`` (a sparse-decoding method) with ``budget`` (tokens per KV head per step) and the method's own keywords
(e.g. ``page_size=16``); any other key of ``HFLM`` (``max_length``, ``add_bos_token``, ``batch_size``, ...) goes to
it unchanged.

What sparse decoding changes: ``generate_until`` requests run inside ``retrofit.sparse_decoding`` (their decode
steps read the selected KV entries only). ``loglikelihood`` and ``loglikelihood_rolling`` requests are forward passes
over whole sequences (prefill) and stay dense, exactly as in ``retrofit eval``: on multiple-choice and perplexity
tasks a sparse model scores what the dense model scores.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, ContextManager

import torch
from lm_eval.models.huggingface import HFLM

from retrofit.devices import default_dtype, parse_device
from retrofit.errors import RetrofitError
from retrofit.load import load
from retrofit.variants import Variant, sparse as sparse_variant

logger = logging.getLogger(__name__)

_HFLM_OPTIONS = frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "pretrained", "kwargs"}
# HFLM options that would load or move a model that retrofit.load already placed
_LOADING_OPTIONS = frozenset({"backend", "revision", "subfolder", "tokenizer", "trust_remote_code", "parallelize",
                              "max_memory_per_gpu", "max_cpu_memory", "offload_folder", "tp_plan", "peft", "delta",
                              "autogptq", "gptqmodel", "gguf_file", "use_fast_tokenizer", "mixed_precision_dtype"})
# keywords of sparse_decoding itself rather than of a method's dataclass
_SESSION_KEYWORDS = ("layers", "kernel")


def sparse_decoding_variant(sparse: str | None, budget: Any, params: dict[str, Any]) -> Variant | None:
    """The sparse variant named by ``model_args`` (validated before any model is loaded), or None for dense."""
    if sparse is None:
        if budget is not None or params:
            extra = ", ".join(["budget"] * (budget is not None) + sorted(params))
            raise RetrofitError(f"model_args {extra}: need sparse=METHOD (streaming, quest, clusterkv, retrieval, "
                                "seer), or are not options of lm-eval's HF model")
        return None
    if budget is None:
        raise RetrofitError(f"model_args sparse={sparse} needs budget=N (tokens read per KV head per step)")
    from retrofit.sparse import build_method

    as_text = {key: str(value) for key, value in params.items()}
    build_method(str(sparse), str(budget), **{k: v for k, v in as_text.items() if k not in _SESSION_KEYWORDS})
    try:
        budget = int(budget)
    except (TypeError, ValueError):
        raise RetrofitError(f"model_args budget={budget!r} is not a number of tokens") from None
    return sparse_variant(str(sparse), budget, **as_text)


@contextlib.contextmanager
def _without_log_records(logger_name: str, beginning: str):
    """Drop the records of ``logger_name`` whose message begins with ``beginning`` while inside."""

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith(beginning)

    target, dropping = logging.getLogger(logger_name), Drop()
    target.addFilter(dropping)
    try:
        yield
    finally:
        target.removeFilter(dropping)


def _device(device: str | None) -> torch.device:
    """lm-eval's CLI asks for ``cuda:0`` by default; like its ``hf`` model, fall back to the CPU without CUDA."""
    if device and str(device).startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device %s asked for, but CUDA is not available: using the CPU", device)
        return torch.device("cpu")
    return parse_device(device)


class RetrofitLM(HFLM):
    """``HFLM`` over ``retrofit.load(pretrained)``, with sparse decoding around ``generate_until`` only.

    Log-likelihood requests (multiple choice, LAMBADA, perplexity) are dense prefill forwards, as in ``retrofit
    eval``; only ``generate_until`` decodes through the sparse method when ``sparse`` is given."""

    def __init__(self, pretrained: str, sparse: str | None = None, budget: int | None = None,
                 dtype: str | None = None, device: str | None = None, batch_size: int | str = 1, **kwargs):
        hflm_options = {key: value for key, value in kwargs.items() if key in _HFLM_OPTIONS}
        fixed = sorted(set(hflm_options) & _LOADING_OPTIONS)
        if fixed:
            raise RetrofitError(f"model_args {', '.join(fixed)}: not used by the retrofit model, which loads "
                                "through retrofit.load (pretrained= takes an alias, a directory or a .gguf file)")
        self.variant = sparse_decoding_variant(sparse, budget,
                                               {k: v for k, v in kwargs.items() if k not in _HFLM_OPTIONS})
        torch_device = _device(device)
        if dtype in (None, "auto"):
            dtype = default_dtype(torch_device)
        model, tokenizer = load(str(pretrained), dtype=dtype, device=torch_device)
        # HFLM warns that a model object "is not of type `str`": handing it one is how this class works
        with _without_log_records("lm_eval.models.huggingface", "`pretrained` model kwarg is not of type `str`"):
            super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                             **hflm_options)
        self.pretrained = str(pretrained)  # the name as given (HFLM keeps the object it was handed)
        self.retrofit_dtype = str(dtype)

    def decoding(self) -> ContextManager[object]:
        """The context the decode steps of ``generate_until`` run in: sparse decoding, or nothing for dense."""
        if self.variant is None:
            return contextlib.nullcontext(self.model)
        return self.variant.open(self.model, self.tokenizer)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        with self.decoding():
            return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def get_model_info(self) -> dict:
        """Parameters, dtype and what retrofit ran (no hub look-up: ``pretrained`` is usually a local name)."""
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": self.retrofit_dtype, "model_revision": None, "model_sha": "",
                "retrofit_pretrained": self.pretrained,
                "retrofit_variant": self.variant.name if self.variant is not None else "dense",
                "retrofit_model_kind": "hybrid" if getattr(self.model.config, "retrofit", None) else "dense"}
