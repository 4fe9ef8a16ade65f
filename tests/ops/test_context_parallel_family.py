"""Context parallelism of GDN-2 and (Gated) DeltaProduct on gloo (CPU): equal to one process in float64.

As tests/ops/test_context_parallel.py does for the delta rules: every rank builds the global
inputs (same seed), runs the single-process chunk op on all of T, then the context-parallel op
on its slice, with the loss ``Σ_r [(o_r·do_r).sum() + w_r·(h_T·dh).sum()]`` (Σ w_r = 1).
Compared: o (the slice), the final state (every rank), the gradients of every per-token input
(the slice) and dh0 (summed over the ranks). Then a hybrid LM of both mixers: a context-parallel
training step equals the single-process one (loss, logits, parameter gradients summed over ranks).
All cases share one 2-process run.
"""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks

TOL = 1e-10

# (name, rule, shape (B, T, H, HV, K, V), chunk, options); T/2 is each rank's local length
CASES = [
    ("gdn2-rows-h0", "gdn2", (2, 32, 2, 2, 8, 6), 8, dict(h0=True)),
    ("gdn2-packed-cross-h0-L17", "gdn2", (1, 34, 2, 2, 8, 6), 8, dict(h0=True, cu=[0, 3, 20, 21, 34])),
    ("gdn2-grouped-heads-packed-cross", "gdn2", (1, 32, 1, 2, 6, 5), 8, dict(h0=False, cu=[0, 10, 32])),
    ("deltaproduct-2-rows-h0-neg", "dp2", (2, 32, 2, 2, 8, 6), 8, dict(h0=True, neg=True)),
    ("deltaproduct-3-packed-cross-h0-L17", "dp3", (1, 34, 2, 2, 6, 7), 8, dict(h0=True, cu=[0, 5, 18, 34])),
]


def _inputs(rule, shape, opts):
    import torch.nn.functional as F

    B, T, H, HV, K, V = shape
    gen = torch.Generator().manual_seed(4321)
    dt = torch.float64
    cu = opts.get("cu")
    n = B if cu is None else len(cu) - 1

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=dt)

    if rule == "gdn2":
        x = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, HV, V),
                 g=0.3 * F.logsigmoid(randn(B, T, HV, K)), b=torch.rand(B, T, HV, K, generator=gen, dtype=dt),
                 w=torch.rand(B, T, HV, V, generator=gen, dtype=dt))
        heads = HV
    else:
        n_h = int(rule[2:])
        x = dict(q=randn(B, T, H, K), k=randn(B, T * n_h, H, K), v=randn(B, T * n_h, H, V),
                 g=0.3 * F.logsigmoid(randn(B, T, H)),
                 beta=(2 if opts.get("neg") else 1) * torch.rand(B, T * n_h, H, generator=gen, dtype=dt))
        heads = H
    x["h0"] = randn(n, heads, K, V) if opts.get("h0") else None
    return x, randn(B, T, heads, V), randn(n, heads, K, V), (None if cu is None else torch.tensor(cu))


def _call(rule, x, cu, chunk, opts, group):
    from fastweights.ops import chunk_gated_delta_product, chunk_gdn2
    from fastweights.ops.context_parallel import gated_delta_product_context_parallel, gdn2_context_parallel

    kw = dict(initial_state=x["h0"], output_final_state=True, cu_seqlens=cu, chunk_size=chunk)
    if rule == "gdn2":
        if group is None:
            return chunk_gdn2(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], qk_norm="l2", **kw)
        return gdn2_context_parallel(chunk_gdn2, x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], qk_norm="l2",
                                     cp_group=group, **kw)
    n_h, neg = int(rule[2:]), bool(opts.get("neg"))
    if group is None:
        return chunk_gated_delta_product(x["q"], x["k"], x["v"], x["g"], x["beta"], n_h, qk_norm="l2",
                                         allow_neg_eigval=neg, **kw)
    return gated_delta_product_context_parallel(chunk_gated_delta_product, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                n_h, qk_norm="l2", allow_neg_eigval=neg, cp_group=group, **kw)


def _case_errors(rank, world, case):
    import torch.distributed as dist

    _, rule, shape, chunk, opts = case
    x, do, dh, cu = _inputs(rule, shape, opts)
    names = [n for n, t in x.items() if t is not None]
    ref_in = {n: (None if t is None else t.clone().requires_grad_()) for n, t in x.items()}
    o, h_t = _call(rule, ref_in, cu, chunk, opts, None)
    ((o * do).sum() + (h_t * dh).sum()).backward()

    length = shape[1] // world
    n_h = 1 if rule == "gdn2" else int(rule[2:])
    weights = torch.linspace(1.0, 2.0, world, dtype=torch.float64)
    weights = weights / weights.sum()

    def part(name):  # the slice of tokens (of sub-steps for DeltaProduct's k, v, beta)
        steps = n_h if name in ("k", "v", "beta") else 1
        return slice(rank * length * steps, (rank + 1) * length * steps)

    loc_in = {n: (None if t is None else (t if n == "h0" else t[:, part(n)]).clone().requires_grad_())
              for n, t in x.items()}
    o_cp, h_cp = _call(rule, loc_in, cu, chunk, opts, dist.group.WORLD)
    tokens = slice(rank * length, (rank + 1) * length)
    ((o_cp * do[:, tokens]).sum() + weights[rank] * (h_cp * dh).sum()).backward()

    def rel(got, want):
        return float((got.detach() - want).abs().max() / want.abs().max())

    errors = {"o": rel(o_cp, o.detach()[:, tokens]), "state": rel(h_cp, h_t.detach())}
    for n in names:
        if n == "h0":
            total = loc_in[n].grad.clone() if loc_in[n].grad is not None else torch.zeros_like(x[n])
            dist.all_reduce(total)
            errors["dh0"] = rel(total, ref_in[n].grad)
        else:
            errors["d" + n] = rel(loc_in[n].grad, ref_in[n].grad[:, part(n)])
    return errors


def _lm_step(rank, world):
    """A context-parallel training step of a GDN-2 + DeltaProduct LM against the single-process one."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from fastweights.models import LM, LMConfig

    torch.manual_seed(0)
    config = LMConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, mixer=["gdn2", "deltaproduct"], chunk_size=8,
                      allow_neg_eigval=True)
    model = LM(config).double()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (1, 33), generator=gen)
    inputs, targets, cu = ids[:, :-1], ids[:, 1:], torch.tensor([0, 5, 21, 32])
    logits, _ = model(inputs, cu_seqlens=cu, return_cache=False)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    part = slice(rank * 16, (rank + 1) * 16)
    logits_cp, _ = model(inputs[:, part], cu_seqlens=cu, return_cache=False, cp_group=dist.group.WORLD)
    loss_cp = F.cross_entropy(logits_cp.flatten(0, 1), targets[:, part].flatten(), reduction="sum")
    loss_cp.backward()
    total = loss_cp.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        worst = max(worst, float((g - ref[n]).abs().max() / ref[n].abs().max()))
    return dict(loss=float((total - loss.detach()).abs() / loss.detach().abs()),
                logits=float((logits_cp.detach() - logits.detach()[:, part]).abs().max() / logits.detach().abs().max()),
                grads=worst)


def _refusal(rank, world):
    """A bad gate on one rank only: every rank raises (no rank waits in a collective)."""
    import torch.distributed as dist

    x, _, _, _ = _inputs("gdn2", (1, 16, 2, 2, 4, 4), {})
    if rank == 1:
        x["b"] = x["b"] + 3.0  # outside [0, 2]
    try:
        _call("gdn2", {n: (t if t is None else t[:, rank * 8:(rank + 1) * 8]) for n, t in x.items()}, None, 4, {},
              dist.group.WORLD)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _run(rank, world):
    return dict(cases={c[0]: _case_errors(rank, world, c) for c in CASES}, lm=_lm_step(rank, world),
                refusal=_refusal(rank, world))


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_run, 2, timeout=300)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_two_ranks_equal_single_process(two_ranks, case):
    worst = {}
    for r in two_ranks:
        for name, e in r["cases"][case].items():
            worst[name] = max(worst.get(name, 0.0), e)
    print(case, {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) < TOL, worst


def test_lm_step_equals_single_process(two_ranks):
    for r in two_ranks:
        print({k: f"{v:.1e}" for k, v in r["lm"].items()})
        assert max(r["lm"].values()) < TOL, r["lm"]


def test_bad_gate_on_one_rank_raises_on_every_rank(two_ranks):
    for rank, r in enumerate(two_ranks):
        print(rank, r["refusal"])
    assert "`b` must lie in [0, 2]" in two_ranks[1]["refusal"]
    assert "rank 1 of `cp_group` refused its arguments" in two_ranks[0]["refusal"]
