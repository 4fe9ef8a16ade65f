"""Softmax attention: the fast path equals the definition; the KV cache decodes exactly and grows."""

import pytest
import torch

from fastweights import ops
from helpers import assert_close

TOL = 1e-12


def qkv(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for d in (K, K, V))


@pytest.mark.parametrize("shape", [(2, 1, 2, 8, 8), (1, 63, 3, 60, 20), (3, 100, 1, 16, 24)], ids=str)
def test_causal_attention_equals_definition(shape):
    q, k, v = qkv(*shape)
    o, _ = ops.softmax_attn(q, k, v)
    assert_close("output", o, ops.softmax_attn_reference(q, k, v), TOL)


def test_prefill_then_decode_equals_full_pass():
    q, k, v = qkv(2, 40, 2, 12, 6, seed=1)
    full, _ = ops.softmax_attn(q, k, v, scale=0.3)
    o, cache = ops.softmax_attn(q[:, :25], k[:, :25], v[:, :25], scale=0.3, output_final_state=True)
    outs = [o]
    for t in range(25, 40):
        o, cache = ops.softmax_attn(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], scale=0.3, initial_state=cache, output_final_state=True)
        outs.append(o)
    assert_close("decoded", torch.cat(outs, dim=1), full, TOL)
    assert cache.keys.shape == (2, 2, 40, 12) and cache.lengths.tolist() == [40, 40]


def test_cache_grows_with_context():
    q, k, v = qkv(1, 64, 2, 8, 8)
    sizes = [ops.softmax_attn(q[:, :t], k[:, :t], v[:, :t], output_final_state=True)[1].nbytes for t in (16, 32, 64)]
    assert sizes[0] < sizes[1] < sizes[2]
    assert sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0])  # linear in T


def test_varlen_equals_each_sequence_alone_and_caches_compact():
    lengths = [5, 17, 1, 9]
    q, k, v = qkv(1, sum(lengths), 2, 6, 4, seed=2)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, cache = ops.softmax_attn(q, k, v, cu_seqlens=cu, output_final_state=True)
    assert cache.lengths.tolist() == lengths
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert_close(f"seq {n}", o[:, s:e], ops.softmax_attn_reference(q[:, s:e], k[:, s:e], v[:, s:e]), TOL)
        assert torch.equal(cache.keys[n, :, : e - s], k[0, s:e].transpose(0, 1))
        assert (cache.keys[n, :, e - s :] == 0).all()


def test_uneven_caches_then_varlen_continuation():
    """Sequences with different cached lengths continue with different numbers of new tokens."""
    total = [12, 7, 20]
    cached = [4, 7, 13]
    seqs = [qkv(1, t, 2, 5, 3, seed=10 + i) for i, t in enumerate(total)]
    first = [tuple(x[:, :c] for x in s) for s, c in zip(seqs, cached)]
    rest = [tuple(x[:, c:] for x in s) for s, c in zip(seqs, cached)]
    cu1 = torch.tensor([0] + cached).cumsum(0)
    cu2 = torch.tensor([0] + [t - c for t, c in zip(total, cached)]).cumsum(0)
    packed1 = [torch.cat([p[i] for p in first], dim=1) for i in range(3)]
    _, cache = ops.softmax_attn(*packed1, cu_seqlens=cu1, output_final_state=True)
    keep = [i for i in range(3) if total[i] > cached[i]]
    cache = ops.KVCache(*(x[keep] for x in cache))  # sequence 1 has nothing left to read
    cu2 = torch.tensor([0] + [total[i] - cached[i] for i in keep]).cumsum(0)
    packed2 = [torch.cat([rest[i][j] for i in keep], dim=1) for j in range(3)]
    o, cache2 = ops.softmax_attn(*packed2, cu_seqlens=cu2, initial_state=cache, output_final_state=True)
    for n, i in enumerate(keep):
        s, e = cu2[n].item(), cu2[n + 1].item()
        want = ops.softmax_attn_reference(*seqs[i])[:, cached[i]:]
        assert_close(f"seq {i} continuation", o[:, s:e], want, TOL)
        assert cache2.lengths[n].item() == total[i]
        assert torch.equal(cache2.values[n, :, : total[i]], seqs[i][2][0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_returns_input_dtype(dtype):
    q, k, v = (x.to(dtype) for x in qkv(1, 10, 2, 8, 8))
    o, cache = ops.softmax_attn(q, k, v, output_final_state=True)
    assert o.dtype == dtype and cache.keys.dtype == dtype
    err = (o.double() - ops.softmax_attn_reference(*(x.double() for x in (q, k, v)))).abs().max()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("pieces", [(10, 1, 7, 22), (1, 39), (40,)], ids=str)
def test_continuing_a_full_cache_in_pieces_equals_one_pass(pieces):
    """Prefill, then several tokens at a time: the dense-cache path (no per-sequence mask)."""
    q, k, v = qkv(2, 40, 3, 8, 5, seed=4)
    full, _ = ops.softmax_attn(q, k, v)
    outs, cache, start = [], None, 0
    for n in pieces:
        o, cache = ops.softmax_attn(q[:, start : start + n], k[:, start : start + n], v[:, start : start + n], initial_state=cache, output_final_state=True)
        outs.append(o)
        start += n
    assert_close("pieces", torch.cat(outs, dim=1), full, TOL)
    assert cache.lengths.tolist() == [40, 40] and torch.equal(cache.keys, k.transpose(1, 2))
