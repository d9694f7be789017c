"""Saving and loading a hybrid checkpoint: config.json with the ``retrofit`` section, model.safetensors, tokenizer."""
from __future__ import annotations

import os
from pathlib import Path

from retrofit.atomic import atomic_path
from retrofit.devices import parse_dtype
from retrofit.errors import RetrofitError
from retrofit.hybrid.classes import model_class, register
from retrofit.hybrid.section import HybridSection, check_base_type


def save_hybrid(model, tokenizer, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write config.json (with the ``retrofit`` section), model.safetensors and the tokenizer to ``out``.

    Files go to a temporary directory beside ``out`` that is renamed into place at the end: an interrupted save
    leaves no half-written checkpoint. An existing ``out`` is only replaced when ``overwrite``.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise RetrofitError(f"output directory {out} exists; pass --overwrite to replace it")
    with atomic_path(out, directory=True) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return out


def load_hybrid(path: str | os.PathLike, dtype=None, device="cpu"):
    """Load a hybrid checkpoint saved by :func:`save_hybrid` -> model in eval mode on ``device``.

    ``dtype``: a torch dtype, a name (``float32``, ``bfloat16``, ...) or None (float32).
    """
    import json

    dtype = parse_dtype(dtype)
    register()
    raw = json.loads((Path(path) / "config.json").read_text())
    section = HybridSection.from_dict(raw["retrofit"])
    check_base_type(section.base_model_type)
    model = model_class(section.base_model_type).from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()
