"""Causal softmax attention: the keep-the-dataset solver (Wang, Shi & Fox 2025, solver 1).

For a query q_t, softmax attention is the local-constant fit over every stored
pair, the kernel-weighted average

    o_t = Σ_{τ≤t} softmax_τ(scale · q_t · k_τ) v_τ.

It keeps every key-value row because a later query may weigh each row
differently; during decoding that dataset is the KV cache, and it grows by one
row per token (attention's memory is a dataset, not a hidden box).

The "state" of this op is therefore a :class:`KVCache`, not a fixed matrix.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .._checks import check_inputs, compute_dtype, resolve_scale
from .._frontend import Packing
from ..precision import autocast_off, check_autocast


class _KVFields(NamedTuple):
    keys: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor


class KVCache(_KVFields):
    """The retained dataset of softmax attention.

    Fields:
        keys: ``[N, H, L, K]``, values: ``[N, H, L, V]``, in the inputs' dtype.
        lengths: ``[N]`` int64, how many of the L rows of each sequence are real
            (sequences of a batch may have cached different numbers of tokens;
            rows past ``lengths[n]`` are padding and never attended to).

    A cache returned by a decoding call is a view of the first L rows of a larger
    preallocated buffer (:class:`_GrowingRows`, shared by the successive caches of
    one decoding chain): the next call writes its rows in place after them, so a
    step reads the L cached rows instead of copying them. The buffer grows by
    about 1.5× when full (amortised O(1) copies per token). Every earlier cache
    of the chain stays valid (its rows are never overwritten); continuing from an
    earlier one again copies into a fresh buffer.
    """

    # No __slots__: an instance may carry ``_rows``, the buffer it is a view of.

    @property
    def nbytes(self) -> int:
        """Bytes of the L cached rows; grows linearly with the context length (a decoding
        buffer reserves up to about 1.5× as many: :attr:`reserved_nbytes`)."""
        return sum(t.numel() * t.element_size() for t in self)

    @property
    def reserved_nbytes(self) -> int:
        """Bytes held, including a decoding buffer's spare rows."""
        rows = getattr(self, "_rows", None)
        if rows is None:
            return self.nbytes
        return sum(t.numel() * t.element_size() for t in (rows.keys, rows.values, self.lengths))


class _GrowingRows:
    """Preallocated key/value rows ``[N, H, capacity, ·]`` of one decoding chain; the first
    ``filled`` rows are written (the same count for every sequence)."""

    __slots__ = ("keys", "values", "filled")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        self.keys, self.values, self.filled = keys, values, filled

    @staticmethod
    def capacity(rows: int) -> int:
        """Rows to reserve for ``rows`` filled ones: about 1.5×, rounded up to a multiple of 64."""
        return -(-(rows + rows // 2 + 1) // 64) * 64

    @classmethod
    def copy_of(cls, keys: torch.Tensor, values: torch.Tensor, extra: int) -> "_GrowingRows":
        """A new buffer holding ``keys``/``values`` ``[N, H, L, ·]`` with room for at least ``extra`` more rows."""
        n, h, length = keys.shape[:3]
        cap = cls.capacity(length + extra)
        new_k = keys.new_empty(n, h, cap, keys.shape[-1])
        new_v = values.new_empty(n, h, cap, values.shape[-1])
        new_k[:, :, :length] = keys
        new_v[:, :, :length] = values
        return cls(new_k, new_v, length)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` ``[N, H, T, ·]`` after the filled rows; return the views of all rows."""
        start, stop = self.filled, self.filled + k.shape[2]
        self.keys[:, :, start:stop] = k
        self.values[:, :, start:stop] = v
        self.filled = stop
        return self.keys[:, :, :stop], self.values[:, :, :stop]


def _decode_rows(cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, "_GrowingRows"]:
    """The rows ``[cache | k, v]`` (head-first) for a cache whose sequences all hold L rows, written in place.

    Reuses the cache's buffer when this cache is the newest of its chain and the buffer
    has room; otherwise copies the cache into a new buffer (the first step after a
    prefill, a full buffer, or a second continuation of an older cache).
    """
    rows = getattr(cache, "_rows", None)
    length, t_new = cache.keys.shape[2], k.shape[2]
    if (
        rows is None or rows.filled != length or rows.keys.data_ptr() != cache.keys.data_ptr()
        or rows.keys.shape[2] < length + t_new
    ):
        rows = _GrowingRows.copy_of(cache.keys, cache.values, t_new)
    keys, values = rows.append(k, v)
    return keys, values, rows


def _check_cache(op: str, cache, n: int, q: torch.Tensor, v: torch.Tensor) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(f"{op}: `initial_state` must be a KVCache (as returned with output_final_state=True), got {type(cache).__name__}")
    _, _, h, kd = q.shape
    want_k = (n, h, cache.keys.shape[2], kd)
    want_v = (n, h, cache.keys.shape[2], v.shape[-1])
    if cache.keys.dim() != 4 or tuple(cache.keys.shape) != want_k:
        raise ValueError(f"{op}: `initial_state.keys` must have shape [N, H, L, K] = {list(want_k[:2])} + [L, {kd}], got {list(cache.keys.shape)}")
    if tuple(cache.values.shape) != want_v:
        raise ValueError(f"{op}: `initial_state.values` must have shape {list(want_v)}, got {list(cache.values.shape)}")
    if tuple(cache.lengths.shape) != (n,):
        raise ValueError(f"{op}: `initial_state.lengths` must have shape [{n}], got {list(cache.lengths.shape)}")
    for name, t in (("keys", cache.keys), ("values", cache.values)):
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: `initial_state.{name}` must have the dtype of `q` ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{op}: `initial_state.{name}` is on {t.device}, expected {q.device}")


def softmax_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[KVCache] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[KVCache]]:
    """Causal softmax attention with an optional KV cache.

    Efficient implementation equivalent to :func:`softmax_attn_reference`. Query
    i of a sequence attends to that sequence's cached rows and to new rows
    0..i (for T = 3 new tokens after L = 2 cached ones)::

                 cache  new
        q_0   [  1 1 | 1 0 0 ]
        q_1   [  1 1 | 1 1 0 ]
        q_2   [  1 1 | 1 1 1 ]

    Decoding is the same call with T = 1 and the cache of the previous call.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        scale: ``None`` means ``K ** -0.5``.
        initial_state: a :class:`KVCache` with N = B (or N sequences with cu_seqlens).
        output_final_state: also return the cache extended by these T tokens.
        cu_seqlens: ``[N + 1]`` offsets of N sequences packed along T (B must be 1);
            each sequence attends only to itself (and to its own cache rows).
        cu_seqlens_cpu: the same offsets on the CPU (checks without a device sync).
        max_seqlen: the longest sequence in ``cu_seqlens`` (as FlashAttention's varlen
            API); with it nothing reads tensor values, so ``torch.compile`` has no graph break.

    Under ``torch.autocast`` the scores and the softmax are computed in fp32 and ``o``
    comes back in q's dtype (autocast would run them in bf16/fp16).

    Returns:
        ``(o [B, T, H, V] in the input dtype, KVCache or None)``.
    """
    op = "softmax_attn"
    n = check_inputs(op, q, k, v, cu_seqlens=cu_seqlens, scale=scale, cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen)
    check_autocast(op, q.device, q=q, k=k, v=v)
    if initial_state is not None:
        _check_cache(op, initial_state, n, q, v)
    with autocast_off(q.device):  # fp32 scores and softmax (fastweights.ops._frontend)
        return _attend(q, k, v, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, max_seqlen)


def _attend(q, k, v, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, max_seqlen):
    """:func:`softmax_attn` after its checks."""
    out_dtype = q.dtype
    dt = compute_dtype(out_dtype)
    scale = resolve_scale(scale, q.shape[-1])
    device = q.device

    valid = packing = None
    if cu_seqlens is not None:
        packing = Packing.build(cu_seqlens, q.shape[1], max_seqlen, cu_seqlens_cpu)
        q, k, v = (packing.pad(x) for x in (q, k, v))
        valid = packing.valid
        new_len = valid.sum(1)
    else:
        new_len = torch.full((q.shape[0],), q.shape[1], dtype=torch.long, device=device)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [N, H, T, D]
    t_new = q.shape[2]

    if initial_state is None:
        cache_len = torch.zeros_like(new_len)
        keys, values = k, v
        if valid is None:  # the common case: plain causal attention
            o = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), is_causal=True, scale=scale)
    else:
        cache_len = initial_state.lengths.to(device=device, dtype=torch.long)
        l_cache = initial_state.keys.shape[2]
        rows = getattr(initial_state, "_rows", None)
        uniform = rows is not None and rows.filled == l_cache  # a chain's newest cache: all lengths are L
        if valid is None and (uniform or bool((cache_len == l_cache).all())):
            # The common decode case: every sequence has cached all L rows, so the new rows
            # simply follow them and no per-sequence mask or compaction is needed. Without
            # autograd they are written in place into a preallocated buffer (no copy of the
            # cache per step); with it, concatenated (an in-place write would invalidate
            # the rows an earlier step saved for its backward).
            rows = None
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, initial_state.keys, initial_state.values)):
                keys = torch.cat([initial_state.keys, k], dim=2)
                values = torch.cat([initial_state.values, v], dim=2)
            else:
                keys, values, rows = _decode_rows(initial_state, k, v)
            mask = None if t_new == 1 else torch.ones(t_new, l_cache + t_new, dtype=torch.bool, device=device).tril(l_cache)
            o = F.scaled_dot_product_attention(q.to(dt), keys.to(dt), values.to(dt), attn_mask=mask, scale=scale)
            o = o.transpose(1, 2).to(out_dtype)
            if not output_final_state:
                return o, None
            cache = KVCache(keys, values, cache_len + new_len)
            if rows is not None:
                cache._rows = rows
            return o, cache
        keys = torch.cat([initial_state.keys, k], dim=2)
        values = torch.cat([initial_state.values, v], dim=2)
    if initial_state is not None or valid is not None:
        l_cache = keys.shape[2] - t_new
        j = torch.arange(keys.shape[2], device=device)
        i = torch.arange(t_new, device=device)
        sees_cache = (j[None, None, :] < cache_len[:, None, None]) & (j < l_cache)[None, None, :]
        sees_new = (j[None, :] - l_cache <= i[:, None]) & (j[None, :] >= l_cache)
        mask = (sees_cache | sees_new[None]).unsqueeze(1)  # [N, 1, T, L + T]
        o = F.scaled_dot_product_attention(q.to(dt), keys.to(dt), values.to(dt), attn_mask=mask, scale=scale)

    o = o.transpose(1, 2)
    if packing is not None:
        o = packing.unpad(o)
    o = o.to(out_dtype)
    if not output_final_state:
        return o, None
    if initial_state is None:  # the (padded) new rows are the whole cache: no compaction
        return o, KVCache(keys, values, new_len)
    return o, _extend_cache(keys, values, cache_len, new_len, keys.shape[2] - t_new)


def _extend_cache(keys, values, cache_len, new_len, l_cache) -> KVCache:
    """Compact ``[cache rows | new rows]`` into each sequence's ``cache_len + new_len`` real rows."""
    lengths = cache_len + new_len
    pos = torch.arange(int(lengths.max()), device=keys.device)
    # Row p of sequence n comes from cache row p, or from new row p - cache_len[n].
    src = torch.where(pos[None] < cache_len[:, None], pos[None], l_cache + pos[None] - cache_len[:, None])
    src = src.clamp(max=keys.shape[2] - 1)
    real = pos[None] < lengths[:, None]
    index = src[:, None, :, None]

    def gather(x):
        out = x.gather(2, index.expand(-1, x.shape[1], -1, x.shape[3]))
        return torch.where(real[:, None, :, None], out, torch.zeros((), dtype=x.dtype, device=x.device))

    return KVCache(gather(keys), gather(values), lengths)


def softmax_attn_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None
) -> torch.Tensor:
    """The definition, one query at a time: ``o_t = Σ_{τ≤t} softmax_τ(scale q_t·k_τ) v_τ``.

    ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]`` -> ``o: [B, T, H, V]``. Slow; for tests.
    """
    scale = resolve_scale(scale, q.shape[-1])
    outputs = []
    for t in range(q.shape[1]):
        scores = scale * torch.einsum("bhk,bshk->bhs", q[:, t], k[:, : t + 1])
        weights = torch.softmax(scores, dim=-1)
        outputs.append(torch.einsum("bhs,bshv->bhv", weights, v[:, : t + 1]))
    return torch.stack(outputs, dim=1)
