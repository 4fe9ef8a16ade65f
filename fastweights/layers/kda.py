"""Kimi Delta Attention (Kimi Team 2025, "Kimi Linear", arXiv:2510.26692) as a token mixer.

Gated DeltaNet with one decay per key channel. Per head and token, on top of
:mod:`fastweights.layers.deltanet`::

    f_t = W_fb (W_fa x_t)                                   low-rank gate input, [HV·K] (rank K)
    g_t = −exp(A_log) · softplus(f_t + dt_bias)             ≤ 0, the per-channel log decay [HV, K]
    h_t = (I − β_t k_t k_tᵀ) diag(exp(g_t)) h_{t−1} + β_t k_t v_tᵀ
    o_t = scale · h_tᵀ q_t,   then RMSNorm(o_t) · silu(W_g x_t)   (the output gate)

``A_log`` is per head (A uniform in [1, 16]) and ``dt_bias`` per head and key channel
(softplus(dt_bias) log-uniform in [0.001, 0.1]), as in Mamba-2 and fla's layer. Kimi
Linear's own output gate is a low-rank projection through a sigmoid; ours is the other
mixers' silu gate. The recurrence lives in :func:`fastweights.ops.chunk_kda` (prefill,
training) and :func:`fastweights.ops.kda_step` (decoding: a constant-size state).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import chunk_kda, kda_step, recurrent_kda
from .base import inverse_softplus, pool_step_rows, log_uniform, write_strength
from .deltanet import DeltaNet


class KimiDeltaAttention(DeltaNet):
    """The KDA token mixer. ``forward(x, state=None, cu_seqlens=None) -> (y, state)``.

    Args: as :class:`~fastweights.layers.DeltaNet` (``qk_norm``, ``allow_neg_eigval``, the
    shared ones); the gate's rank is the key size K.

    Example::

        >>> layer = KimiDeltaAttention(d_model=64, n_heads=4)
        >>> y, state = layer(torch.randn(2, 10, 64))         # prefill: chunk_kda
        >>> y1, state = layer(torch.randn(2, 1, 64), state)  # one decoding step
        >>> state.memory.shape                               # [N, H, K, V], whatever the context
        torch.Size([2, 4, 16, 16])
    """

    def __init__(self, d_model: Optional[int] = None, n_heads: Optional[int] = None, **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        hv, dk = self.num_v_heads, self.head_dim
        self.f_a_proj = nn.Linear(self.d_model, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, hv * dk, bias=False)
        self.A_log = nn.Parameter(torch.empty(hv))
        self.dt_bias = nn.Parameter(torch.empty(hv * dk))
        self.reset_decay()

    @torch.no_grad()
    def reset_decay(self) -> None:
        self.A_log.copy_(torch.log(torch.empty(self.num_v_heads).uniform_(1, 16)))
        self.dt_bias.copy_(inverse_softplus(log_uniform(self.dt_bias.numel(), 1e-3, 1e-1)))

    def decay_from_projection(self, f_a: torch.Tensor) -> torch.Tensor:
        """g from ``f_a = W_fa x [..., K]``: ``−exp(A_log)·softplus(W_fb f_a + dt_bias)``, ``[..., HV, K]``."""
        f = (self.f_b_proj(f_a) + self.dt_bias).unflatten(-1, (self.num_v_heads, self.head_dim))
        return -torch.exp(self.A_log).unsqueeze(-1) * F.softplus(f)

    def memory(self, q, k, v, extra, initial_state, cu_seqlens, recurrent, max_seqlen=None,
               cp_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
        if cp_group is not None:
            raise ValueError(f"{type(self).__name__}: context parallelism (`cp_group`) is not supported by the KDA "
                             f"ops; run the sequence on one rank")
        hv = self.num_v_heads  # extra is [b_proj(x) | f_a_proj(x)]
        b_logits, f_a = extra.split([hv, self.head_dim], dim=-1)
        beta = write_strength(b_logits, self.allow_neg_eigval)  # [B, T, HV]
        g = self.decay_from_projection(f_a)                     # [B, T, HV, K]
        op = self.memory_op(recurrent, recurrent_kda, chunk_kda)
        return op(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen, qk_norm=self.qk_norm,
            allow_neg_eigval=self.allow_neg_eigval,
        )

    def step_projections(self):
        return super().step_projections() + ("f_a_proj",)

    def memory_step(self, qk, v, extra, memory, state_indices=None) -> Tuple[torch.Tensor, torch.Tensor]:
        dt = memory.dtype
        beta, g = self.write_and_decay(extra)  # g: [N, H, K]
        if state_indices is not None:  # kda_step takes one state per row: its pool form gathers and writes back
            return pool_step_rows(lambda h: kda_step(*self.step_qkv(qk, v, dt), beta.to(dt), g.to(dt), h,
                                                     self.head_dim ** -0.5), memory, state_indices)
        return kda_step(*self.step_qkv(qk, v, dt), beta.to(dt), g.to(dt), memory, self.head_dim ** -0.5)

    # Verify windows (fastweights.models.window): a padded row cannot be made a no-op of the
    # per-channel decay (g comes through f_b_proj, never exactly 0 in every channel), so KDA's
    # windows run the recurrent form.
    neutral_pads = False

    def write_and_decay(self, extra):
        H = self.num_v_heads  # extra is [b_proj(x) | f_a_proj(x)]
        return write_strength(extra[..., :H], self.allow_neg_eigval), self.decay_from_projection(extra[..., H:])

    def window_step(self, q, k, v, beta, g, memory):
        return kda_step(q, k, v, beta, g, memory, self.head_dim ** -0.5)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: Optional[float] = None) -> None:
        super().reset_parameters(std, out_std)
        for lin in (self.f_a_proj, self.f_b_proj):
            nn.init.normal_(lin.weight, std=std)
