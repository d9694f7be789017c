"""How q, k and v come out of an attention module's projections: separate matrices, or one fused matrix whose rows
hold them in a family-specific order. Each layout splits the module's weights into q, k, v as ``[out, in]`` weights
and biases (:class:`Weight`), which is what conversion copies into a linear layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Weight:
    """A projection as ``weight [out, in]`` and ``bias [out]`` (or None)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def linear_weight(module: nn.Module) -> "Weight":
    """A projection module as ``Weight(weight [out, in], bias [out] | None)``: ``nn.Linear`` (and subclasses) as is,
    transformers' ``Conv1D`` (GPT-2, which stores ``[in, out]``) transposed (a view)."""
    if isinstance(module, nn.Linear):
        return Weight(module.weight, module.bias)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return Weight(module.weight.t(), module.bias)
    raise TypeError(f"{type(module).__name__} is not a linear projection")


def _rows(weight: "Weight", start: int, stop: int) -> "Weight":
    return Weight(weight.weight[start:stop], None if weight.bias is None else weight.bias[start:stop])


def _regrouped(weight: "Weight", shape: tuple[int, ...], pick) -> "Weight":
    """Rows of ``weight`` viewed as ``shape + (in,)``, the rows that ``pick`` selects, flattened back to 2-D."""
    w = pick(weight.weight.reshape(*shape, weight.weight.shape[-1])).reshape(-1, weight.weight.shape[-1])
    b = None if weight.bias is None else pick(weight.bias.reshape(*shape)).reshape(-1)
    return Weight(w, b)


class QKVLayout:
    """Where q, k and v are among an attention module's projections."""

    names: tuple[str, ...] = ()

    def split(self, attention: nn.Module, heads: int, kv_heads: int, head_dim: int
              ) -> tuple["Weight", "Weight", "Weight"]:
        """(q ``[heads * head_dim, in]``, k ``[kv_heads * head_dim, in]``, v ``[kv_heads * head_dim, in]``)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Separate(QKVLayout):
    """Three projections (``q_proj``, ``k_proj``, ``v_proj``)."""

    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def split(self, attention, heads, kv_heads, head_dim):
        return tuple(linear_weight(getattr(attention, name)) for name in self.names)

    def describe(self) -> str:
        return "separate q/k/v"


@dataclass(frozen=True)
class Stacked(QKVLayout):
    """One projection whose rows are all of q, then all of k, then all of v (Phi-3's ``qkv_proj``, GPT-2's
    ``c_attn``, Falcon's multi-query ``query_key_value``)."""

    name: str = "qkv_proj"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def split(self, attention, heads, kv_heads, head_dim):
        fused = linear_weight(getattr(attention, self.name))
        q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
        return (_rows(fused, 0, q_rows), _rows(fused, q_rows, q_rows + kv_rows),
                _rows(fused, q_rows + kv_rows, q_rows + 2 * kv_rows))

    def describe(self) -> str:
        return f"fused {self.name} (q, k, v stacked)"


@dataclass(frozen=True)
class PerHead(QKVLayout):
    """One projection whose rows are, head after head, that head's q, k and v (GPT-NeoX's ``query_key_value``,
    Falcon's original layout); no grouped-query attention."""

    name: str = "query_key_value"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def split(self, attention, heads, kv_heads, head_dim):
        fused = linear_weight(getattr(attention, self.name))
        shape = (heads, 3, head_dim)
        return tuple(_regrouped(fused, shape, lambda x, part=part: x[:, part]) for part in range(3))

    def describe(self) -> str:
        return f"fused {self.name} (q, k, v interleaved per head)"


@dataclass(frozen=True)
class PerGroup(QKVLayout):
    """One projection whose rows are, kv group after kv group, the group's queries, then its key, then its value
    (Falcon's ``new_decoder_architecture``)."""

    name: str = "query_key_value"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def split(self, attention, heads, kv_heads, head_dim):
        fused = linear_weight(getattr(attention, self.name))
        group = heads // kv_heads
        shape = (kv_heads, group + 2, head_dim)
        return (_regrouped(fused, shape, lambda x: x[:, :group]), _regrouped(fused, shape, lambda x: x[:, group]),
                _regrouped(fused, shape, lambda x: x[:, group + 1]))

    def describe(self) -> str:
        return f"fused {self.name} (queries, key, value per kv group)"


def contiguous(weight: "Weight") -> "Weight":
    """The same weight and bias as contiguous tensors (copies where they are strided views)."""
    return Weight(weight.weight.contiguous(), None if weight.bias is None else weight.bias.contiguous())


