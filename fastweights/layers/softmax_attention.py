"""Softmax attention as a token mixer: the keep-every-row memory (seed 000, "Solver 1").

Per head: ``o_t = Σ_{τ≤t} softmax_τ(scale · q_t·k_τ) v_τ``. Its decode state is the
:class:`fastweights.ops.KVCache`, which grows by one row per token -- the contrast
to the fixed-size :class:`~fastweights.layers.FastWeightState` of the other mixers.

Positions: rotary embeddings (RoPE, Su et al. 2021) rotate q and k by their token's
position before the scores, so ``q_t·k_τ`` depends on ``t − τ`` (on by default,
``rope_theta=10000``). ``rope_theta=None`` turns them off ("NoPE": the causal mask
alone then carries order, and a permutation of earlier tokens leaves a query's output
unchanged). A token's position counts from the first real token of its sequence: a
packed sequence starts at 0, a left-padded row starts at its first non-pad token, and
a decoding step continues from the number of rows in the cache.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..ops import KVCache, softmax_attn
from .common import check_layer_input, check_rope_theta, forward_with_mask, rotary_embedding, sequence_positions


class SoftmaxAttention(nn.Module):
    """Multi-head causal softmax attention.
    ``forward(x, state=None, cu_seqlens=None, attention_mask=None) -> (y, cache)``.

    Args:
        d_model: model width; ``n_heads`` must divide it.
        n_heads: H (head size d_model / H; even when RoPE is on).
        rope_theta: the RoPE base θ (a positive number), or ``None`` for no positional
            encoding (NoPE).

    ``state`` is the :class:`~fastweights.ops.KVCache` returned by the previous call;
    decoding is a call with T = 1 and that cache. ``attention_mask [B, T]`` (0 = padding)
    runs the real tokens only: no query attends to a pad, pads are not cached, a pad's
    output is 0.
    """

    def __init__(self, d_model: int, n_heads: int, *, rope_theta: Optional[float] = 10000.0) -> None:
        super().__init__()
        if not isinstance(d_model, int) or not isinstance(n_heads, int) or d_model <= 0 or n_heads <= 0:
            raise ValueError(f"SoftmaxAttention: `d_model` and `n_heads` must be positive ints, got {d_model!r} and {n_heads!r}")
        if d_model % n_heads:
            raise ValueError(f"SoftmaxAttention: `d_model`={d_model} must be divisible by `n_heads`={n_heads}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.rope_theta = check_rope_theta("SoftmaxAttention", rope_theta, self.head_dim)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        state: Optional[KVCache] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
    ) -> Tuple[torch.Tensor, KVCache]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model], KVCache with keys [N, H, L + T, K])``."""
        mask = check_layer_input("SoftmaxAttention", x, self.d_model, cu_seqlens, attention_mask)
        if state is not None and not isinstance(state, KVCache):
            raise TypeError(f"SoftmaxAttention: `state` must be a KVCache (as returned by this layer), got {type(state).__name__}")
        if mask is not None:
            return forward_with_mask(self, x, state, mask)
        B, T, _ = x.shape
        q, k, v = (p(x).reshape(B, T, self.n_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.rope_theta is not None:
            seq, pos = sequence_positions(B, T, cu_seqlens, x.device)  # [B, T] each
            if state is not None:  # continue after the rows each sequence has cached
                pos = pos + state.lengths.to(device=x.device, dtype=torch.long)[seq]
            q, k = rotary_embedding(q, pos, self.rope_theta), rotary_embedding(k, pos, self.rope_theta)
        o, cache = softmax_attn(q, k, v, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens,
                                max_seqlen=max_seqlen)
        return self.o_proj(o.reshape(B, T, self.d_model)), cache

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: Optional[float] = None) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=std if out_std is None else out_std)
