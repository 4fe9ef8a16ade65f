"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024): the delta rule with a decay.

Per head and token, on top of :mod:`fastweights.layers.deltanet`::

    g_t = −exp(A_log) · softplus(w_a · x_t + dt_bias)     ≤ 0, the log decay
    α_t = exp(g_t)                                          in (0, 1]
    h_t = α_t (I − β_t k_t k_tᵀ) h_{t−1} + β_t k_t v_tᵀ
    o_t = scale · h_tᵀ q_t,   then RMSNorm(o_t) · silu(W_g x_t)   (the output gate)

``A_log`` and ``dt_bias`` are per head, initialized as in Mamba-2: A uniform in
[1, 16], softplus(dt_bias) log-uniform in [0.001, 0.1].
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import chunk_gated_delta_rule, gated_delta_rule_step, recurrent_gated_delta_rule
from .base import inverse_softplus, log_uniform, write_strength
from .deltanet import DeltaNet


class GatedDeltaNet(DeltaNet):
    """The Gated DeltaNet token mixer. ``forward(x, state=None, cu_seqlens=None) -> (y, state)``.

    Args: as :class:`~fastweights.layers.DeltaNet` (``qk_norm``, ``allow_neg_eigval``
    and the shared ones); the output gate is on by default.
    """

    def __init__(self, d_model: Optional[int] = None, n_heads: Optional[int] = None, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)  # DeltaNet's projections, β, qk_norm
        hv = self.num_v_heads  # one decay per value head
        self.a_proj = nn.Linear(self.d_model, hv, bias=False)
        self.A_log = nn.Parameter(torch.empty(hv))
        self.dt_bias = nn.Parameter(torch.empty(hv))
        self.reset_decay()

    @torch.no_grad()
    def reset_decay(self) -> None:
        self.A_log.copy_(torch.log(torch.empty(self.num_v_heads).uniform_(1, 16)))
        self.dt_bias.copy_(inverse_softplus(log_uniform(self.num_v_heads, 1e-3, 1e-1)))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g = −exp(A_log)·softplus(w_a·x + dt_bias): ``[B, T, H]``, ≤ 0."""
        return self.decay_from_projection(self.a_proj(x))

    def decay_from_projection(self, a: torch.Tensor) -> torch.Tensor:
        """g from ``a = w_a·x``: −exp(A_log)·softplus(a + dt_bias)."""
        return -torch.exp(self.A_log) * F.softplus(a + self.dt_bias)

    def memory(self, q, k, v, extra, initial_state, cu_seqlens, recurrent, max_seqlen=None, cp_group=None):
        hv = self.num_v_heads  # extra is [b_proj(x) | a_proj(x)]
        b_logits, a = extra.split([hv, hv], dim=-1)
        beta = write_strength(b_logits, self.allow_neg_eigval)  # [B, T, HV]
        g = self.decay_from_projection(a)                       # [B, T, HV]
        op = self.memory_op(recurrent, recurrent_gated_delta_rule, chunk_gated_delta_rule)
        return op(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=cp_group is None,
            **({} if cp_group is None else dict(cp_group=cp_group)),
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, qk_norm=self.qk_norm,
            allow_neg_eigval=self.allow_neg_eigval,
        )

    def step_projections(self):
        return super().step_projections() + ("a_proj",)

    def memory_step(self, qk, v, extra, memory, state_indices=None) -> Tuple[torch.Tensor, torch.Tensor]:
        dt = memory.dtype
        beta, g = self.write_and_decay(extra)
        return gated_delta_rule_step(*self.step_qkv(qk, v, dt), beta.to(dt), g.to(dt), memory, self.head_dim ** -0.5,
                                     state_indices=state_indices)

    def write_and_decay(self, extra):
        H = self.num_v_heads  # extra is [b_proj(x) | a_proj(x)]
        return write_strength(extra[..., :H], self.allow_neg_eigval), self.decay_from_projection(extra[..., H:])

    def window_step(self, q, k, v, beta, g, memory):
        return gated_delta_rule_step(q, k, v, beta, g, memory, self.head_dim ** -0.5)
