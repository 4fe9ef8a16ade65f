"""A context-parallel LM training step equals the single-process step (gloo, CPU, float64).

The model is a hybrid (DeltaNet, softmax attention with RoPE and a short convolution,
Gated DeltaNet, linear attention), so every context-parallel piece is on the path:
the ops' state summaries, the convolutions' halos, the softmax layer's all-gathered
keys and values and its global RoPE positions. Each rank's loss is the summed
cross-entropy of its slice; summed over the ranks (loss and parameter gradients) it
must equal the single-process step.
"""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks

MIXERS = ["deltanet", "softmax", "gated_deltanet", "linear"]
TOL = 1e-10


def _step(rank, world, batch, length, cu, checkpointing):
    import torch.distributed as dist
    import torch.nn.functional as F

    from fastweights.models import LM, LMConfig

    torch.manual_seed(0)
    config = LMConfig(vocab_size=40, d_model=16, n_layers=len(MIXERS), n_heads=2, mixer=MIXERS, softmax_short_conv=True,
                      chunk_size=8, max_seq_len=256)
    model = LM(config).double()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (batch, length + 1), generator=gen)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    cu_t = None if cu is None else torch.tensor(cu)

    logits, _ = model(inputs, cu_seqlens=cu_t, return_cache=False)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    model.gradient_checkpointing = checkpointing
    model.train()
    part = slice(rank * (length // world), (rank + 1) * (length // world))
    logits_cp, _ = model(inputs[:, part], cu_seqlens=cu_t, return_cache=False, cp_group=dist.group.WORLD)
    loss_cp = F.cross_entropy(logits_cp.flatten(0, 1), targets[:, part].flatten(), reduction="sum")
    loss_cp.backward()
    total = loss_cp.detach().clone()
    dist.all_reduce(total)
    worst_grad = 0.0
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        worst_grad = max(worst_grad, float((g - ref[n]).abs().max() / ref[n].abs().max()))
    return dict(
        loss=float((total - loss.detach()).abs() / loss.detach().abs()),
        logits=float((logits_cp.detach() - logits.detach()[:, part]).abs().max() / logits.detach().abs().max()),
        grads=worst_grad,
    )


def _refusals(rank, world):
    import torch.distributed as dist

    from fastweights.models import LM, LMConfig

    model = LM(LMConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=2, mixer="deltanet", chunk_size=4))
    out = {}
    for name, kwargs, ids in (
        ("return_cache", dict(return_cache=True), torch.zeros(1, 8, dtype=torch.long)),
        ("lengths", dict(return_cache=False), torch.zeros(1, 8 if rank == 0 else 4, dtype=torch.long)),
        ("cu_seqlens", dict(return_cache=False, cu_seqlens=torch.tensor([0, 3 + rank, 16])), torch.zeros(1, 8, dtype=torch.long)),
    ):
        try:
            model(ids, cp_group=dist.group.WORLD, **kwargs)
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = str(e)
    return out


#: Local lengths L that are no multiple of the chunk size (8) -- L = 1 also shorter than the short
#: convolution's W - 1 = 3, so its halo comes from more than one rank back -- as (B, global T, cu_seqlens).
ANY_LENGTH = {"L1": (2, 2, None), "L17": (1, 34, [0, 5, 20, 34]), "L20": (2, 40, None), "L33": (1, 66, [0, 40, 41, 66])}


def _default_run(rank, world):
    return dict(
        packed=_step(rank, world, 1, 32, [0, 11, 25, 32], False),
        rows=_step(rank, world, 2, 32, None, True),
        refusals=_refusals(rank, world),
        **{name: _step(rank, world, b, t, cu, False) for name, (b, t, cu) in ANY_LENGTH.items()},
    )


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_default_run, 2, timeout=240)


@pytest.mark.parametrize("case", ["packed", "rows", *ANY_LENGTH])
def test_lm_step_two_ranks_equals_single_process(two_ranks, case):
    worst = {k: max(r[case][k] for r in two_ranks) for k in ("loss", "logits", "grads")}
    print(case, {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) < TOL, worst


@pytest.mark.parametrize("name, word", [("return_cache", "`return_cache`"), ("lengths", "`input_ids`"),
                                        ("cu_seqlens", "`cu_seqlens`")])
def test_lm_refuses_on_every_rank(two_ranks, name, word):
    for result in two_ranks:
        print(result["refusals"][name])
        assert result["refusals"][name] is not None and word in result["refusals"][name]


def _four_rank_run(rank, world):
    return dict(packed=_step(rank, world, 1, 64, [0, 5, 40, 41, 64], False), rows=_step(rank, world, 2, 64, None, False),
                L1=_step(rank, world, 2, 4, None, False), L2=_step(rank, world, 1, 8, [0, 3, 8], False))  # halos over 2-3 ranks


@pytest.mark.slow
def test_lm_step_four_ranks_equals_single_process():
    results = run_ranks(_four_rank_run, 4, timeout=400)
    for case in ("packed", "rows", "L1", "L2"):
        worst = {k: max(r[case][k] for r in results) for k in ("loss", "logits", "grads")}
        print(case, {k: f"{v:.1e}" for k, v in worst.items()})
        assert max(worst.values()) < TOL, worst
