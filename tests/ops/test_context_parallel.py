"""Context parallelism of the chunk ops on gloo (CPU): equal to the single-process op in float64.

Each case builds the global inputs on every rank (same seed), runs the single-process
chunk op on all of T, then the context-parallel op on the rank's slice, with the loss
``Σ_r [(o_r·do_r).sum() + w_r·(h_T·dh).sum()]`` (Σ w_r = 1, so the ranks' shares of the
final-state cotangent add up to the single-process loss). Compared: o (the slice), the
final state (on every rank), dq, dk, dv, dβ, dg (the slice) and dh0 (summed over the
ranks: each rank gets the share of the sequences that start on it).

All default cases share one 2-process run (starting processes is the expensive part);
the 4-process cases are marked slow.
"""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks

TOL = 1e-10

# (name, op, shape (B, T, H, K, V), chunk, options)
CASES_2 = [
    ("delta-rows-h0", "delta", (2, 32, 2, 8, 6), 8, dict(h0=True)),
    ("gated-packed-cross-h0", "gated", (1, 32, 2, 8, 6), 8, dict(h0=True, cu=[0, 3, 21, 22, 32])),
    ("gated-packed-at-boundary", "gated", (1, 32, 2, 6, 5), 8, dict(h0=False, cu=[0, 16, 32])),
    ("linear-normalize-decay-packed-h0", "linear", (1, 32, 2, 8, 6), 8, dict(h0=True, g=True, normalize=True, cu=[0, 3, 21, 22, 32])),
    ("linear-rows-plain", "linear", (2, 32, 2, 8, 6), 8, dict(h0=False, g=False)),
    # Local lengths that are no multiple of the chunk size (the slices end in a partial chunk,
    # padded with no-op tokens): L = 1, 17, 20, 33 on 2 ranks, sequences crossing the boundary.
    ("delta-rows-h0-L1", "delta", (2, 2, 2, 8, 6), 8, dict(h0=True)),
    ("gated-packed-cross-h0-L17", "gated", (1, 34, 2, 8, 6), 8, dict(h0=True, cu=[0, 3, 20, 21, 34])),
    ("gated-rows-L20-C32", "gated", (2, 40, 2, 6, 5), 32, dict(h0=True)),
    ("delta-packed-L33", "delta", (1, 66, 2, 8, 6), 16, dict(h0=True, cu=[0, 30, 40, 66])),
    ("linear-normalize-decay-packed-h0-L17", "linear", (1, 34, 2, 8, 6), 8, dict(h0=True, g=True, normalize=True, cu=[0, 5, 30, 34])),
    ("linear-rows-L20", "linear", (2, 40, 2, 8, 6), 16, dict(h0=True, g=False)),
]

FP32_CASES = ["gated-packed-cross-h0", "linear-normalize-decay-packed-h0", "gated-packed-cross-h0-L17"]

CASES_4 = [
    ("delta-rows-h0", "delta", (2, 64, 2, 8, 6), 8, dict(h0=True)),
    ("gated-one-sequence-h0", "gated", (1, 64, 2, 8, 6), 8, dict(h0=True, cu=[0, 64])),
    ("gated-packed-across-3-ranks", "gated", (1, 64, 3, 6, 10), 8, dict(h0=True, cu=[0, 5, 16, 60, 61, 64])),
    ("delta-packed-many", "delta", (1, 64, 2, 8, 6), 16, dict(h0=True, cu=[0, 1, 17, 33, 40, 64])),
    ("linear-normalize-decay-across-3", "linear", (1, 64, 2, 8, 6), 8, dict(h0=True, g=True, normalize=True, cu=[0, 5, 60, 64])),
    ("linear-decay-rows", "linear", (2, 64, 2, 8, 6), 16, dict(h0=True, g=True)),
]


def _inputs(op, shape, opts):
    import torch.nn.functional as F

    B, T, H, K, V = shape
    gen = torch.Generator().manual_seed(1234)
    dt = torch.float64
    cu = opts.get("cu")
    n = B if cu is None else len(cu) - 1
    vs = V + int(opts.get("normalize", False))
    x = dict(
        q=torch.randn(B, T, H, K, generator=gen, dtype=dt), k=torch.randn(B, T, H, K, generator=gen, dtype=dt),
        v=torch.randn(B, T, H, V, generator=gen, dtype=dt), beta=torch.rand(B, T, H, generator=gen, dtype=dt),
        g=0.3 * F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=dt)),
        h0=torch.randn(n, H, K, vs, generator=gen, dtype=dt) if opts.get("h0") else None,
    )
    if op == "linear" and not opts.get("g"):
        x["g"] = None
    if op != "gated" and op != "linear":
        x["g"] = None
    if op == "linear":
        x["beta"] = None
    do = torch.randn(B, T, H, V, generator=gen, dtype=dt)
    dh = torch.randn(n, H, K, vs, generator=gen, dtype=dt)
    return x, do, dh, (None if cu is None else torch.tensor(cu))


def _call(op, x, cu, chunk, opts, group):
    from fastweights.ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_linear_attn

    kw = dict(initial_state=x["h0"], output_final_state=True, cu_seqlens=cu, chunk_size=chunk, cp_group=group)
    if op == "delta":
        return chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], qk_norm="l2", **kw)
    if op == "gated":
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], qk_norm="l2", **kw)
    return chunk_linear_attn(x["q"], x["k"], x["v"], g=x["g"], feature_map="elu", normalize=opts.get("normalize", False), **kw)


def _case_errors(rank, world, case):
    """Max relative error of every compared tensor on this rank."""
    import torch.distributed as dist

    _, op, shape, chunk, opts = case
    x, do, dh, cu = _inputs(op, shape, opts)
    names = [n for n in ("q", "k", "v", "beta", "g", "h0") if x[n] is not None]

    ref_in = {n: (None if t is None else t.clone().requires_grad_()) for n, t in x.items()}
    o, h_t = _call(op, ref_in, cu, chunk, opts, None)
    ((o * do).sum() + (h_t * dh).sum()).backward()

    length = shape[1] // world
    part = slice(rank * length, (rank + 1) * length)
    weights = torch.linspace(1.0, 2.0, world, dtype=torch.float64)
    weights = weights / weights.sum()
    loc_in = {n: (None if t is None else (t if n == "h0" else t[:, part]).clone().requires_grad_()) for n, t in x.items()}
    o_cp, h_cp = _call(op, loc_in, cu, chunk, opts, dist.group.WORLD)
    ((o_cp * do[:, part]).sum() + weights[rank] * (h_cp * dh).sum()).backward()

    def rel(got, want):
        return float((got.detach() - want).abs().max() / want.abs().max())

    errors = {"o": rel(o_cp, o.detach()[:, part]), "state": rel(h_cp, h_t.detach())}
    for n in names:
        if n == "h0":
            share = loc_in[n].grad if loc_in[n].grad is not None else torch.zeros_like(x[n])
            total = share.clone()
            dist.all_reduce(total)
            errors["dh0"] = rel(total, ref_in[n].grad)
        else:
            errors["d" + n] = rel(loc_in[n].grad, ref_in[n].grad[:, part])
    return errors


def _fp32_errors(rank, world, case):
    """fp32 error against float64 of the single-process op and of the context-parallel one."""
    import torch.distributed as dist

    _, op, shape, chunk, opts = case
    x, do, dh, cu = _inputs(op, shape, opts)
    names = [n for n in ("q", "k", "v", "beta", "g", "h0") if x[n] is not None]
    length = shape[1] // world
    part = slice(rank * length, (rank + 1) * length)

    def run(dtype, group):
        leaves = {}
        for n, t in x.items():
            if t is not None:
                t = t if n == "h0" or group is None else t[:, part]
                t = t.to(torch.float32 if n == "h0" and dtype != torch.float64 else dtype)
            leaves[n] = None if t is None else t.clone().requires_grad_()
        o, h_t = _call(op, leaves, cu, chunk, opts, group)
        o_do = do if group is None else do[:, part]
        share = 1.0 if group is None else (1.0 if rank == world - 1 else 0.0)
        ((o.double() * o_do).sum() + share * (h_t.double() * dh).sum()).backward()
        grads = {}
        for n in names:
            grad = leaves[n].grad
            if n == "h0" and group is not None:
                grad = (grad if grad is not None else torch.zeros_like(leaves[n])).clone()
                dist.all_reduce(grad)
            elif group is None and n != "h0":
                grad = grad[:, part]
            grads["d" + n] = grad.double()
        out = o.double() if group is not None else o.double()[:, part]
        return {"o": out, "state": h_t.double(), **grads}

    ref, single, cp = run(torch.float64, None), run(torch.float32, None), run(torch.float32, dist.group.WORLD)

    def rel(got, want):
        return float((got.detach() - want.detach()).abs().max() / want.detach().abs().max())

    return {n: (rel(single[n], ref[n]), rel(cp[n], ref[n])) for n in ref}


def _refusals(rank, world):
    """Every bad input raises on every rank (and the group still works afterwards)."""
    import torch.distributed as dist

    from fastweights.ops import chunk_delta_rule, chunk_linear_attn

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, 2, 4, generator=gen)
    beta = torch.rand(1, 16, 2, generator=gen)
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))

    attempt("chunk_size", lambda: chunk_delta_rule(q, q, q, beta, chunk_size=8 if rank == 0 else 6, cp_group=group))
    short = q[:, : 16 if rank == 0 else 8]
    attempt("lengths", lambda: chunk_delta_rule(short, short, short, beta[:, : short.shape[1]], chunk_size=8, cp_group=group))
    cu = torch.tensor([0, 5 + rank, 32])
    attempt("cu_seqlens", lambda: chunk_delta_rule(q, q, q, beta, cu_seqlens=cu, chunk_size=8, cp_group=group))
    attempt("not_a_group", lambda: chunk_linear_attn(q, q, q, chunk_size=8, cp_group="world"))
    bad_beta = beta * (2.0 if rank == 1 else 1.0) + (0.5 if rank == 1 else 0.0)
    attempt("beta_on_rank_1", lambda: chunk_delta_rule(q, q, q, bad_beta, chunk_size=8, cp_group=group))
    # The group is still in step: a good call works.
    o, _ = chunk_delta_rule(q, q, q, beta, chunk_size=8, cp_group=group)
    out["after"] = bool(torch.isfinite(o).all())
    return out


def _communication(rank, world):
    """Bytes counted by the op's log, by a wrapper around the collective, and by the formula."""
    import torch.distributed as dist

    from fastweights.ops import chunk_gated_delta_rule, chunk_linear_attn
    from fastweights.ops.context_parallel import count_communication, summary_bytes

    seen = []
    original = dist.all_gather_single

    def counting(output, inp, *args, **kwargs):
        seen.append(inp.numel() * inp.element_size())
        return original(output, inp, *args, **kwargs)

    dist.all_gather_single = counting
    try:
        results = {}
        for name, B, T, H, K, V in (("gated", 1, 64, 2, 8, 6), ("linear", 2, 64, 3, 4, 5)):
            gen = torch.Generator().manual_seed(0)
            q, k = (torch.randn(B, T // world, H, K, generator=gen, requires_grad=True) for _ in range(2))
            v = torch.randn(B, T // world, H, V, generator=gen, requires_grad=True)
            g = torch.nn.functional.logsigmoid(torch.randn(B, T // world, H, generator=gen)).requires_grad_()
            beta = torch.rand(B, T // world, H, generator=gen).requires_grad_()
            seen.clear()
            with count_communication() as log:
                if name == "gated":
                    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, cp_group=dist.group.WORLD)
                    formula = summary_bytes("gated_delta_rule", B, H, K, V, torch.float32)
                else:
                    o, _ = chunk_linear_attn(q, k, v, g=g, normalize=True, chunk_size=16, cp_group=dist.group.WORLD)
                    formula = summary_bytes("linear_attn", B, H, K, V + 1, torch.float32, gated=True)
                o.sum().backward()
            results[name] = dict(
                wrapped=sum(seen), logged=log.bytes_of("fingerprint") + log.bytes_of("summaries") + log.bytes_of("summary_grads"),
                summaries=log.bytes_of("summaries"), formula=formula, grads=log.bytes_of("summary_grads"),
                grads_formula=B * H * K * (V + (name == "linear")) * 4,
            )
        return results
    finally:
        dist.all_gather_single = original


def _default_run(rank, world):
    return dict(
        cases={case[0]: _case_errors(rank, world, case) for case in CASES_2},
        refusals=_refusals(rank, world),
        communication=_communication(rank, world),
        fp32={case[0]: _fp32_errors(rank, world, case) for case in CASES_2 if case[0] in FP32_CASES},
    )


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_default_run, 2, timeout=240)


def _worst(per_rank, case):
    worst = {}
    for errors in per_rank:
        for name, e in errors[case].items():
            worst[name] = max(worst.get(name, 0.0), e)
    return worst


@pytest.mark.parametrize("case", [c[0] for c in CASES_2])
def test_two_ranks_equal_single_process(two_ranks, case):
    worst = _worst([r["cases"] for r in two_ranks], case)
    print(case, {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) < TOL, worst


@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in CASES_4])
def test_four_ranks_equal_single_process(four_ranks, case):
    worst = _worst(four_ranks, case)
    print(case, {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) < TOL, worst


def _four_rank_run(rank, world):
    return {case[0]: _case_errors(rank, world, case) for case in CASES_4}


CASES_3 = [  # an odd group size, and sequences ending on the last token of a slice
    ("gated-packed-3-ranks", "gated", (1, 48, 2, 8, 6), 8, dict(h0=True, cu=[0, 3, 16, 22, 47, 48])),
    ("linear-normalize-decay-rows-3-ranks", "linear", (2, 48, 2, 8, 6), 8, dict(h0=True, g=True, normalize=True)),
]


@pytest.mark.slow
def test_three_ranks_equal_single_process():
    results = run_ranks(_three_rank_run, 3, timeout=400)
    for case in CASES_3:
        worst = _worst(results, case[0])
        print(case[0], {k: f"{v:.1e}" for k, v in worst.items()})
        assert max(worst.values()) < TOL, worst


def _three_rank_run(rank, world):
    return {case[0]: _case_errors(rank, world, case) for case in CASES_3}


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(_four_rank_run, 4, timeout=400)


@pytest.mark.parametrize("name, kind, words", [
    ("chunk_size", "ValueError", ["`chunk_size` differs across", "[8, 6]"]),
    ("lengths", "ValueError", ["`q`", "local length T", "[16, 8]"]),
    ("cu_seqlens", "ValueError", ["`cu_seqlens`", "differs across"]),
    ("not_a_group", "TypeError", ["`cp_group`", "ProcessGroup", "str"]),
    ("beta_on_rank_1", "ValueError", ["`beta`"]),
])
def test_bad_input_raises_on_every_rank(two_ranks, name, kind, words):
    for rank, result in enumerate(two_ranks):
        got = result["refusals"][name]
        print(rank, got)
        assert got is not None, f"rank {rank} did not raise for {name}"
        assert got[0] == kind
        for w in words:
            assert w in got[1], (rank, got[1])
    assert "rank 1" in two_ranks[0]["refusals"]["beta_on_rank_1"][1]  # the other rank names who refused
    assert all(r["refusals"]["after"] for r in two_ranks)


@pytest.mark.parametrize("case", FP32_CASES)
def test_fp32_error_within_the_single_process_error(two_ranks, case):
    """In fp32, the context-parallel op's error against float64 is at most 2x (outputs) or
    3x (gradients) that of the single-process op in fp32."""
    for rank, result in enumerate(two_ranks):
        for name, (single, cp) in result["fp32"][case].items():
            print(rank, case, name, f"single {single:.1e}  cp {cp:.1e}")
            factor = 2.0 if name in ("o", "state") else 3.0
            assert cp <= factor * single + 1e-12, (name, single, cp)


def test_communication_is_the_summary_and_counted(two_ranks):
    for rank, result in enumerate(two_ranks):
        for name, c in result["communication"].items():
            print(rank, name, c)
            assert c["wrapped"] == c["logged"]  # the log sees every all-gather the op makes
            assert c["summaries"] == c["formula"]  # and the forward sends the summary, nothing more
            assert c["grads"] == c["grads_formula"]


@pytest.mark.parametrize("world, cu", [(2, [0, 3, 21, 22, 32]), (4, [0, 5, 16, 60, 61, 64]), (4, [0, 64]), (3, [0, 1, 2, 3, 30])])
def test_local_segments_tile_every_sequence(world, cu):
    """The ranks' pieces tile each packed sequence in order, and the flags say who continues whom."""
    from fastweights.ops.context_parallel import local_segments

    length = cu[-1] // world
    pieces = {i: [] for i in range(len(cu) - 1)}
    segs = [local_segments(cu, 1, length, r, world) for r in range(world)]
    for seg in segs:
        assert seg.offsets[0] == 0 and seg.offsets[-1] == length
        for j, i in enumerate(seg.ids):
            pieces[i].append((seg.start + seg.offsets[j], seg.start + seg.offsets[j + 1]))
        assert seg.continues_in == (cu[seg.ids[0]] < seg.start)
        assert seg.continues_out == (cu[seg.ids[-1] + 1] > seg.start + length)
        assert seg.carries == segs[0].carries  # every rank derives the same flags
        assert seg.carries[seg.rank] == (seg.continues_in and len(seg.ids) == 1)
    for i, spans in pieces.items():
        assert spans[0][0] == cu[i] and spans[-1][1] == cu[i + 1]
        assert all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:]))


def test_summary_bytes_formula():
    from fastweights.ops.context_parallel import kv_gather_bytes, summary_bytes

    assert summary_bytes("gated_delta_rule", 1, 4, 64, 64) == 4 * 64 * 128 * 4
    assert summary_bytes("linear_attn", 2, 4, 64, 65, torch.float64, gated=False) == 2 * 4 * 64 * 65 * 8
    assert kv_gather_bytes(1, 4096, 4, 64, 64) == 4096 * 4 * 128 * 4
    with pytest.raises(ValueError, match="`rule`"):
        summary_bytes("softmax", 1, 1, 1, 1)
