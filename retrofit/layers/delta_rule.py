"""The delta-rule family of converted layers (Gated DeltaNet, KDA): one forward, the gates left to each layer type.

Per token: q, k, v projections -> short causal conv (SiLU) -> L2-normalised q, k -> gated delta rule with
``beta = sigmoid(W_b x)`` and the log decay ``g = -exp(A_log) * softplus(decay_logits(x) + dt_bias)`` (per kv head,
or per key channel) -> per-head RMSNorm gated by ``sigmoid(output_gate_logits(x))`` -> W_o. GQA keeps one state per
key-value head; the query heads of a group read it. A decode token with its states in the cache runs the steps
after the conv as one kernel (``delta_rule_decode_step``) and the gated norm as another. With ``window`` set
(``LinearAttentionSpec``), a short softmax window of the dense attention's own q, k, v is mixed in before W_o
(``window.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ClassVar

import torch
import torch.nn as nn

from retrofit.kernels import (
    causal_conv1d_update,
    delta_rule_decode_step,
    l2_normalize_ref,
    log_decay_ref,
    sigmoid_gated_rms_norm,
)
from retrofit.layers.modules import GatedRMSNorm, ProjectionNorm, ShortConvolution, rotate
from retrofit.layers.spec import AttentionShape, LinearAttentionSpec
from retrofit.layers.state import cache_states, keep_window_ring, padding_mask, store_states, window_ring
from retrofit.layers.window import decode_window, near_share, prefill_window

if TYPE_CHECKING:
    from retrofit.architecture import LayerAttention


class DeltaRuleAttention(nn.Module):
    """Base of the delta-rule layers, with the forward signature of transformers' ``LlamaAttention``.

    Shapes: ``hidden_states [B, T, hidden]`` -> ``(attn_output [B, T, hidden], None)``. The recurrent state is
    ``[B, H_kv, head_dim, head_dim]`` (fp32) and the conv state ``[B, (H_q + 2 H_kv) head_dim, conv_size - 1]``;
    both live in the transformers ``Cache`` passed as ``cache`` / ``past_key_values``.

    A layer type sets ``layer_kind``, its two ops (``chunk_op`` for prefill and training, ``recurrent_op`` for
    single-token decode; ``retrofit.kernels`` runs each on Triton or its PyTorch path) and ``per_key_decay``, and
    implements ``_build_gates`` (``A_log`` [H_kv] and ``dt_bias`` [H_kv] or [H_kv * head_dim] among them),
    ``reset_gates``, ``decay_logits``, ``output_gate_logits`` and ``gate_input_projections``.

    ``attention``: the replaced layer's facts from its family's architecture record (scaling, logit softcap, rotated
    channels), which a softmax window (``spec.window``) computes with; without it, ``head_dim ** -0.5``, no softcap
    and the shape's rotary channels.
    """

    layer_kind: ClassVar[str] = ""
    chunk_op: ClassVar[Callable]
    recurrent_op: ClassVar[Callable]
    per_key_decay: ClassVar[bool] = False

    def __init__(self, shape: AttentionShape, layer_idx: int, spec: LinearAttentionSpec | None = None,
                 attention: "LayerAttention | None" = None):
        super().__init__()
        spec = spec or LinearAttentionSpec()
        self.shape, self.layer_idx, self.spec = shape, layer_idx, spec
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_heads if spec.expand_kv else shape.num_kv_heads
        self.head_dim = d = shape.head_dim
        hidden, hq, hk = shape.hidden_size, self.num_heads, self.num_kv_heads
        self.q_proj = nn.Linear(hidden, hq * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(hidden, hk * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(hidden, hk * d, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(hq * d, hidden, bias=shape.o_bias)
        if shape.qk_norm is not None:  # the dense attention's q/k norm, kept (per head, or over the projection)
            q_dim, k_dim = (d, d) if shape.qk_norm == "head" else (hq * d, hk * d)
            self.q_norm = ProjectionNorm(q_dim, shape.qk_norm_eps, shape.qk_norm_unit_offset)
            self.k_norm = ProjectionNorm(k_dim, shape.qk_norm_eps, shape.qk_norm_unit_offset)
        self.conv = ShortConvolution((hq + 2 * hk) * d, spec.conv_size)
        self.b_proj = nn.Linear(hidden, hk, bias=True)
        self.o_norm = GatedRMSNorm(hq, d)
        self.window, self.sink_tokens = spec.window, spec.sink_tokens
        if self.window:  # c(x), the mean logit of the keys out of the window, per query head (window.py)
            self.far_logit_proj = nn.Linear(hidden, hq, bias=True)
            self.window_scale = attention.scaling if attention is not None else d ** -0.5
            self.window_softcap = attention.softcap if attention is not None else None
            self.window_rotates = bool(attention.rotary_dims if attention is not None else shape.rotary_dims)
        self._build_gates()
        self.reset_parameters()

    @property
    def retrofit_layer_type(self) -> str:
        """The name this layer type is registered under (``retrofit.layers.LAYER_TYPES``)."""
        return self.layer_kind

    def reset_parameters(self) -> None:
        """Initial values of everything not copied from the dense attention (also after ``to_empty``)."""
        self.conv.reset_parameters()
        if self.shape.qk_norm is not None:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()
        with torch.no_grad():
            self.o_norm.weight.fill_(1.0)
            if self.window:  # until calibrated (retrofit.convert.init): far keys' logits as large as near ones
                self.far_logit_proj.weight.zero_()
                self.far_logit_proj.bias.zero_()
        self.reset_gates()

    # ----- what a layer type defines -----
    def _build_gates(self) -> None:
        """Create the decay and output-gate parameters."""
        raise NotImplementedError

    def reset_gates(self) -> None:
        """Initialise the gates (``b_proj`` included) so that the layer starts as a slow-decay, open-gate recurrence."""
        raise NotImplementedError

    def decay_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> the decay's input before ``dt_bias`` and the softplus: ``[B, T, H_kv]``, or
        ``[B, T, H_kv * head_dim]`` with ``per_key_decay``."""
        raise NotImplementedError

    def output_gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> the output gate before its sigmoid, ``[B, T, H_q * head_dim]``."""
        raise NotImplementedError

    @property
    def decay_lower_bound(self) -> float | None:
        """The floor of the log decay, or None (no floor)."""
        return None

    def gate_input_projections(self) -> list[nn.Linear]:
        """The gates' projections that read the layer's input ``x`` (beyond ``b_proj``), in a fixed order."""
        raise NotImplementedError

    def input_projections(self) -> list[nn.Linear]:
        """Every projection of the layer's input ``x``: q, k, v, b, the gates' and the window's far logits (a
        decode engine may run them as one GEMM over their weights' rows in one buffer)."""
        window = [self.far_logit_proj] if self.window else []
        return [self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self.gate_input_projections(), *window]

    # ----- the gates, from the logits -----
    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> log decay g (fp32, <= 0): ``[B, T, H_kv]`` or per channel ``[B, T, H_kv, head_dim]``."""
        logits = self.decay_logits(x)
        if self.per_key_decay:
            logits = logits.unflatten(-1, (self.num_kv_heads, self.head_dim))
        return log_decay_ref(logits, self.A_log, self.dt_bias, self.per_key_decay, self.decay_lower_bound)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> gate ``[B, T, H_q, head_dim]`` in (0, 1)."""
        B, T, _ = x.shape
        return torch.sigmoid(self.output_gate_logits(x)).view(B, T, self.num_heads, self.head_dim)

    # ----- forward -----
    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, layer_past=None, **kwargs) -> tuple[torch.Tensor, None]:
        """hidden_states ``[B, T, hidden]`` -> ``(output [B, T, hidden], None)``; updates the cache if one is given.

        ``attention_mask`` (2-D or 4-D, as transformers passes it) only marks padding: a padded position is made an
        identity step of the recurrence (k = v = 0, beta = 0, g = 0) and outputs zeros. A decode token (T = 1, with
        states in the cache) updates the cache's conv and recurrent states (and a window's ring) in place.
        """
        cache = next((given for given in (cache, past_key_values, layer_past) if given is not None), None)
        x = hidden_states
        B, T, _ = x.shape
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        conv_state, recurrent_state = cache_states(cache, self.layer_idx)
        decode = not self.training and T == 1
        # a decode token is always a real one (generation feeds finished rows a pad token marked real), so a step
        # reads no mask: no host read per layer and step
        keep = None if decode else padding_mask(attention_mask, B, T, x.device)
        continuing = conv_state is not None  # the cache holds this layer's states from earlier tokens
        in_place = decode and continuing  # the cache's states advance in place: nothing allocated

        projected = self._normed(self.q_proj(x), self.k_proj(x)) + [self.v_proj(x)]
        qkv = _joined_columns(projected)
        if keep is not None:
            qkv = qkv * keep[..., None].to(qkv.dtype)
        if in_place:
            qkv = self.conv_step_in_place(qkv, conv_state)
            if not self.spec.use_rope:
                o = self._decode_after_conv(x, qkv, recurrent_state)
                return self._output(o, x, projected, position_embeddings, keep, cache, True, True), None
        else:
            qkv, conv_state = self.conv(qkv, conv_state, decode=decode)
        if keep is not None:
            qkv = qkv * keep[..., None].to(qkv.dtype)
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(B, T, hq, d), k.view(B, T, hk, d), v.reshape(B, T, hk, d).contiguous()
        if self.spec.use_rope and position_embeddings is not None:
            q, k = rotate(q, k, position_embeddings)
        q, k = l2_normalize_ref(q), l2_normalize_ref(k)
        beta = torch.sigmoid(self.b_proj(x).float())
        g = self.decay(x)
        if keep is not None:
            beta = beta * keep[..., None]
            g = g * (keep[..., None, None] if g.dim() == 4 else keep[..., None])
        if in_place:
            o, _ = type(self).recurrent_op(q, k, v, g, beta, initial_state=recurrent_state, inplace_state=True)
        else:
            run = type(self).recurrent_op if decode else type(self).chunk_op
            o, recurrent_state = run(q, k, v, g, beta, initial_state=recurrent_state,
                                     output_final_state=cache is not None)
            if cache is not None:
                store_states(cache, self.layer_idx, conv_state, recurrent_state)
        o = self.o_norm(o, self.output_gate(x))
        return self._output(o, x, projected, position_embeddings, keep, cache, continuing, in_place), None

    def _output(self, o: torch.Tensor, x: torch.Tensor, projected: list[torch.Tensor], position_embeddings,
                keep: torch.Tensor | None, cache, continuing: bool, in_place: bool) -> torch.Tensor:
        """The gated-norm output ``o [B, T, H_q, head_dim]``, mixed with the softmax window where the layer has one
        (its q, k, v from ``projected``, the q/k-normed projections ``[B, T, H * head_dim]``), through W_o ->
        ``[B, T, hidden]``. ``continuing``: the cache held this layer's states before this call; ``in_place``: a
        decode token advancing them in place."""
        B, T, _ = x.shape
        if self.window:
            near, share = self.window_attention(x, projected, position_embeddings, keep, cache, continuing, in_place)
            o = o + share[..., None].to(o.dtype) * (near.to(o.dtype) - o)
        return self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))

    def window_qkv(self, projected: list[torch.Tensor], position_embeddings
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window's q ``[B, T, H_q, head_dim]``, k, v ``[B, T, H_kv, head_dim]``: the projections as the dense
        attention uses them (q/k norm, then the model's rotary embedding where the replaced layer rotates)."""
        q, k, v = projected
        B, T, _ = q.shape
        q, k, v = (t.reshape(B, T, -1, self.head_dim) for t in (q, k, v))
        if self.window_rotates and position_embeddings is not None:
            q, k = rotate(q, k, position_embeddings)
        return q, k, v

    def window_attention(self, x: torch.Tensor, projected: list[torch.Tensor], position_embeddings,
                         keep: torch.Tensor | None, cache, continuing: bool, in_place: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The softmax window's output ``[B, T, H_q, head_dim]`` and its share ``m`` of the layer's output
        ``[B, T, H_q]`` (``retrofit.layers.window``); the cache's ring is read (when ``continuing``) and advanced
        (in place for a decode token, ``in_place``)."""
        q, k, v = self.window_qkv(projected, position_embeddings)
        ring = window_ring(cache, self.layer_idx) if continuing else None
        if continuing and ring is None:
            raise RuntimeError(f"layer {self.layer_idx}: the cache holds this layer's states but no window ring (its "
                               "prefill ran without the layer's window)")
        if in_place:
            near, lse, index = decode_window(q, k, v, ring, self.window_scale, self.window_softcap)
        else:
            near, lse, index, after = prefill_window(q, k, v, keep, ring, self.window, self.sink_tokens,
                                                     self.window_scale, self.window_softcap)
            if cache is not None:
                keep_window_ring(cache, self.layer_idx, after)
        share = near_share(lse, index, self.far_logit_proj(x), self.window, self.sink_tokens)
        return near, share

    def _normed(self, q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
        """q ``[B, T, H_q * head_dim]``, k ``[B, T, H_kv * head_dim]`` through the dense attention's q/k norm, if it
        had one (per head, or over the whole projection); unchanged otherwise."""
        norm = self.shape.qk_norm
        if norm is None:
            return [q, k]
        if norm == "projection":
            return [self.q_norm(q), self.k_norm(k)]
        B, T, _ = q.shape
        return [self.q_norm(q.view(B, T, -1, self.head_dim)).view(B, T, -1),
                self.k_norm(k.view(B, T, -1, self.head_dim)).view(B, T, -1)]

    def _decode_after_conv(self, x: torch.Tensor, qkv: torch.Tensor, recurrent_state: torch.Tensor) -> torch.Tensor:
        """A decode token after its conv: x ``[B, 1, hidden]``, qkv ``[B, 1, (H_q + 2 H_kv) head_dim]`` -> the
        gated-norm output ``[B, 1, H_q, head_dim]`` (before W_o), the cache's ``recurrent_state [B, H_kv, head_dim,
        head_dim]`` updated in place. The same math as the general path (norms, gates, recurrence, gated norm) in two
        kernels where that path runs about thirty."""
        B = x.shape[0]
        hq, d = self.num_heads, self.head_dim
        o = delta_rule_decode_step(qkv[:, 0], self.decay_logits(x)[:, 0], self.b_proj(x)[:, 0], self.A_log,
                                   self.dt_bias, recurrent_state, hq, self.per_key_decay, self.decay_lower_bound)
        gate_logits = self.output_gate_logits(x).view(B, hq, d)
        o = sigmoid_gated_rms_norm(o, gate_logits, self.o_norm.weight, self.o_norm.eps)
        return o.view(B, 1, hq, d)

    def conv_step_in_place(self, qkv: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """The short conv of one decode token ``qkv [B, 1, D]``, rolling the cache's ``conv_state [B, D, W-1]`` in
        place -> ``[B, 1, D]``."""
        conv = self.conv
        y = causal_conv1d_update(qkv[:, 0], conv_state, conv.weight.to(qkv.dtype), conv.bias.to(qkv.dtype), "silu")
        return y[:, None]

    def state_bytes(self, batch: int = 1) -> int:
        """Bytes this layer's cache holds per ``batch`` sequences, whatever their length: the float32 recurrent
        state ``[H_kv, head_dim, head_dim]``, the conv state ``[(H_q + 2 H_kv) head_dim, conv_size - 1]`` and, with a
        window, its ring: keys and values of ``window + sink_tokens`` tokens, the slots' indices and the count."""
        element = self.q_proj.weight.element_size()
        recurrent = self.num_kv_heads * self.head_dim * self.head_dim * 4
        conv = self.conv.channels * (self.conv.width - 1) * element
        ring = 0
        if self.window:
            ring = 2 * (self.window + self.sink_tokens) * self.num_kv_heads * self.head_dim * element
            ring += 8 * (self.window + 1)
        return batch * (recurrent + conv + ring)

    def extra_repr(self) -> str:
        window = f", window={self.window}, sinks={self.sink_tokens}" if self.window else ""
        return (f"kind={self.layer_kind}, layer_idx={self.layer_idx}, heads={self.num_heads}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{window}")


def _joined_columns(blocks: list[torch.Tensor]) -> torch.Tensor:
    """``blocks [..., n_i]`` -> ``[..., sum n_i]``: a view where they are consecutive column blocks of one buffer (a
    decode engine's merged projection returns q, k and v so: no copy), else their concatenation."""
    first = blocks[0]
    width = sum(block.shape[-1] for block in blocks)
    offsets = [first.storage_offset()]
    for block in blocks[:-1]:
        offsets.append(offsets[-1] + block.shape[-1])
    adjacent = all(block.shape[:-1] == first.shape[:-1] and block.dtype == first.dtype and block.stride(-1) == 1
                   and _row_strides(block) == _row_strides(first) and block.storage_offset() == offset
                   and block.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   for block, offset in zip(blocks, offsets))
    if not adjacent or any(stride < width for stride in _row_strides(first)):  # (else the joined rows would overlap)
        return torch.cat(blocks, dim=-1)
    return first.as_strided((*first.shape[:-1], width), first.stride(), first.storage_offset())


def _row_strides(x: torch.Tensor) -> list[int]:
    """The strides of ``x``'s leading dimensions that step anywhere (a size-1 dimension's stride is arbitrary)."""
    return [stride for size, stride in zip(x.shape[:-1], x.stride()) if size > 1]
