"""A short softmax window (and sink tokens) inside a converted layer, beside its delta-rule state.

Which keys a query sees, in *real-token* indices (padding is skipped, so a left-padded row counts from its first real
token): the first ``sinks`` tokens, and the last ``window`` tokens up to and including itself. The tokens between
them ("far") are left to the delta-rule state.

How the two outputs combine (LoLCATs' shared normaliser, with the far mass estimated). Dense attention over all keys is

    o = (Z_near o_near + Z_far o_far) / (Z_near + Z_far),

Z the sums of ``exp(logit)`` over the near (sinks and window) and the far keys. The window computes ``o_near`` and
``log Z_near`` exactly. LoLCATs' linear part brings its own ``Z_far`` (a sum of feature-map products); a delta-rule
state has none (its output is a recalled value, which the layer RMS-normalises), so its output stands for ``o_far``
and ``Z_far`` is estimated as ``n_far * exp(c(x))``: the number of far keys times the exp of a learned mean far
logit per query head, ``c(x) = W x + b`` (calibrated from the dense attention when a conversion starts). The layer's
output before W_o is

    o = m * o_near + (1 - m) * o_linear,    m = sigmoid(log Z_near - log n_far - c(x)),

a gate, as Liger mixes its sliding window and its gated recurrence, whose logit is the normalisers' log ratio. Chosen
over Liger's fixed half-and-half mix and over a free gate ``sigmoid(W x)``: while a query has no far key (its first
``window + sinks`` tokens) ``m = 1`` exactly, so at initialisation the layer *is* the dense attention there; past
that, the window's share follows how much attention mass it holds for this query (a head that reads its sinks or its
neighbours keeps ``m`` near 1), the quantity a shared normaliser computes.

Cost: prefill and training attend in blocks of :data:`BLOCK` queries, each over the sinks and ``window + BLOCK``
keys (memory and time ``O(T * (window + sinks))``, not ``O(T^2)``); a decode token attends over the sinks and a ring
of the last ``window`` keys and values that the cache keeps beside the layer's recurrent and conv states
(:class:`WindowRing`): ``O(window + sinks)`` per token whatever the context, with device ops only (no host read).

Real tokens must form one run in each row (left or right padding, as generation and scoring pad): a window counts
real tokens, and the blocks find them by position.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retrofit.errors import RetrofitError

BLOCK = 64  # queries per block of the banded prefill / training attention
HIDDEN = -1e30  # the logit of a key a query may not see: finite, so a padding query's row stays finite
ALL_NEAR = 1e4  # the gate logit of a query with no far key: sigmoid gives exactly 1.0 in float32


def visible(query_index: torch.Tensor, key_index: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Whether a key may be seen: ``query_index``, ``key_index`` broadcastable long tensors of real-token indices
    (-1: padding or an empty slot) -> bool: the key is a real token, not after the query, and a sink
    (``key < sinks``) or within the window (``key > query - window``)."""
    return (key_index >= 0) & (key_index <= query_index) & ((key_index < sinks) | (key_index > query_index - window))


def real_indices(keep: torch.Tensor | None, seen: torch.Tensor, length: int) -> torch.Tensor:
    """Real-token index of each of ``length`` new positions ``[B, T]`` (long; -1 at padding), counting on from
    ``seen [B]`` real tokens before them. ``keep [B, T]`` bool marks real tokens (None: all real)."""
    if keep is None:
        return seen[:, None] + torch.arange(length, device=seen.device)
    counted = seen[:, None] + keep.long().cumsum(1) - 1
    return torch.where(keep, counted, torch.full_like(counted, -1))


def check_one_run(keep: torch.Tensor | None) -> None:
    """RetrofitError unless the real tokens of each row of ``keep [B, T]`` form one run (one host read; call where
    the padding mask was read on the host already)."""
    if keep is None:
        return
    starts = keep[:, 0].long() + (keep[:, 1:] & ~keep[:, :-1]).long().sum(1)
    if bool((starts > 1).any()):
        raise RetrofitError("a converted layer with a softmax window needs each row's real tokens in one run (left or "
                            "right padding), not padding between them")


def far_counts(query_index: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """How many earlier tokens a query at ``query_index`` (long, any shape) does not see: neither sinks nor in its
    window, ``max(0, index - window - sinks + 1)`` (long; 0 at padding)."""
    return (query_index - window - sinks + 1).clamp_min(0)


def near_share(near_lse: torch.Tensor, query_index: torch.Tensor, far_logits: torch.Tensor, window: int,
               sinks: int) -> torch.Tensor:
    """The window's share ``m`` of a query's output (see the module docstring): ``near_lse [B, T, Hq]`` (float32),
    ``query_index [B, T]``, ``far_logits [B, T, Hq]`` (``c(x)``) -> ``[B, T, Hq]`` float32 in (0, 1]; exactly 1
    where no key is far."""
    far = far_counts(query_index, window, sinks)[..., None]
    logit = near_lse - torch.log(far.clamp_min(1).float()) - far_logits.float()
    return torch.sigmoid(torch.where(far > 0, logit, torch.full_like(logit, ALL_NEAR)))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of blocks of queries over their own keys.

    q ``[B, n, C, H_kv, G, D]`` (G query heads per key-value head), keys / values ``[B, n, K, H_kv, D]``,
    allowed ``[B, n, C, K]`` bool -> (out ``[B, n, C, H_kv, G, D]`` in the values' dtype, log-sum-exp of the
    scaled (and softcapped) logits ``[B, n, C, H_kv, G]`` float32). A row with no allowed key averages all of them
    (finite; callers zero it)."""
    scores = torch.einsum("bncHgd,bnkHd->bnHgck", q, keys).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, :, None, None], HIDDEN)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None]).to(values.dtype)
    out = torch.einsum("bnHgck,bnkHd->bncHgd", weights, values)
    return out, lse.permute(0, 1, 4, 2, 3)


def banded_window_attention(q: torch.Tensor, query_index: torch.Tensor, context_keys: torch.Tensor,
                            context_values: torch.Tensor, context_index: torch.Tensor, sink_keys: torch.Tensor,
                            sink_values: torch.Tensor, sink_count: torch.Tensor, window: int, sinks: int,
                            scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The window and sinks of ``T`` new queries, in blocks of :data:`BLOCK` queries.

    Args:
        q: ``[B, T, H_q, D]`` (rotated as the dense attention rotates them), ``query_index [B, T]`` their real-token
            indices (-1: padding).
        context_keys, context_values: ``[B, window + T, H_kv, D]``: the ``window`` keys before the new tokens in
            index order (a cache's ring, or slots marked empty), then the new tokens' own; ``context_index
            [B, window + T]`` their real-token indices (-1: padding or empty).
        sink_keys, sink_values: ``[B, sinks, H_kv, D]``, slot ``j`` the token of real index ``j`` (this call's
            included); ``sink_count [B]``: how many slots hold one.

    Returns:
        ``(out [B, T, H_q, D], lse [B, T, H_q] float32)``: out zero at padding; lse, the log-sum-exp of the seen
        keys' scaled logits, meaningful at real tokens only.

    Block ``j`` (queries ``jC .. jC + C - 1``) reads context positions ``jC .. jC + C + window - 1``: every key of
    its queries' windows when the real tokens form one run. A context key of index below ``sinks`` is read from the
    sink slots only (not twice).
    """
    B, T, Hq, D = q.shape
    Hkv = context_keys.shape[2]
    prefix = context_keys.shape[1] - T
    if prefix != window:
        raise ValueError(f"context of {context_keys.shape[1]} keys for {T} queries: expected {window} before them")
    C = min(T, BLOCK)
    n = math.ceil(T / C)
    pad = n * C - T
    if pad:
        q = F.pad(q, (0, 0, 0, 0, 0, pad))
        query_index = F.pad(query_index, (0, pad), value=-1)
        context_keys = F.pad(context_keys, (0, 0, 0, 0, 0, pad))
        context_values = F.pad(context_values, (0, 0, 0, 0, 0, pad))
        context_index = F.pad(context_index, (0, pad), value=-1)
    span = C + prefix
    keys = context_keys.unfold(1, span, C).permute(0, 1, 4, 2, 3)  # [B, n, span, Hkv, D]
    values = context_values.unfold(1, span, C).permute(0, 1, 4, 2, 3)
    key_index = context_index.unfold(1, span, C)  # [B, n, span]
    blocked_index = query_index.view(B, n, C)
    allowed = visible(blocked_index[..., None], key_index[:, :, None, :], window, sinks)
    allowed = allowed & (key_index[:, :, None, :] >= sinks)
    if sinks:
        slots = torch.arange(sinks, device=q.device)
        sink_allowed = (slots < sink_count[:, None])[:, None, None, :] & (slots <= blocked_index[..., None])
        keys = torch.cat([sink_keys[:, None].expand(B, n, sinks, Hkv, D), keys], dim=2)
        values = torch.cat([sink_values[:, None].expand(B, n, sinks, Hkv, D), values], dim=2)
        allowed = torch.cat([sink_allowed, allowed], dim=3)
    out, lse = _attend(q.view(B, n, C, Hkv, Hq // Hkv, D), keys, values, allowed, scale, softcap)
    out = out.reshape(B, n * C, Hq, D)[:, :T]
    lse = lse.reshape(B, n * C, Hq)[:, :T]
    real = (query_index[:, :T] >= 0)[..., None, None]
    return out * real.to(out.dtype), lse


def window_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                               window: int, sinks: int, scale: float, softcap: float | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain form, for tests and calibration: every query against every key with an explicit mask, float32.

    q ``[B, T, H_q, D]``, k / v ``[B, T, H_kv, D]``, keep ``[B, T]`` bool (None: all real) -> (out ``[B, T, H_q,
    D]`` float32, zero at padding; lse ``[B, T, H_q]`` float32, meaningful at real tokens). ``window`` at least
    ``T`` makes it plain causal attention."""
    B, T, Hq, _ = q.shape
    group = Hq // k.shape[2]
    index = real_indices(keep, torch.zeros(B, dtype=torch.long, device=q.device), T)
    keys, values = k.float().repeat_interleave(group, 2), v.float().repeat_interleave(group, 2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = visible(index[:, :, None], index[:, None, :], window, sinks)  # [B, T, T]
    real = index >= 0
    allowed = allowed | ~real[:, :, None]  # a padding query: any finite row, zeroed below
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, T]
    out = torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), values)
    return out * real[..., None, None], lse.transpose(1, 2)


@dataclass
class WindowRing:
    """What a windowed layer keeps in the cache beside its recurrent and conv states, per row: the last ``window``
    real tokens' keys and values, the sinks' and how many real tokens were seen.

    ``keys`` / ``values [B, window, H_kv, D]``: the token of real index ``j`` in slot ``j % window``;
    ``indices [B, window]`` long: the real index each slot holds (-1: empty); ``sink_keys`` / ``sink_values
    [B, sinks, H_kv, D]``: slot ``j`` the token of real index ``j``; ``seen [B]`` long. Buffers keep their addresses
    from the first prefill on (a captured decode step reads them there); a new prefill rewrites them in place.
    """

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    seen: torch.Tensor

    @property
    def window(self) -> int:
        return self.keys.shape[1]

    @property
    def sinks(self) -> int:
        return self.sink_keys.shape[1]

    @classmethod
    def empty_like(cls, keys: torch.Tensor, window: int, sinks: int) -> "WindowRing":
        """An empty ring for rows like ``keys [B, T, H_kv, D]``."""
        B, _, H, D = keys.shape
        return cls(keys.new_zeros(B, window, H, D), keys.new_zeros(B, window, H, D),
                   torch.full((B, window), -1, dtype=torch.long, device=keys.device),
                   keys.new_zeros(B, sinks, H, D), keys.new_zeros(B, sinks, H, D),
                   torch.zeros(B, dtype=torch.long, device=keys.device))

    def fits(self, other: "WindowRing") -> bool:
        """Whether ``other``'s tensors have this ring's shapes, dtypes and device (so it can be copied in place)."""
        return all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                   for a, b in zip(self.tensors(), other.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values, self.indices, self.sink_keys, self.sink_values, self.seen

    def copy_(self, other: "WindowRing") -> None:
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)

    def in_order(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ring's slots in real-index order, oldest first -> (keys, values ``[B, window, H_kv, D]``, indices
        ``[B, window]``): position ``t`` holds index ``seen - window + t`` (or an empty slot)."""
        order = torch.remainder(self.seen[:, None] + torch.arange(self.window, device=self.seen.device), self.window)
        return _rows(self.keys, order), _rows(self.values, order), self.indices.gather(1, order)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, N, H, D]`` at positions ``index [B, M]`` of dim 1 -> ``[B, M, H, D]``."""
    B, M = index.shape
    return x.gather(1, index[:, :, None, None].expand(B, M, *x.shape[2:]))


def prefill_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                   ring: WindowRing | None, window: int, sinks: int, scale: float, softcap: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, WindowRing]:
    """The window of ``T`` new tokens (a prefill chunk, a training window, a continuation).

    q ``[B, T, H_q, D]``, k / v ``[B, T, H_kv, D]`` (rotated as the dense attention rotates them), keep ``[B, T]``
    (None: all real), ``ring``: the cache's ring before them (None: nothing before). -> (out ``[B, T, H_q, D]``,
    lse ``[B, T, H_q]`` float32, query indices ``[B, T]``, the ring after them: a new object; the caller stores it,
    in place where a ring is held)."""
    B, T = k.shape[:2]
    check_one_run(keep)
    before = ring if ring is not None else WindowRing.empty_like(k, window, sinks)
    index = real_indices(keep, before.seen, T)
    seen = before.seen + (keep.long().sum(1) if keep is not None else T)
    prefix_keys, prefix_values, prefix_index = before.in_order()
    context_keys, context_values = torch.cat([prefix_keys, k], 1), torch.cat([prefix_values, v], 1)
    context_index = torch.cat([prefix_index, index], 1)
    sink_keys, sink_values = before.sink_keys, before.sink_values
    if sinks:  # this call's tokens of index < sinks into their slots; the others into a spare slot, dropped
        slot = torch.where((index >= 0) & (index < sinks), index, torch.full_like(index, sinks))
        sink_keys = _scatter_rows(sink_keys, slot, k)
        sink_values = _scatter_rows(sink_values, slot, v)
    out, lse = banded_window_attention(q, index, context_keys, context_values, context_index, sink_keys, sink_values,
                                       seen.clamp(max=sinks), window, sinks, scale, softcap)
    # the ring after: the last `window` context positions up to the last real token, each into slot index % window
    if keep is None:
        last = torch.full((B,), T, dtype=torch.long, device=k.device)
    else:  # one past the position of each row's last real token (0: none)
        last = (torch.arange(1, T + 1, device=k.device) * keep.long()).amax(1)
    newest = window + last  # context positions [newest - window, newest) hold the last `window` real tokens
    taken = (newest - window)[:, None] + torch.remainder(
        torch.arange(window, device=k.device)[None, :] - seen[:, None], window)
    after = WindowRing(_rows(context_keys, taken), _rows(context_values, taken), context_index.gather(1, taken),
                       sink_keys, sink_values, seen)
    return out, lse, index, after


def _scatter_rows(slots: torch.Tensor, slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``slots [B, S, H, D]`` with ``x [B, T, H, D]`` written at ``slot [B, T]`` (``S`` = a spare slot, dropped) ->
    a new ``[B, S, H, D]``."""
    B, S = slots.shape[:2]
    spare = torch.cat([slots, slots.new_zeros(B, 1, *slots.shape[2:])], 1)
    return spare.scatter(1, slot[:, :, None, None].expand(*slot.shape, *x.shape[2:]), x)[:, :S]


def decode_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: WindowRing, scale: float,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token per row against the ring, which it joins (in place): q ``[B, 1, H_q, D]``, k / v
    ``[B, 1, H_kv, D]`` -> (out ``[B, 1, H_q, D]``, lse ``[B, 1, H_q]`` float32, query index ``[B, 1]``). Device ops
    only: no host read, the same operations every step (a CUDA graph can capture it)."""
    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    window, sinks = ring.window, ring.sinks
    index = ring.seen.clone()
    slot = torch.remainder(index, window)
    rows = slot[:, None, None, None].expand(B, 1, Hkv, D)
    ring.keys.scatter_(1, rows, k)
    ring.values.scatter_(1, rows, v)
    ring.indices.scatter_(1, slot[:, None], index[:, None])
    keys, values, key_index = ring.keys, ring.values, ring.indices
    allowed = visible(index[:, None], key_index, window, sinks) & (key_index >= sinks)
    if sinks:
        sink_slot = index.clamp(max=sinks - 1)[:, None, None, None].expand(B, 1, Hkv, D)
        is_sink = (index < sinks)[:, None, None, None]
        ring.sink_keys.scatter_(1, sink_slot, torch.where(is_sink, k, ring.sink_keys.gather(1, sink_slot)))
        ring.sink_values.scatter_(1, sink_slot, torch.where(is_sink, v, ring.sink_values.gather(1, sink_slot)))
        slots = torch.arange(sinks, device=q.device)
        keys, values = torch.cat([ring.sink_keys, keys], 1), torch.cat([ring.sink_values, values], 1)
        allowed = torch.cat([slots[None, :] <= index[:, None], allowed], 1)
    ring.seen.add_(1)
    out, lse = _attend(q.view(B, 1, 1, Hkv, Hq // Hkv, D), keys[:, None], values[:, None], allowed[:, None, None],
                       scale, softcap)
    return out.reshape(B, 1, Hq, D), lse.reshape(B, 1, Hq), index[:, None]
