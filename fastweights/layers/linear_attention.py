"""Linear attention (Katharopoulos et al. 2020) as a token mixer: the sum rule.

Per head and token (Katharopoulos et al. 2020; Wang, Shi & Fox 2025)::

    h_t = h_{t−1} + φ(k_t) v_tᵀ,   z_t = z_{t−1} + φ(k_t)        (z only with normalize)
    o_t = scale · h_tᵀ φ(q_t)   [ / (scale · φ(q_t)ᵀ z_t + eps) ]

φ and the normalizer are those of :func:`fastweights.ops.chunk_linear_attn`: the
layer passes ``feature_map``, ``qk_norm`` and ``normalize`` through, and with
``normalize=True`` the state carries z as its last value column ``[N, H, D, V + 1]``.
Nothing is ever erased, which is why overwriting a key fails (Schlag et al. 2021).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops import chunk_linear_attn, get_feature_map, linear_attn_step, recurrent_linear_attn
from ..ops.feature_maps import QK_NORMS, normalize_qk
from .base import FastWeightMixer


class LinearAttention(FastWeightMixer):
    """The linear-attention token mixer. ``forward(x, state=None, cu_seqlens=None) -> (y, state)``.

    Args (beyond the shared ones of :class:`~fastweights.layers.base.FastWeightMixer`;
    here ``activation`` and ``value_activation`` default to identity, φ does the work):
        feature_map: φ: ``"identity"``, ``"elu"``, ``"relu"``, ``"dpfp"``, ``"taylor"``, or a
            :class:`fastweights.ops.FeatureMap` such as ``DPFP(nu=2)``.
        qk_norm: ``None``, ``"l2"`` or ``"sum"`` applied to φ(q), φ(k).
        normalize: divide each read by the normalizer (the state gets a z column).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        feature_map="elu",
        qk_norm: Optional[str] = None,
        normalize: bool = True,
        activation: str = "identity",
        value_activation: str = "identity",
        **kwargs,
    ) -> None:
        super().__init__(d_model, n_heads, activation=activation, value_activation=value_activation, **kwargs)
        self.feature_map = get_feature_map(feature_map, type(self).__name__)
        if qk_norm not in QK_NORMS:
            raise ValueError(f"{type(self).__name__}: unknown `qk_norm` {qk_norm!r}; expected None, 'l2' or 'sum'")
        self.qk_norm, self.normalize = qk_norm, bool(normalize)

    def memory(self, q, k, v, extra, initial_state, cu_seqlens, recurrent, max_seqlen=None, cp_group=None):
        op = self.memory_op(recurrent, recurrent_linear_attn, chunk_linear_attn)
        return op(
            q, k, v, initial_state=initial_state, output_final_state=cp_group is None, cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen, **({} if cp_group is None else dict(cp_group=cp_group)),
            feature_map=self.feature_map, qk_norm=self.qk_norm, normalize=self.normalize,
        )

    def memory_shape(self, n: int):
        return (n, self.n_heads, self.feature_map.output_dim(self.head_dim), self.head_dim + int(self.normalize))

    def memory_step(self, qk, v, extra, memory, state_indices=None) -> Tuple[torch.Tensor, torch.Tensor]:
        dt = memory.dtype
        qk = normalize_qk(self.feature_map(qk.to(dt)), self.qk_norm)
        return linear_attn_step(qk[:, 0], qk[:, 1], v.to(dt), memory, None, self.head_dim ** -0.5, normalize=self.normalize,
                                state_indices=state_indices)
