"""Settings of the scored layer selector (``select:`` in a recipe, options of ``retrofit select``), validated: a bad
value is one :class:`RetrofitError` line naming the setting, before any model work."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from retrofit.errors import RetrofitError

MIN_PROBE_CONTEXT = 128  # tokens: the needle probe's instruction, needle, question and answer take about 70


@dataclass
class SelectSettings:
    """Settings of the scored selector: the recipe's ``select:`` mapping, ``retrofit select`` options of the same
    names (dashes for underscores; all but ``lr``).

    Attributes:
        align_steps: alignment steps (all layers at once) before the KL probe.
        batch_size: windows per alignment step.
        probe_windows: held-out calibration windows of the KL probe.
        lr: learning rate of the alignment.
        retrieval_weight: ``w`` in ``cost = KL / mean(KL) + w * retrieval / mean(retrieval)``; 0 ranks by KL alone
            (the selector's ranking before retrieval scores existed). Each term is relative to its mean over the
            layers. The default, 0.5, measured on SmolLM2 with the other defaults (2026-12-02, CPU): the KL-only
            ranking converts layer 21 (needle mass 0.92, the highest) at fraction 0.267 (8 layers) and, at
            fraction 0.5 (15 layers), layers 17, 20, 21 and 23, whose best heads copy the number back (copy rate
            0.36-0.96). With w = 0.5 no converted layer has a head with copy rate >= 0.3 at either fraction (the
            highest needle mass converted is 0.08 at 8 layers, 0.44 at 15), while the summed single-layer KL of
            the converted set grows 1.5x (8 layers) and 1.4x (15 layers) over the KL-only choice. w = 1 converts
            the same 8 layers and at 15 trades layer 22 (mass 0.44) for layer 4, whose KL is 0.50 nats (3.8 times
            the median): 1.85x the KL. Raise it when long-context recall matters more than short-context fidelity.
        copy_weight: ``c`` in a third cost term, ``+ c * copy_rate / mean(copy_rate)``: the copy rate of each layer's
            best head (the share of answer tokens it points at in the needle while the dense model reads the number
            back), which keeps the few heads that copy softmax even where their needle mass is small. 0 (the default)
            leaves the ranking as it was. On the 2026-12-06 H100 ranking of KDA at fraction 0.5
            (``benchmarks/results/2026-12-06/h100_convert_kda-15of30-copy.log``), any c from about 0.06 to 0.8 trades layer
            6 (copy rate 0.286, the only chosen layer whose head copies) for layer 10 (0.000): the layers of
            ``kda-15of30-copy-keep6``, the 15-of-30 hybrid that kept passkey.
        retrieval_probes: needle probes per context length (0: no retrieval probe, then ``retrieval_weight`` must be 0).
        probe_context: context lengths of the needle probes in tokens, e.g. ``(2048,)`` or ``(2048, 4096)``.
        seed: seed of the needle probes (haystack windows, numbers, depths).
        max_run: at most this many converted layers in a row (0: no bound): the choice is then the set of least
            summed cost among those whose runs of converted layers are at most this long
            (:func:`retrofit.convert.selection.choose`). For aggressive ratios: at 22 of 30 the unbounded choice
            converts runs of six layers.
    """

    align_steps: int = 30
    batch_size: int = 4
    probe_windows: int = 8
    lr: float = 1e-3
    retrieval_weight: float = 0.5
    copy_weight: float = 0.0
    retrieval_probes: int = 8
    probe_context: tuple[int, ...] = (2048,)
    seed: int = 0
    max_run: int = 0

    def __post_init__(self):
        self.probe_context = parse_contexts(self.probe_context)
        for name in ("align_steps", "batch_size", "probe_windows"):
            if _integer(self, name) < 1:
                raise RetrofitError(f"select setting {name} must be >= 1, got {getattr(self, name)!r}")
        if _integer(self, "retrieval_probes") < 0:
            raise RetrofitError(f"select setting retrieval_probes must be >= 0, got {self.retrieval_probes!r}")
        _integer(self, "seed")
        if _integer(self, "max_run") < 0:
            raise RetrofitError(f"select setting max_run must be >= 0, got {self.max_run!r}")
        if not _number(self, "lr") > 0:
            raise RetrofitError(f"select setting lr must be > 0, got {self.lr!r}")
        for name in ("retrieval_weight", "copy_weight"):
            if not 0 <= _number(self, name) < math.inf:
                raise RetrofitError(f"select setting {name} must be a finite number >= 0, got {getattr(self, name)!r}")
        for name in ("retrieval_weight", "copy_weight"):
            weight = getattr(self, name)
            if weight > 0 and self.retrieval_probes == 0:
                raise RetrofitError(f"select setting {name} {weight} needs retrieval probes: set retrieval_probes >= 1, "
                                    f"or {name} 0")

    @classmethod
    def from_mapping(cls, values: dict | None) -> "SelectSettings":
        """Settings from a recipe's ``select:`` mapping (None: the defaults), RetrofitError on an unknown key or a
        bad value."""
        if values is not None and not isinstance(values, dict):
            raise RetrofitError(f"recipe select: expected a mapping of settings, got {values!r}")
        values = dict(values or {})
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise RetrofitError(f"recipe select: unknown key(s) {', '.join(unknown)} (known: {', '.join(names)})")
        return cls(**values)


def parse_contexts(value) -> tuple[int, ...]:
    """``2048`` / ``"2048,4096"`` / ``[2048, 4096]`` -> ``(2048, 4096)`` (sorted, unique), RetrofitError when bad."""
    parts = list(value) if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        contexts = sorted({int(str(p).strip()) for p in parts if str(p).strip()})
    except ValueError:
        raise RetrofitError(f"bad probe_context {value!r}: expected token counts like 2048 or 2048,4096") from None
    if not contexts or contexts[0] < MIN_PROBE_CONTEXT:
        raise RetrofitError(f"bad probe_context {value!r}: each length must be >= {MIN_PROBE_CONTEXT} tokens")
    return tuple(contexts)


def _integer(settings, name: str) -> int:
    value = getattr(settings, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RetrofitError(f"select setting {name} must be an integer, got {value!r}")
    return value


def _number(settings, name: str) -> float:
    value = getattr(settings, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise RetrofitError(f"select setting {name} must be a number, got {value!r}")
    return float(value)
