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
        retrieval_probes: needle probes per context length (0: no retrieval probe, then ``retrieval_weight`` must be 0).
        probe_context: context lengths of the needle probes in tokens, e.g. ``(2048,)`` or ``(2048, 4096)``.
        seed: seed of the needle probes (haystack windows, numbers, depths).
    """

    align_steps: int = 30
    batch_size: int = 4
    probe_windows: int = 8
    lr: float = 1e-3
    retrieval_weight: float = 0.5
    retrieval_probes: int = 8
    probe_context: tuple[int, ...] = (2048,)
    seed: int = 0

    def __post_init__(self):
        self.probe_context = parse_contexts(self.probe_context)
        for name in ("align_steps", "batch_size", "probe_windows"):
            if _integer(self, name) < 1:
                raise RetrofitError(f"select setting {name} must be >= 1, got {getattr(self, name)!r}")
        if _integer(self, "retrieval_probes") < 0:
            raise RetrofitError(f"select setting retrieval_probes must be >= 0, got {self.retrieval_probes!r}")
        _integer(self, "seed")
        if not _number(self, "lr") > 0:
            raise RetrofitError(f"select setting lr must be > 0, got {self.lr!r}")
        if not 0 <= _number(self, "retrieval_weight") < math.inf:
            raise RetrofitError(f"select setting retrieval_weight must be a finite number >= 0, got "
                                f"{self.retrieval_weight!r}")
        if self.retrieval_weight > 0 and self.retrieval_probes == 0:
            raise RetrofitError(f"select setting retrieval_weight {self.retrieval_weight} needs retrieval probes: set "
                                "retrieval_probes >= 1, or retrieval_weight 0 to rank by KL alone")

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
