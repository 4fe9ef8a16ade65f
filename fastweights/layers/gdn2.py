"""Gated DeltaNet-2 (GDN-2) as a token mixer: KDA with β split into an erase and a write gate.

Per head and token, on top of :mod:`fastweights.layers.kda`::

    b_t = sigmoid(W_b x_t)   [HV, K]   the erase gate per key channel (×2 with allow_neg_eigval)
    w_t = sigmoid(W_w x_t)   [HV, V]   the write gate per value channel
    h_t = (I − k_t (b_t ⊙ k_t)ᵀ) diag(exp(g_t)) h_{t−1} + k_t (w_t ⊙ v_t)ᵀ
    o_t = scale · h_tᵀ q_t,   then RMSNorm(o_t) · silu(W_g x_t)

with KDA's per-channel decay g (low-rank gate, ``A_log``, ``dt_bias``), as fla 0.6.0's GDN-2
layer has them (its erase gate is per key head; ours per value head, the same when HV = H).
fla's layer gates the output with ``sigmoid(W_g2 W_g1 x + bias)`` (a low-rank map with a bias)
instead of silu(W_g x): ``fla_gate=True`` builds that form (``g_proj`` then holds the product
W_g2 W_g1, ``gate_bias`` the bias), so :func:`~fastweights.layers.load_fla_state_dict` can load
an fla layer exactly; such a layer decodes through the recurrent op (no fused step).
The recurrence lives in :func:`fastweights.ops.chunk_gdn2` (prefill, training) and
:func:`fastweights.ops.gdn2_step` (decoding: a constant-size state).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..ops import chunk_gdn2, gdn2_step, recurrent_gdn2
from .base import pool_step_rows, write_strength
from .common import RMSNorm
from .kda import KimiDeltaAttention


class GatedDeltaNet2(KimiDeltaAttention):
    """The GDN-2 token mixer. ``forward(x, state=None, cu_seqlens=None) -> (y, state)``.

    Args: as :class:`~fastweights.layers.KimiDeltaAttention` (``qk_norm``, ``allow_neg_eigval``:
    the erase gate in (0, 2), and the shared ones), and ``fla_gate``: fla's sigmoid output gate
    with a bias (module docstring).

    Example::

        >>> layer = GatedDeltaNet2(d_model=64, n_heads=4)
        >>> y, state = layer(torch.randn(2, 10, 64))         # prefill: chunk_gdn2
        >>> y1, state = layer(torch.randn(2, 1, 64), state)  # one decoding step: gdn2_step
        >>> state.memory.shape
        torch.Size([2, 4, 16, 16])
    """

    def __init__(self, d_model: Optional[int] = None, n_heads: Optional[int] = None, *, fla_gate: bool = False,
                 **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if not isinstance(fla_gate, bool):
            raise TypeError(f"{type(self).__name__}: `fla_gate` must be true or false, got {fla_gate!r}")
        if fla_gate and self.g_proj is None:
            raise ValueError(f"{type(self).__name__}: `fla_gate`=True needs the output gate (`use_output_gate`=True)")
        self.fla_gate = fla_gate
        self.gate_bias = nn.Parameter(torch.zeros(self.value_width)) if fla_gate else None
        hv = self.num_v_heads
        self.b_proj = nn.Linear(self.d_model, hv * self.head_dim, bias=False)  # erase gate, replaces KDA's β
        self.w_proj = nn.Linear(self.d_model, hv * self.value_head_dim, bias=False)  # write gate

    def gates(self, extra: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(g [..., HV, K], b [..., HV, K], w [..., HV, V])`` from ``extra = [b_proj(x) | f_a_proj(x) | w_proj(x)]``."""
        hv, dk, dv = self.num_v_heads, self.head_dim, self.value_head_dim
        b_logits, f_a, w_logits = extra.split([hv * dk, dk, hv * dv], dim=-1)
        b = write_strength(b_logits, self.allow_neg_eigval).unflatten(-1, (hv, dk))
        return self.decay_from_projection(f_a), b, torch.sigmoid(w_logits).unflatten(-1, (hv, dv))

    def memory(self, q, k, v, extra, initial_state, cu_seqlens, recurrent, max_seqlen=None, cp_group=None):
        g, b, w = self.gates(extra)
        if cp_group is not None:  # this rank's slice; the ranks exchange (A, b) summaries (no final state)
            from ..ops.context_parallel import gdn2_context_parallel

            return gdn2_context_parallel(chunk_gdn2, q, k, v, g, b, w, cp_group=cp_group, cu_seqlens=cu_seqlens,
                                         chunk_size=self.chunk_length(q), qk_norm=self.qk_norm)
        op = self.memory_op(recurrent, recurrent_gdn2, chunk_gdn2)
        return op(q, k, v, g, b, w, initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens,
                  max_seqlen=max_seqlen, qk_norm=self.qk_norm)

    def step_projections(self):
        return super().step_projections() + ("w_proj",)

    @property
    def fused_step(self) -> bool:
        return super().fused_step and not self.fla_gate

    def _output(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.fla_gate:
            return super()._output(o, gate)
        B, T, hv, dv = o.shape  # fla's form: RMSNorm(o) · sigmoid(W_g x + bias)
        gate = torch.sigmoid((gate + self.gate_bias).reshape(B, T, hv, dv))
        return self.o_proj((RMSNorm.forward(self.o_norm, o) * gate).reshape(B, T, hv * dv))

    def memory_step(self, qk, v, extra, memory, state_indices=None) -> Tuple[torch.Tensor, torch.Tensor]:
        dt = memory.dtype
        g, b, w = (t.to(dt) for t in self.gates(extra))
        q, k, v = self.step_qkv(qk, v, dt)
        if state_indices is not None:  # a pool (SessionPool): gdn2_step takes one state per row
            return pool_step_rows(lambda h: gdn2_step(q, k, v, g, b, w, h, self.head_dim ** -0.5), memory, state_indices)
        return gdn2_step(q, k, v, g, b, w, memory, self.head_dim ** -0.5)

    def window_step_inputs(self, q, k, v, extra, dtype):
        return None  # verify windows step with memory_step (the gates do not fit window_step's β slot)
