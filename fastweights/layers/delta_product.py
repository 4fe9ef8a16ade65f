"""Gated DeltaProduct (Siems et al. 2025, arXiv:2502.10297) as a token mixer.

Gated DeltaNet with n_h Householder steps per token, each with its own key, value and β.
Per head and token, on top of :mod:`fastweights.layers.gated_deltanet`::

    k_{t,1}, v_{t,1}: the layer's k, v (short convolution, activation);  k_{t,j}, v_{t,j} (j > 1):
    W_kj x_t, W_vj x_t through the same activations;  β_{t,j} = sigmoid(w_βj · x_t) (×2 with
    allow_neg_eigval);  g_t: Gated DeltaNet's decay, once per token
    h ← exp(g_t) h,  then for j = 1 … n_h: h ← (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) h + β_{t,j} k_{t,j} v_{t,j}ᵀ
    o_t = scale · hᵀ q_t,   then RMSNorm(o_t) · silu(W_g x_t)

(fla's layer runs every step's keys and values through short convolutions over the tokens;
here the first step's go through the layer's convolution and the others are plain projections,
so fla's weights load for n_h = 1 or without convolutions: :mod:`fastweights.layers.fla_weights`). The recurrence
lives in :func:`fastweights.ops.chunk_gated_delta_product` (prefill, training) and
:func:`fastweights.ops.gated_delta_product_step` (decoding: a constant-size state).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..config import check_int
from ..ops import chunk_gated_delta_product, gated_delta_product_step, recurrent_gated_delta_product
from ..ops.feature_maps import normalize_qk
from .base import pool_step_rows, write_strength
from .gated_deltanet import GatedDeltaNet


class DeltaProduct(GatedDeltaNet):
    """The Gated DeltaProduct token mixer. ``forward(x, state=None, cu_seqlens=None) -> (y, state)``.

    Args: as :class:`~fastweights.layers.GatedDeltaNet`, and
        num_householder: n_h >= 1, Householder steps per token (1: Gated DeltaNet).
        allow_neg_eigval: β in (0, 2), so each step may reflect (the products then reach
            every orthogonal transition, as state tracking needs).
    One value head per head (``num_v_heads = n_heads``).

    Example::

        >>> layer = DeltaProduct(d_model=64, n_heads=4, num_householder=2, allow_neg_eigval=True)
        >>> y, state = layer(torch.randn(2, 10, 64))
        >>> y1, state = layer(torch.randn(2, 1, 64), state)
        >>> state.memory.shape
        torch.Size([2, 4, 16, 16])
    """

    def __init__(self, d_model: Optional[int] = None, n_heads: Optional[int] = None, *, num_householder: int = 2,
                 **kwargs) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        name = type(self).__name__
        n_h = num_householder
        check_int(name, "num_householder", n_h, what="an int >= 1")
        if self.num_v_heads != self.n_heads:
            raise ValueError(f"{name}: `num_v_heads` must equal `n_heads` ({self.n_heads}), got {self.num_v_heads}")
        self.num_householder = n_h
        self.b_proj = nn.Linear(self.d_model, n_h * self.n_heads, bias=False)  # one β per step and head
        self.ks_proj = nn.Linear(self.d_model, (n_h - 1) * self.key_width, bias=False) if n_h > 1 else None
        self.vs_proj = nn.Linear(self.d_model, (n_h - 1) * self.value_width, bias=False) if n_h > 1 else None

    def steps(self, k, v, extra) -> Tuple[torch.Tensor, ...]:
        """``(ks [..., n_h, H, K], vs [..., n_h, H, V], betas [..., n_h, H], g [..., H])`` from the first
        step's activated ``k [..., H, K]``, ``v [..., H, V]`` and ``extra = [b | a | ks | vs]`` (raw)."""
        n_h, H, K, V = self.num_householder, self.n_heads, self.head_dim, self.value_head_dim
        b_logits, a, ks, vs = extra.split([n_h * H, H, (n_h - 1) * H * K, (n_h - 1) * H * V], dim=-1)
        lead = k.shape[:-2]
        ks = torch.cat([k.unsqueeze(-3), self.activation(ks).view(lead + (n_h - 1, H, K))], dim=-3)
        vs = torch.cat([v.unsqueeze(-3), self.value_activation(vs).view(lead + (n_h - 1, H, V))], dim=-3)
        betas = write_strength(b_logits, self.allow_neg_eigval).view(lead + (n_h, H))
        return ks, vs, betas, self.decay_from_projection(a)

    def memory(self, q, k, v, extra, initial_state, cu_seqlens, recurrent, max_seqlen=None, cp_group=None):
        ks, vs, betas, g = self.steps(k, v, extra)  # [B, T, n_h, H, ·]: fla's layout once T and n_h are merged
        if cp_group is not None:  # this rank's slice; the ranks exchange (A, b) summaries (no final state)
            from ..ops.context_parallel import gated_delta_product_context_parallel

            return gated_delta_product_context_parallel(
                chunk_gated_delta_product, q, ks.flatten(1, 2), vs.flatten(1, 2), g, betas.flatten(1, 2), self.num_householder, cp_group=cp_group,
                cu_seqlens=cu_seqlens, chunk_size=self.chunk_length(q), qk_norm=self.qk_norm,
                allow_neg_eigval=self.allow_neg_eigval)
        op = self.memory_op(recurrent, recurrent_gated_delta_product, chunk_gated_delta_product)
        return op(q, ks.flatten(1, 2), vs.flatten(1, 2), g, betas.flatten(1, 2), self.num_householder,
                  initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                  qk_norm=self.qk_norm, allow_neg_eigval=self.allow_neg_eigval)

    def step_projections(self):
        return super().step_projections() + (() if self.ks_proj is None else ("ks_proj", "vs_proj"))

    def memory_step(self, qk, v, extra, memory, state_indices=None) -> Tuple[torch.Tensor, torch.Tensor]:
        dt = memory.dtype
        ks, vs, betas, g = self.steps(qk[:, 1], v, extra)  # [N, n_h, H, ·]
        q = normalize_qk(qk[:, 0].to(dt), self.qk_norm)
        ks = normalize_qk(ks.to(dt), self.qk_norm)

        def step(h):
            return gated_delta_product_step(q, ks.transpose(1, 2), vs.to(dt).transpose(1, 2),
                                            betas.to(dt).transpose(1, 2), g.to(dt), h, self.head_dim ** -0.5)

        # a pool (SessionPool): the step takes one state per row, so its pool form gathers and writes back
        return step(memory) if state_indices is None else pool_step_rows(step, memory, state_indices)

    def window_step_inputs(self, q, k, v, extra, dtype):
        return None  # verify windows step with memory_step (the sub-steps do not fit window_step's slots)

    neutral_pads = False  # a pad's sub-step keys come through their own projections: windows run the recurrence

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: Optional[float] = None) -> None:
        super().reset_parameters(std, out_std)
        for lin in (self.ks_proj, self.vs_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
