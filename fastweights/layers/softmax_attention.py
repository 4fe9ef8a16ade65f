"""Softmax attention as a token mixer: the keep-every-row memory (Wang, Shi & Fox 2025, solver 1).

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

Short convolution (optional, off by default): ``use_short_conv=True`` puts the same
causal depthwise :class:`~fastweights.layers.ShortConvolution` that the fast-weight
mixers use on the projected q, k, v (before RoPE), so each token's key and value
already see their W − 1 predecessors. Zoology's MQAR compares mixers with this
convolution on for every mixer; with it, one attention layer can bind a value to the
key before it. The layer's state is then an :class:`AttentionState` (the KV cache and
the convolution's last W − 1 inputs) instead of a bare :class:`~fastweights.ops.KVCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import KVCache, softmax_attn
from .common import (
    ShortConvolution, cached_weights, check_context_parallel_input, check_layer_input, check_rope_theta,
    forward_with_mask, rotary_embedding, sequence_positions,
)


@dataclass
class AttentionState:
    """Decode state of a :class:`SoftmaxAttention` layer with a short convolution.

    Fields:
        kv: the :class:`~fastweights.ops.KVCache` (grows by one row per token).
        conv: ``[N, W − 1, 3·d_model]`` the last W − 1 projected q, k, v inputs of the
            convolution (fixed size).
    """

    kv: KVCache
    conv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.conv.numel() * self.conv.element_size()

    @property
    def lengths(self) -> torch.Tensor:
        """``[N]`` cached rows per sequence (as :attr:`KVCache.lengths`)."""
        return self.kv.lengths


class SoftmaxAttention(nn.Module):
    """Multi-head causal softmax attention.
    ``forward(x, state=None, cu_seqlens=None, attention_mask=None) -> (y, cache)``.

    Args:
        d_model: model width; ``n_heads`` must divide it.
        n_heads: H (head size d_model / H; even when RoPE is on).
        rope_theta: the RoPE base θ (a positive number), or ``None`` for no positional
            encoding (NoPE).
        use_short_conv: put a causal depthwise convolution of width ``conv_size`` on the
            projected q, k, v (off by default; see the module docstring).
        conv_size: W, the convolution's kernel width.

    ``state`` is the :class:`~fastweights.ops.KVCache` returned by the previous call
    (an :class:`AttentionState` when the layer has a convolution); decoding is a call
    with T = 1 and that state. ``attention_mask [B, T]`` (0 = padding)
    runs the real tokens only: no query attends to a pad, pads are not cached, a pad's
    output is 0.
    """

    def __init__(self, d_model: int, n_heads: int, *, rope_theta: Optional[float] = 10000.0,
                 use_short_conv: bool = False, conv_size: int = 4) -> None:
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
        if not isinstance(use_short_conv, bool):
            raise TypeError(f"SoftmaxAttention: `use_short_conv` must be true or false, got {use_short_conv!r}")
        self.conv = ShortConvolution(3 * d_model, conv_size) if use_short_conv else None

    def forward(
        self,
        x: torch.Tensor,
        state: Union[KVCache, AttentionState, None] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        cp_group=None,
    ) -> Tuple[torch.Tensor, Union[KVCache, AttentionState, None]]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model], state)``: a KVCache with keys
        ``[N, H, L + T, K]``, wrapped with the convolution's inputs in an
        :class:`AttentionState` when the layer has a short convolution. ``max_seqlen``
        (with ``cu_seqlens``): the longest sequence's length, passed to the op.

        Context parallelism: with ``cp_group`` ``x`` is this rank's contiguous slice of the
        sequence (``cu_seqlens``: the global offsets). Keys and values are all-gathered
        (:func:`~fastweights.ops.context_parallel.softmax_attn_context_parallel`), RoPE uses
        global positions, the short convolution takes its halo from the previous rank.
        Returns ``(y, None)``."""
        if cp_group is not None:
            return self._forward_context_parallel(x, state, cu_seqlens, attention_mask, cp_group)
        mask = check_layer_input("SoftmaxAttention", x, self.d_model, cu_seqlens, attention_mask)
        want = KVCache if self.conv is None else AttentionState
        if state is not None and not isinstance(state, want):
            what = "with" if self.conv is not None else "without"
            raise TypeError(f"SoftmaxAttention: `state` must be a {want.__name__} (as returned by this layer, "
                            f"{what} a short convolution), got {type(state).__name__}")
        if mask is not None:
            return forward_with_mask(self, x, state, mask)
        B, T, _ = x.shape
        kv_state = state if self.conv is None or state is None else state.kv
        q, k, v, conv_state = self._qkv(x, None if self.conv is None or state is None else state.conv, cu_seqlens)
        if self.rope_theta is not None:
            seq, pos = sequence_positions(B, T, cu_seqlens, x.device)  # [B, T] each
            if kv_state is not None:  # continue after the rows each sequence has cached
                pos = pos + kv_state.lengths.to(device=x.device, dtype=torch.long)[seq]
            q, k = rotary_embedding(q, pos, self.rope_theta), rotary_embedding(k, pos, self.rope_theta)
        o, cache = softmax_attn(q, k, v, initial_state=kv_state, output_final_state=True, cu_seqlens=cu_seqlens,
                                max_seqlen=max_seqlen)
        y = self.o_proj(o.reshape(B, T, self.d_model))
        return (y, cache) if self.conv is None else (y, AttentionState(cache, conv_state))

    def _qkv(self, x: torch.Tensor, conv_state, cu_seqlens, cp_group=None):
        """``(q, k, v [B, T, H, K], conv state)``: the projections, through the short convolution if any."""
        B, T, _ = x.shape
        if self.conv is None:
            q, k, v = (p(x).reshape(B, T, self.n_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
            return q, k, v, None
        # one matmul, then the convolution over q, k, v together (depthwise)
        params = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        weight = cached_weights(self, "_qkv_weight_cache", params, lambda: (torch.cat(params),))[0]  # [3·d_model, d_model]
        qkv, conv_state = self.conv(F.linear(x, weight), conv_state, cu_seqlens, cp_group=cp_group)
        q, k, v = (t.reshape(B, T, self.n_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        return q, k, v, conv_state

    def _forward_context_parallel(self, x, state, cu_seqlens, attention_mask, cp_group) -> Tuple[torch.Tensor, None]:
        """:meth:`forward` on this rank's slice of a sequence split over ``cp_group``."""
        from ..ops.context_parallel import global_positions, softmax_attn_context_parallel

        check_context_parallel_input("SoftmaxAttention", x, self.d_model, state, cu_seqlens, attention_mask, cp_group)
        B, T, _ = x.shape
        q, k, v, _ = self._qkv(x, None, cu_seqlens, cp_group)
        if self.rope_theta is not None:
            _, pos = global_positions(B, T, cu_seqlens, cp_group, x.device)  # positions in the whole sequence
            q, k = rotary_embedding(q, pos, self.rope_theta), rotary_embedding(k, pos, self.rope_theta)
        o = softmax_attn_context_parallel(q, k, v, cp_group, cu_seqlens)
        return self.o_proj(o.reshape(B, T, self.d_model)), None

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: Optional[float] = None) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=std if out_std is None else out_std)
