"""The ``retrofit`` section of a hybrid's config.json: which layers were converted, to what, with which settings."""
from __future__ import annotations

from dataclasses import dataclass, field

from retrofit.errors import RetrofitError

RETROFIT_VERSION = 1


@dataclass
class HybridSection:
    """The ``retrofit`` section of a hybrid config.json."""

    layers: list[int]
    layer_type: str
    base_model_type: str
    layer_spec: dict = field(default_factory=dict)
    version: int = RETROFIT_VERSION
    distillation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"version": self.version, "base_model_type": self.base_model_type, "layer_type": self.layer_type,
                "layers": list(self.layers), "layer_spec": dict(self.layer_spec),
                "distillation": dict(self.distillation)}

    @classmethod
    def from_dict(cls, values: dict) -> "HybridSection":
        if values.get("version", 0) > RETROFIT_VERSION:
            raise RetrofitError(f"hybrid checkpoint version {values['version']} is newer than this retrofit "
                                f"(supports <= {RETROFIT_VERSION}); upgrade retrofit")
        return cls(layers=[int(i) for i in values["layers"]], layer_type=values["layer_type"],
                   base_model_type=values["base_model_type"], layer_spec=dict(values.get("layer_spec", {})),
                   version=values.get("version", RETROFIT_VERSION),
                   distillation=dict(values.get("distillation", {})))


def hybrid_model_type(base_type: str) -> str:
    return f"retrofit_{base_type}"


def supported_bases() -> list[str]:
    """The families a hybrid can be built on: every architecture record that does not refuse conversion outright
    (a config may still be refused for an option it sets: :func:`conversion_refusal`)."""
    from retrofit.architecture import ARCHITECTURES

    return [name for name in ARCHITECTURES.names() if not ARCHITECTURES.get(name).already_hybrid]


def check_base_type(base_type: str) -> None:
    """RetrofitError unless a ``base_type`` model (config.model_type) can be converted to a hybrid."""
    if base_type not in supported_bases():
        raise RetrofitError(f"model type {base_type!r} cannot be converted to a hybrid; supported: "
                            f"{', '.join(supported_bases())}")


def conversion_refusal(config) -> str | None:
    """Why a dense model of ``config`` cannot be converted (one line naming the reason), or None: no architecture
    record, a family that is a hybrid already, or an option of the config the converted layers do not carry."""
    from retrofit import architecture

    base = architecture.base_model_type(config)
    if not architecture.describes(base):
        return (f"model type {base!r} has no architecture record in retrofit; described: "
                f"{', '.join(architecture.ARCHITECTURES.names())}")
    reason = architecture.for_type(base).conversion_refusal(architecture.text_config(config))
    return None if reason is None else f"{base}: {reason}"
