"""The supported-architecture table of the README, made from the records (never written by hand):

    python -m retrofit.architecture.table

Each family's facts are read off its record applied to transformers' default config of the family.
"""
from __future__ import annotations

from retrofit.architecture.families import ARCHITECTURES
from retrofit.architecture.layouts import QKVLayout, Separate
from retrofit.architecture.record import Architecture


def _default_config(record: Architecture):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[record.model_type]() if record.model_type in CONFIG_MAPPING else None


def _attention_notes(record: Architecture, config) -> list[str]:
    notes = []
    if not isinstance(record.qkv, QKVLayout):
        notes.append("fused q/k/v, layout by config")
    elif not isinstance(record.qkv, Separate):
        notes.append(record.qkv.describe())
    norm = record.qk_norm_of(config) if config is not None else None
    if norm is not None:
        notes.append(f"q/k norm per {norm.per}")
    if config is not None:
        layers = record.layers(config)
        if any(layer.window for layer in layers):
            notes.append("sliding-window layers" if any(not layer.window for layer in layers) else "sliding window")
        if any(layer.softcap for layer in layers):
            notes.append("logit softcapping")
        head_dim = record.head_dim(config)
        if all(layer.rotary_dims == 0 for layer in layers):
            notes.append("no rotary")
        elif any(layer.rotary_dims == 0 for layer in layers):
            notes.append("rotary on some layers")
        elif any(layer.rotary_dims < head_dim for layer in layers):
            notes.append("partial rotary")
        if record.parallel_block(config):
            notes.append("parallel block")
        if any(layer.scaling != head_dim ** -0.5 for layer in layers):
            notes.append("own attention scale")
        if float(record.logit_multiplier(config)) != 1.0:
            notes.append("logit multiplier")
        if record.final_logit_softcap(config) is not None:
            notes.append("final logit softcapping")
    if record.norm != "rms":
        notes.append({"rms_unit_offset": "RMSNorm (1 + w)", "layer": "LayerNorm"}.get(record.norm, record.norm))
    if record.rotary_interleaved:
        notes.append("interleaved rotary")
    if record.notes:
        notes.append(record.notes)
    return notes


def support_table() -> str:
    """The Markdown table: one row per family (transformers' ``model_type``), what generation, sparse decoding and
    conversion do with it, and what its record says is particular about its attention."""
    lines = ["| family (`model_type`) | generate | sparse decoding | convert to GDN / KDA | attention |",
             "|---|---|---|---|---|"]
    for name in ARCHITECTURES.names():
        record = ARCHITECTURES.get(name)
        config = _default_config(record)
        generate = "yes, fused decode on GPU" if record.decode_fusion else "yes"
        sparse = "its softmax layers" if record.already_hybrid else "yes"
        if record.already_hybrid:
            convert = "no: a hybrid already"
        elif record.conversion_refused_with is not None:
            convert = f"yes, not with `{record.conversion_refused_with[0]}`"
        else:
            convert = "yes"
        notes = ", ".join(_attention_notes(record, config)) or "Llama-like"
        lines.append(f"| {name} | {generate} | {sparse} | {convert} | {notes} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(support_table())
