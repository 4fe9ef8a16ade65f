"""The retrieval study (Schlag et al. 2021 settings 1 and 2) on small runs."""

import json

import pytest
import torch

from fastweights.studies.retrieval import (
    ARMS,
    FastWeightRetriever,
    RetrievalConfig,
    MemoryTrainConfig,
    make_feature_map,
    run_retrieval,
    sum_rule_floor,
    train_memory,
)
from fastweights.tasks.retrieval import RetrievalTask


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def test_setting_1_writes_each_key_once():
    task = RetrievalTask(1, 10, num_queries=4)
    batch = task.sample(5, torch.Generator().manual_seed(0))
    assert torch.equal(batch.keys.sort(dim=1).values, torch.arange(10).expand(5, 10))
    for b in range(5):
        for q, target in zip(batch.queries[b].tolist(), batch.targets[b].tolist()):
            assert batch.values[b, batch.keys[b].tolist().index(q)] == target
    again = task.sample(5, torch.Generator().manual_seed(0))
    assert all(torch.equal(x, y) for x, y in zip(batch, again))


def test_setting_2_asks_for_the_latest_value():
    task = RetrievalTask(2, 5, num_pairs=12, num_queries=3)
    batch = task.sample(20, torch.Generator().manual_seed(1))
    overwritten = 0
    for b in range(20):
        keys, values = batch.keys[b].tolist(), batch.values[b].tolist()
        assert len(set(batch.queries[b].tolist())) == 3
        for q, target in zip(batch.queries[b].tolist(), batch.targets[b].tolist()):
            last = max(t for t, k in enumerate(keys) if k == q)
            assert values[last] == target
            overwritten += keys.count(q) > 1
    assert overwritten > 30  # most asked keys were written more than once


@pytest.mark.parametrize("bad, match", [
    (dict(setting=3), "setting"),
    (dict(setting=1, num_keys=5, num_pairs=7), "num_pairs"),
    (dict(setting=1, num_keys=5, num_queries=6), "num_queries"),
    (dict(num_keys=0), "num_keys"),
])
def test_task_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        RetrievalTask(**bad)


def test_setting_1_values_are_drawn_without_replacement():
    batch = RetrievalTask(1, 12, num_queries=3).sample(8, torch.Generator().manual_seed(5))
    assert all(len(set(row)) == 12 for row in batch.values.tolist())
    with pytest.raises(ValueError, match="num_values"):
        RetrievalTask(1, 12, num_values=6)


@pytest.mark.parametrize("projections", ["tied", "paper"])
@pytest.mark.parametrize("rule, fmap", [("sum", "linear"), ("sum", "dpfp2"), ("sum", "favor"), ("delta", "dpfp1"),
                                        ("softmax", None)])
def test_reads_match_the_written_memory(rule, fmap, projections):
    """The model's read equals the formula of the module docstring, computed here in float64 by a loop."""
    torch.manual_seed(0)
    model = FastWeightRetriever(6, d_key=4, rule=rule, feature_map=fmap, projections=projections).double()
    batch = RetrievalTask(1, 6, num_queries=6).sample(2, torch.Generator().manual_seed(2))
    if fmap == "favor":  # forward redraws; compare against the draw it used
        state = model.phi._generator.get_state()
    y_hat = model(batch.keys, batch.values, batch.queries)
    if fmap == "favor":
        model.phi._generator.set_state(state)
        model.phi.redraw()
    with torch.no_grad():
        v = torch.nn.functional.one_hot(batch.values, 6).double()
        if projections == "tied":  # one matrix, no bias, for the write and the read
            x = model.key_embed(batch.keys)
            k, q = x @ model.k_proj.weight.T, model.key_embed(batch.queries) @ model.k_proj.weight.T
        else:  # the paper's: the key from [onehot(v); e] with a bias, the query by its own W_q
            x = torch.cat([v, model.key_embed(batch.keys)], -1)
            k = x @ model.k_proj.weight.T + model.k_proj.bias
            q = model.key_embed(batch.queries) @ model.q_proj.weight.T + model.q_proj.bias
        for b in range(2):
            if rule == "softmax":
                want = torch.softmax(q[b] @ k[b].T / 2.0, dim=-1) @ v[b]
            elif rule == "sum":
                pk, pq = model.phi(k[b]), model.phi(q[b])
                want = (pq @ pk.T @ v[b]) / (pq @ pk.sum(0) + 1e-6)[:, None]  # the read's eps
            else:
                pk = model.phi(k[b])
                pk = pk / pk.sum(-1, keepdim=True)
                pq = model.phi(q[b])
                pq = pq / pq.sum(-1, keepdim=True)
                beta = torch.sigmoid(model.beta_proj(x[b]))[:, 0]
                w = torch.zeros(6, pk.shape[1], dtype=torch.float64)
                for t in range(6):
                    w = w + beta[t] * torch.outer(v[b, t] - w @ pk[t], pk[t])
                want = pq @ w.T
            err = (y_hat[b] - want).abs().max().item()
            print(f"{rule}/{fmap} batch {b}: max |read - reference| = {err:.2e}")
            assert err < 1e-8


def test_favor_redraws_every_forward():
    torch.manual_seed(0)
    model = FastWeightRetriever(6, d_key=4, rule="sum", feature_map="favor")
    batch = RetrievalTask(1, 6, num_queries=6).sample(2, torch.Generator().manual_seed(2))
    assert not torch.equal(model(batch.keys, batch.values, batch.queries), model(batch.keys, batch.values, batch.queries))


def test_evaluation_averages_fresh_favor_draws(monkeypatch):
    """The paper evaluates over 20 sequences, one forward each at least, and FAVOR+ draws ω at every forward;
    ours splits the evaluation batch into `eval_forwards` forwards, so FAVOR+'s evaluation loss averages
    20 draws instead of trusting one. Counted: one draw at construction, one per training step, 20 per
    evaluation (two evaluations: before training and after the one step)."""
    from fastweights.ops import FavorPlus

    draws = []
    original = FavorPlus.redraw
    monkeypatch.setattr(FavorPlus, "redraw", lambda self: (draws.append(1), original(self))[1])
    train_memory(RetrievalTask(1, 6, num_queries=6), "sum", "favor", MemoryTrainConfig(d_key=4, max_steps=1, eval_every=1,
                                                                                 eval_batch=40), seed=0)
    print("FAVOR+ draws in one step with two evaluations:", len(draws))
    assert len(draws) == 1 + 1 + 2 * 20


def test_favor_features_estimate_the_unscaled_kernel():
    """The paper's FAVOR+ feeds the key itself to exp(ωᵀk − |k|²/2): E[φ(q)·φ(k)] = exp(qᵀk), with no
    1/√d_key inside (ours once scaled the input by d_key^(-1/4) instead)."""
    phi = make_feature_map("favor8", 4, seed=3)
    q = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)
    k = torch.tensor([0.4, 0.1, 0.6, -0.3], dtype=torch.float64)
    estimates = []
    for _ in range(400):
        phi.redraw()
        estimates.append(float(phi(q) @ phi(k)))
    mean = sum(estimates) / len(estimates)
    want, scaled = float(torch.exp(q @ k)), float(torch.exp(q @ k / 2))
    print(f"mean φ(q)·φ(k) over 400 draws {mean:.4f}; exp(qᵀk) {want:.4f}; exp(qᵀk/√d) {scaled:.4f}")
    assert abs(mean - want) < 0.02 and abs(mean - scaled) > 0.1


def test_sum_rule_cannot_see_write_order_but_delta_rule_can():
    """Why setting 2 separates the rules: the sum-rule state is a sum, invariant to the order of writes."""
    task = RetrievalTask(2, 4, num_pairs=8, num_queries=2)
    batch = task.sample(6, torch.Generator().manual_seed(3))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(4))
    outs = {}
    for rule in ("sum", "delta"):
        torch.manual_seed(0)
        model = FastWeightRetriever(4, d_key=8, rule=rule, feature_map="dpfp1")
        a = model(batch.keys, batch.values, batch.queries)
        b = model(batch.keys[:, perm], batch.values[:, perm], batch.queries)
        outs[rule] = (a - b).abs().max().item()
    print("largest change of a read when the writes are reordered:", outs)
    assert outs["sum"] < 1e-5 and outs["delta"] > 1e-3


def test_delta_rule_solves_setting_2_where_the_sum_rule_does_not():
    """Setting 2 at 8 keys, 16 writes, DPFP-1 (d_dot = 16): the delta rule is clean, the sum rule is not.
    Tied projections (the quick default). With a separate W_q, as in the paper's code (which trains up to
    100k steps at lr 1e-3), DPFP's sparse φ(W_q e) and φ(W_k e) start with little overlap, and in a
    600-step budget the read found too little to learn from (0.26 nats with the earlier settings)."""
    task = RetrievalTask(2, 8, num_pairs=16, num_queries=4)
    train = MemoryTrainConfig(d_key=8, max_steps=600, eval_every=50)
    results = {rule: train_memory(task, rule, "dpfp1", train, seed=0) for rule in ("sum", "delta")}
    for rule, r in results.items():
        print(f"{rule}: loss {r['loss']:.4f}, accuracy {r['accuracy']:.3f}, {r['steps']} steps, {r['seconds']:.1f} s")
    assert results["delta"]["clean"] and results["delta"]["accuracy"] == 1.0
    assert not results["sum"]["clean"] and results["sum"]["loss"] > 0.05


def test_dpfp_buys_capacity():
    """At S = 16 keys with d_key = 4: DPFP-2 (d_dot = 16) gets far lower than the linear map (d_dot = 4)."""
    task = RetrievalTask(1, 16, num_queries=16)
    train = MemoryTrainConfig(d_key=4, max_steps=400)
    dpfp = train_memory(task, "sum", "dpfp2", train, seed=0)
    linear = train_memory(task, "sum", "linear", train, seed=0)
    print(f"dpfp2: loss {dpfp['loss']:.4f} in {dpfp['steps']} steps; linear: loss {linear['loss']:.4f}")
    assert linear["loss"] > 3 * dpfp["loss"] and not linear["clean"]


def test_sum_rule_floor():
    """One write per key: the mean is the latest value (floor 0); keys written twice over two values: 0.25 each."""
    assert sum_rule_floor(RetrievalTask(2, 4, num_pairs=1, num_queries=1), samples=200) == 0.0
    floor = sum_rule_floor(RetrievalTask(2, 20, num_pairs=40, num_queries=4), samples=4000)
    print("setting-2 floor of the sum rule at 20 keys, 40 writes:", floor)
    assert 0.15 < floor < 0.25


def test_training_is_deterministic():
    task = RetrievalTask(1, 6, num_queries=6)
    train = MemoryTrainConfig(d_key=8, max_steps=20, eval_every=10)
    for rule, fmap in (("delta", "dpfp1"), ("sum", "favor")):
        a = train_memory(task, rule, fmap, train, seed=5)
        b = train_memory(task, rule, fmap, train, seed=5)
        assert a["history"] == b["history"]


def test_feature_map_widths():
    assert [make_feature_map(m, 64).output_dim(64) for m in ("linear", "dpfp1", "dpfp2", "dpfp3", "favor", "favor2",
                                                             "favor8")] == [64, 128, 256, 384, 128, 256, 1024]
    with pytest.raises(ValueError, match="feature_map"):
        make_feature_map("cosine", 8)
    with pytest.raises(ValueError, match="rule"):
        FastWeightRetriever(4, rule="oja")
    with pytest.raises(ValueError, match="projections"):
        FastWeightRetriever(4, projections="shared")
    with pytest.raises(ValueError, match="projections"):
        MemoryTrainConfig(projections="shared")
    assert RetrievalConfig.full().train.projections == "paper" and MemoryTrainConfig().projections == "tied"


def test_study_files_and_json_contract(tmp_path):
    config = RetrievalConfig(arms=ARMS, sizes=(2, 64), seeds=2, setting2_keys=4, setting2_pairs=6,
                             setting2_queries=2, setting2_d_key=4, setting2_max_steps=20,
                             train=MemoryTrainConfig(d_key=4, max_steps=20, eval_every=10, eval_batch=16))
    torch.set_num_threads(2)
    try:
        result = run_retrieval(config, out_dir=tmp_path, progress=False)  # trains on config.threads = 1
        assert torch.get_num_threads() == 2  # ... and gives the caller's setting back
    finally:
        torch.set_num_threads(1)
    saved = json.loads((tmp_path / "retrieval.json").read_text())
    s1, s2 = saved["headline"]["setting1"], saved["headline"]["setting2"]
    assert set(s1) == {"linear", "dpfp1", "dpfp2", "dpfp3", "favor", "favor2", "favor8", "softmax"}
    assert set(s2) == {"delta", "sum"}
    for h in s1.values():
        assert {"s_star", "s_star_se", "d_dot", "s_star_over_d_dot", "clean"} <= set(h)
        assert 0 <= h["s_star"] <= 2  # S = 64 is far past every memory at d_key = 4 and 20 steps
        assert h["clean"] == (h["s_star"] > 0)
    assert s1["dpfp1"]["d_dot"] == 8 and s1["softmax"]["d_dot"] is None
    assert {"loss", "loss_se"} <= set(s2["delta"])
    assert saved["published"]["setting1"]["linear"] == {"d_dot": 64, "clean_to": 40, "fails_at": 60}
    assert (tmp_path / "retrieval.csv").exists()
    for name in ("retrieval_loss_vs_S.png", "retrieval_setting2.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert result["runtime_s"] > 0


@pytest.mark.parametrize("bad, match", [
    (dict(arms=("cosine",)), "arms"),
    (dict(setting2_rules=("oja",)), "setting2_rules"),
    (dict(sizes=(16, 8)), "sizes"),
    (dict(seeds=0), "seeds"),
    (dict(setting2_keys=4, setting2_pairs=2, setting2_queries=3), "num_queries"),
])
def test_bad_config_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        RetrievalConfig(**bad)


@pytest.mark.slow
def test_quick_default_meets_the_acceptance_lines():
    """The capacity claim on the quick default (about 1 CPU minute alone): S* <= d_dot for every φ; FAVOR+ never
    clean; linear < DPFP-1 < DPFP-2 < DPFP-3 < softmax in mean S*; setting 2: delta clean, sum not."""
    result = run_retrieval(progress=False, plots=False)
    s1, s2 = result["headline"]["setting1"], result["headline"]["setting2"]
    for arm, h in s1.items():
        print(arm, h["s_star"], h["s_star_se"], h["d_dot"])
        if h["d_dot"] is not None:
            assert max(h["s_star_per_seed"]) <= h["d_dot"]
    order = [s1[a]["s_star"] for a in ("linear", "dpfp1", "dpfp2", "dpfp3", "softmax")]
    assert order == sorted(order) and len(set(order)) == len(order)
    assert s2["delta"]["clean"] and not s2["sum"]["clean"]


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["favor", "favor2"])
def test_quick_default_favor_is_never_clean(arm):
    """FAVOR+ with m = d_key and 2·d_key features (the paper's 64 and 128 at d_key = 64), evaluated over 20
    forwards with fresh features each (about 10 s each). Before the evaluation averaged over draws, one lucky
    draw made m = d_key clean at S = 4 on 1 of 3 seeds (2 of 3 at 1 draw in a later check)."""
    result = run_retrieval(RetrievalConfig(arms=(arm,), setting2_rules=()), progress=False, plots=False)
    print(result["headline"]["setting1"][arm])
    assert not result["headline"]["setting1"][arm]["clean"]


@pytest.mark.slow
@pytest.mark.xfail(reason="measured: FAVOR+ with m = 8·d_key = 64 features was clean at S = 4 (S/m = 1/16) on 1 of 3 "
                          "seeds (loss 0.00071, averaged over 20 draws); the paper's smallest size with 512 features "
                          "is S = 20 (S/m = 1/26) at d_key = 64, and it was not clean there", strict=False)
def test_quick_default_favor8_is_never_clean():
    result = run_retrieval(RetrievalConfig(arms=("favor8",), setting2_rules=()), progress=False, plots=False)
    print(result["headline"]["setting1"]["favor8"])
    assert not result["headline"]["setting1"]["favor8"]["clean"]


def test_cli_projections_flag():
    from fastweights.cli import build_parser
    from fastweights.studies.retrieval import config_from_args

    parse = lambda *a: config_from_args(build_parser().parse_args(["study", "retrieval", *a]))
    assert parse().train.projections == "tied" and parse("--full").train.projections == "paper"
    assert parse("--projections", "paper").train.projections == "paper"
    assert parse("--full", "--projections", "tied").train.projections == "tied"
