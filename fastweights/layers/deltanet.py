"""DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule as a token mixer.

Symbols (code -> paper): ``q, k, v`` the query, key and value of token t; ``beta``
β_t, the write strength; the state h [K, V] is the fast-weight matrix (the
transpose of the papers' W = Σ v kᵀ, read as hᵀq). Per head and token::

    β_t = sigmoid(w_β · x_t)                          (0, 1); 2·sigmoid with allow_neg_eigval
    h_t = h_{t−1} + β_t k_t (v_t − h_{t−1}ᵀ k_t)ᵀ      write the correction (Schlag et al. 2021)
    o_t = scale · h_tᵀ q_t

with q, k normalized (l2 by default, so the transition I − β k kᵀ is a contraction).
Projections, short convolution and output norm are in :mod:`fastweights.layers.base`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..ops import chunk_delta_rule, delta_rule_step, recurrent_delta_rule
from ..ops.feature_maps import normalize_qk
from .base import FastWeightMixer, write_strength


class DeltaNet(FastWeightMixer):
    """The DeltaNet token mixer. ``forward(x, state=None, cu_seqlens=None) -> (y, state)``.

    Args (beyond :class:`~fastweights.layers.base.FastWeightMixer`'s d_model, n_heads,
    use_short_conv, conv_size, activation, use_output_gate, norm_eps, chunk_size):
        qk_norm: ``"l2"`` (default) or ``"sum"``, applied to the activated q and k.
        allow_neg_eigval: β in (0, 2) instead of (0, 1), so I − β k kᵀ may have a
            negative eigenvalue (it can then flip a direction, as state tracking needs).
        head_dim, expand_v, num_v_heads and fla's constructor names (``hidden_size``,
        ``num_heads``, ``use_gate``, ...): see :class:`~fastweights.layers.base.FastWeightMixer`;
        :func:`~fastweights.layers.load_fla_state_dict` loads an fla layer's weights.

    Example::

        >>> layer = DeltaNet(d_model=64, n_heads=4)
        >>> y, state = layer(torch.randn(2, 10, 64))         # prefill: chunk form
        >>> y1, state = layer(torch.randn(2, 1, 64), state)  # one decoding step
        >>> state.memory.shape                               # [N, H, K, V]
        torch.Size([2, 4, 16, 16])
    """

    neutral_pads = True  # β = 0 (and, gated, α = 1) makes a padded row of a verify window a no-op

    def __init__(
        self, d_model: Optional[int] = None, n_heads: Optional[int] = None, *, qk_norm: str = "l2",
        allow_neg_eigval: bool = False, **kwargs,
    ) -> None:
        super().__init__(d_model, n_heads, **kwargs)
        if qk_norm not in ("l2", "sum"):
            raise ValueError(f"{type(self).__name__}: unknown `qk_norm` {qk_norm!r}; expected 'l2' or 'sum'")
        self.qk_norm = qk_norm
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.b_proj = nn.Linear(self.d_model, self.num_v_heads, bias=False)  # one β per value head

    def memory(self, q, k, v, extra, initial_state, cu_seqlens, recurrent, max_seqlen=None, cp_group=None):
        beta = write_strength(extra, self.allow_neg_eigval)  # [B, T, HV]: extra is b_proj(x)
        op = self.memory_op(recurrent, recurrent_delta_rule, chunk_delta_rule)
        return op(
            q, k, v, beta, initial_state=initial_state, output_final_state=cp_group is None,
            **({} if cp_group is None else dict(cp_group=cp_group)),
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, qk_norm=self.qk_norm,
            allow_neg_eigval=self.allow_neg_eigval,
        )

    def step_projections(self):
        return super().step_projections() + ("b_proj",)

    def memory_step(self, qk, v, extra, memory, state_indices=None) -> Tuple[torch.Tensor, torch.Tensor]:
        beta = write_strength(extra, self.allow_neg_eigval)  # extra is [N, H]: β's logits
        return delta_rule_step(*self.step_qkv(qk, v, memory.dtype), beta.to(memory.dtype), memory, self.head_dim ** -0.5,
                               state_indices=state_indices)

    def window_step_inputs(self, q, k, v, extra, dtype):
        qk = normalize_qk(torch.stack([q, k], 2).to(dtype), self.qk_norm)  # [N, P, 2, H, K]
        beta, g = self.write_and_decay(extra)
        return qk[:, :, 0], qk[:, :, 1], v.to(dtype), beta.to(dtype), None if g is None else g.to(dtype)

    def write_and_decay(self, extra):
        """β (and, gated, g) from the layer's own projections ``extra [..., ·]``."""
        return write_strength(extra, self.allow_neg_eigval), None

    def window_step(self, q, k, v, beta, g, memory):
        return delta_rule_step(q, k, v, beta, memory, self.head_dim ** -0.5)

    def step_qkv(self, qk, v, dtype):
        """q, k (``qk [N, 2, H, K]``, normalized together by ``qk_norm``) and v in the state's dtype."""
        qk = normalize_qk(qk.to(dtype), self.qk_norm)
        return qk[:, 0], qk[:, 1], v.to(dtype)
