"""Serving options of the chunk ops and the steps: intermediate states and a state pool with slot indices.

References: the recurrent form (float64) run on each sequence's prefix gives the state after
t tokens; the pool form must equal the same call with plain initial states (bitwise) and
each session run alone (bitwise for the compiled decode step, which is batch invariant).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastweights.ops as ops

F64 = torch.float64

CHUNK_OPS = {
    "chunk_linear_attn": ("recurrent_linear_attn", None),
    "chunk_delta_rule": ("recurrent_delta_rule", "beta"),
    "chunk_gated_delta_rule": ("recurrent_gated_delta_rule", "g"),
    "chunk_kda": ("recurrent_kda", "gk"),
}


def _inputs(name, B, T, H, K, V, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=dtype),
    }
    if name != "chunk_linear_attn":
        x["beta"] = torch.rand(B, T, H, generator=gen, dtype=dtype)
    if name == "chunk_gated_delta_rule":
        x["g"] = -0.2 * torch.rand(B, T, H, generator=gen, dtype=dtype)
    if name == "chunk_linear_attn":
        x["g"] = -0.2 * torch.rand(B, T, H, generator=gen, dtype=dtype)
    if name == "chunk_kda":
        x["g"] = -0.2 * torch.rand(B, T, H, K, generator=gen, dtype=dtype)
    return x


def _call(name, x, **kw):
    return getattr(ops, name)(**x, **kw)


def _state_after(name, x, t, h0):
    """The recurrence's state after the first ``t`` tokens of every row of ``x`` (B rows)."""
    return _states_after(name, x, [t], h0)[0]


def _states_after(name, x, positions, h0):
    """The recurrence's states after ``positions`` (increasing) tokens: one pass, segment by segment."""
    ref, out, h, done = getattr(ops, CHUNK_OPS[name][0]), [], h0, 0
    for t in positions:
        if t > done:
            _, h = ref(**{key: val[:, done:t] for key, val in x.items()}, initial_state=h, output_final_state=True)
            done = t
        out.append(h.clone())
    return out


def _sequences(x, cu):
    """Packed ``[1, T, ...]`` inputs -> one ``[1, T_i, ...]`` dict per sequence."""
    return [{key: val[:, cu[i]:cu[i + 1]] for key, val in x.items()} for i in range(len(cu) - 1)]


@pytest.mark.parametrize("name", list(CHUNK_OPS))
@pytest.mark.parametrize("T", [1, 63, 100])
def test_intermediate_states_equal_the_recurrence(name, T):
    """fla's per-chunk entry states and the every-m-tokens block states, float64, K != V, an initial state."""
    B, H, K, V, C = 2, 2, 6, 5, 16
    x = _inputs(name, B, T, H, K, V)
    h0 = torch.randn(B, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(1))
    o, h, states = _call(name, x, initial_state=h0, output_final_state=True, chunk_size=C,
                         return_intermediate_states=True)
    o_plain, h_plain = _call(name, x, initial_state=h0, output_final_state=True, chunk_size=C)
    assert states.shape == (B, -(-T // C), H, K, V)
    assert torch.allclose(o, o_plain, rtol=0, atol=1e-12) and torch.allclose(h, h_plain, rtol=0, atol=1e-12)
    refs = _states_after(name, x, [c * C for c in range(states.shape[1])], h0)
    for c, ref in enumerate(refs):
        err = (states[:, c] - ref).abs().max().item()
        assert err <= 1e-12, (c, err)
    m = 2 * C
    _, h_b, blocks = _call(name, x, initial_state=h0, output_final_state=True, chunk_size=C, state_block_size=m)
    assert blocks.shape == (B, T // m, H, K, V)
    refs = _states_after(name, x, [(j + 1) * m for j in range(blocks.shape[1])], h0)
    for j, ref in enumerate(refs):
        assert (blocks[:, j] - ref).abs().max().item() <= 1e-12
    assert torch.allclose(h_b, h_plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(CHUNK_OPS))
def test_intermediate_states_with_uneven_cu_seqlens(name):
    """Packed sequences of lengths 1, 40, 100, 17: each sequence's states, in order, [1, Σ NT_i, H, K, V]."""
    H, K, V, C = 2, 60 if name == "chunk_delta_rule" else 6, 5, 16  # head size 60 once (the recurrence is slow)
    lengths = [1, 40, 100, 17]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    x = _inputs(name, 1, int(cu[-1]), H, K, V, seed=2)
    h0 = torch.randn(len(lengths), H, K, V, dtype=F64, generator=torch.Generator().manual_seed(3))
    _, h, states = _call(name, x, initial_state=h0, output_final_state=True, chunk_size=C, cu_seqlens=cu,
                         return_intermediate_states=True)
    _, _, blocks = _call(name, x, initial_state=h0, output_final_state=True, chunk_size=C, cu_seqlens=cu,
                         state_block_size=2 * C)
    assert states.shape == (1, sum(-(-t // C) for t in lengths), H, K, V)
    assert blocks.shape == (1, sum(t // (2 * C) for t in lengths), H, K, V)
    row = brow = 0
    for i, seq in enumerate(_sequences(x, cu)):
        nt, nb = -(-lengths[i] // C), lengths[i] // (2 * C)
        positions = sorted({c * C for c in range(nt)} | {(j + 1) * 2 * C for j in range(nb)} | {lengths[i]})
        refs = dict(zip(positions, _states_after(name, seq, positions, h0[i:i + 1])))
        for c in range(nt):
            assert (states[0, row] - refs[c * C][0]).abs().max().item() <= 1e-12
            row += 1
        for j in range(nb):
            assert (blocks[0, brow] - refs[(j + 1) * 2 * C][0]).abs().max().item() <= 1e-12
            brow += 1
        assert (h[i] - refs[lengths[i]][0]).abs().max().item() <= 1e-12


def test_intermediate_state_options_refused_clearly():
    x = _inputs("chunk_delta_rule", 1, 20, 1, 4, 4)
    with pytest.raises(ValueError, match=r"chunk_delta_rule: `state_block_size` must be a multiple of the chunk size 16"):
        _call("chunk_delta_rule", x, chunk_size=16, state_block_size=24)
    with pytest.raises(ValueError, match=r"chunk_delta_rule: `state_block_size` must be a positive int"):
        _call("chunk_delta_rule", x, chunk_size=16, state_block_size=0)
    with pytest.raises(ValueError, match=r"not both"):
        _call("chunk_delta_rule", x, chunk_size=16, state_block_size=16, return_intermediate_states=True)


@pytest.mark.parametrize("name", list(CHUNK_OPS))
def test_pool_with_shuffled_slots(name):
    """A packed batch whose sessions sit in shuffled pool slots (one fresh by mask, one without a slot)
    equals the same call with gathered initial states, bitwise, and each session alone to 1e-12;
    only the sessions' slots change."""
    H, K, V, S, C = 2, 6, 5, 7, 16
    lengths = [5, 63, 20]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    x = _inputs(name, 1, int(cu[-1]), H, K, V, seed=4)
    pool = torch.randn(S, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(5))
    before = pool.clone()
    slots = torch.tensor([5, 2, 0])
    fresh = torch.tensor([True, False, True])  # session 1 starts from zeros and fills slot 2
    h0 = before[slots] * fresh.view(-1, 1, 1, 1)
    o, h = _call(name, x, initial_state=pool, state_indices=slots, has_initial_state=fresh, cu_seqlens=cu,
                 output_final_state=True, chunk_size=C)
    o_ref, h_ref = _call(name, x, initial_state=h0, cu_seqlens=cu, output_final_state=True, chunk_size=C)
    assert torch.equal(o, o_ref) and torch.equal(h, h_ref)
    assert torch.equal(pool[slots], h_ref)
    untouched = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    for i, seq in enumerate(_sequences(x, cu)):
        o_i, h_i = _call(name, seq, initial_state=h0[i:i + 1], output_final_state=True, chunk_size=C)
        assert (o_i - o[:, cu[i]:cu[i + 1]]).abs().max().item() <= 1e-12
        assert (h_i[0] - pool[slots[i]]).abs().max().item() <= 1e-12
    # -1: a sequence without a slot starts from zeros and writes nothing
    pool2 = before.clone()
    o2, _ = _call(name, x, initial_state=pool2, state_indices=torch.tensor([5, -1, 0], dtype=torch.int32),
                  cu_seqlens=cu, chunk_size=C)
    o2_ref, _ = _call(name, x, initial_state=before[[5, 0, 0]] * torch.tensor([1.0, 0, 1], dtype=F64).view(-1, 1, 1, 1),
                      cu_seqlens=cu, chunk_size=C)
    assert torch.equal(o2, o2_ref)
    assert torch.equal(pool2[[1, 2, 3, 4, 6]], before[[1, 2, 3, 4, 6]])


STEPS = ["delta_rule_step", "gated_delta_rule_step", "linear_attn_step"]


def _step_inputs(name, N, H, K, V, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(N, H, K, generator=gen, dtype=dtype),
         "k": F.normalize(torch.randn(N, H, K, generator=gen, dtype=dtype), dim=-1),
         "v": torch.randn(N, H, V, generator=gen, dtype=dtype)}
    if name != "linear_attn_step":
        x["beta"] = torch.rand(N, H, generator=gen, dtype=dtype)
    if name != "delta_rule_step":
        x["g"] = -0.3 * torch.rand(N, H, generator=gen, dtype=dtype)
    return x


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_step_pool_equals_each_session_alone(name, dtype):
    """One batched decode call advances N sessions in shuffled slots; each equals its session stepped
    alone, bitwise; fresh and slot-less rows start from zeros; other slots stay as they were."""
    H, K, V, S = 2, 60, 7, 9
    pool = torch.randn(S, H, K, V, dtype=dtype, generator=torch.Generator().manual_seed(6))
    before = pool.clone()
    slots = torch.tensor([7, 0, 3, -1, 5])
    has = torch.tensor([True, True, False, True, True])
    x = _step_inputs(name, len(slots), H, K, V, seed=7, dtype=dtype)
    o, out = getattr(ops, name)(**x, state=pool, state_indices=slots, has_initial_state=has)
    assert out is pool
    for i, s in enumerate(slots.tolist()):
        alone = before[s:s + 1].clone() if s >= 0 and has[i] else torch.zeros(1, H, K, V, dtype=dtype)
        o_i, h_i = getattr(ops, name)(**{key: val[i:i + 1] for key, val in x.items()}, state=alone)
        if name == "linear_attn_step":  # PyTorch's batched products: equal to rounding, not bitwise, across batch sizes
            assert torch.allclose(o[i:i + 1], o_i, rtol=1e-5, atol=1e-6), i
            assert s < 0 or torch.allclose(pool[s:s + 1], h_i, rtol=1e-5, atol=1e-6), i
            continue
        assert torch.equal(o[i:i + 1], o_i), i  # the compiled step: batch invariant
        if s >= 0:
            assert torch.equal(pool[s:s + 1], h_i), i
    rest = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(pool[rest], before[rest])


@pytest.mark.parametrize("name", ["delta_rule_step", "chunk_gated_delta_rule"])
def test_bad_state_indices_leave_the_pool_untouched(name):
    H, K, V, S = 1, 4, 3, 4
    pool = torch.randn(S, H, K, V)
    before = pool.clone()
    if name.endswith("_step"):
        x = _step_inputs(name, 2, H, K, V, seed=8)

        def call(idx, **kw):
            return ops.delta_rule_step(**x, state=pool, state_indices=idx, **kw)
    else:
        x = _inputs(name, 1, 10, H, K, V, dtype=torch.float32)
        cu = torch.tensor([0, 4, 10])

        def call(idx, **kw):
            return ops.chunk_gated_delta_rule(**x, initial_state=pool, state_indices=idx, cu_seqlens=cu, **kw)
    with pytest.raises(ValueError, match=rf"{name}: `state_indices`\[1\] = 4 is out of range: expected a slot in \[0, 4\)"):
        call(torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=rf"{name}: `state_indices`\[0\] = -2 is out of range"):
        call(torch.tensor([-2, 1]))
    with pytest.raises(ValueError, match=rf"{name}: `state_indices` names slot 2 more than once"):
        call(torch.tensor([2, 2]))
    with pytest.raises(TypeError, match=rf"{name}: `state_indices` must be an int32/int64 tensor \[N\]=\[2\], got dtype torch.float32"):
        call(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=rf"{name}: `state_indices` must have shape \[N\]=\[2\]"):
        call(torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match=rf"{name}: `has_initial_state` must be a bool tensor"):
        call(torch.tensor([0, 1]), has_initial_state=torch.tensor([1, 0]))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_kda_step_pool_equals_each_session_alone(dtype):
    """KDA's one-token step in the pool form: shuffled slots, a fresh row (−1) and a row told it has no
    initial state; each equals its session stepped alone, bitwise (the same step on the gathered rows),
    the other slots untouched; a bad slot is refused naming ``state_indices`` with the pool unchanged."""
    H, K, V, S = 2, 60, 7, 9
    gen = torch.Generator().manual_seed(11)
    pool = torch.randn(S, H, K, V, dtype=dtype, generator=gen)
    before = pool.clone()
    slots = torch.tensor([4, -1, 8, 1])
    has = torch.tensor([True, True, False, True])
    n = len(slots)
    q = torch.randn(n, H, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(n, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(n, H, V, generator=gen, dtype=dtype)
    beta = torch.rand(n, H, generator=gen, dtype=dtype)
    gk = -torch.rand(n, H, K, generator=gen, dtype=dtype)
    with torch.no_grad():
        o, out = ops.kda_step(q, k, v, beta, gk, pool, K ** -0.5, state_indices=slots, has_initial_state=has)
        assert out is pool
        for i, s in enumerate(slots.tolist()):
            alone = before[s:s + 1].clone() if s >= 0 and has[i] else torch.zeros(1, H, K, V, dtype=dtype)
            o_i, h_i = ops.kda_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], beta[i:i + 1], gk[i:i + 1], alone, K ** -0.5)
            assert torch.equal(o[i:i + 1], o_i), i
            if s >= 0:
                assert torch.equal(pool[s:s + 1], h_i), i
        rest = [s for s in range(S) if s not in slots.tolist()]
        assert torch.equal(pool[rest], before[rest])
        kept = pool.clone()
        with pytest.raises(ValueError, match=r"kda_step: `state_indices`\[1\] = 9 is out of range"):
            ops.kda_step(q[:2], k[:2], v[:2], beta[:2], gk[:2], pool, K ** -0.5, state_indices=torch.tensor([0, 9]))
        assert torch.equal(pool, kept)
