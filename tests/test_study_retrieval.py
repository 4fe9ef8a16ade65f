"""The retrieval study (seed 001; Schlag et al. 2021 settings 1 and 2) on small runs."""

import json

import pytest
import torch

from fastweights.studies.retrieval import (
    FastWeightRetriever,
    RetrievalConfig,
    TrainConfig,
    make_feature_map,
    run_retrieval,
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


@pytest.mark.parametrize("rule", ["sum", "delta"])
@pytest.mark.parametrize("fmap", ["linear", "dpfp2", "favor"])
def test_reads_write_nothing(rule, fmap):
    """Asking more keys never changes the answer to the first: the read tokens are no-ops."""
    torch.manual_seed(0)
    model = FastWeightRetriever(12, 12, d_key=8, d_value=16, rule=rule, feature_map=fmap)
    batch = RetrievalTask(1, 12, num_queries=12).sample(3, torch.Generator().manual_seed(2))
    one = model(batch.keys, batch.values, batch.queries[:, :1])
    many = model(batch.keys, batch.values, batch.queries)
    assert many.shape == (3, 12, 12)
    torch.testing.assert_close(many[:, :1], one, rtol=1e-5, atol=1e-6)


def test_sum_rule_cannot_see_write_order_but_delta_rule_can():
    """Why setting 2 separates the rules: the sum-rule state is a sum, invariant to the order of writes."""
    task = RetrievalTask(2, 4, num_pairs=8, num_queries=2)
    batch = task.sample(6, torch.Generator().manual_seed(3))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(4))
    outs = {}
    for rule in ("sum", "delta"):
        torch.manual_seed(0)
        model = FastWeightRetriever(4, 4, d_key=8, d_value=16, rule=rule, feature_map="dpfp1")
        a = model(batch.keys, batch.values, batch.queries)
        b = model(batch.keys[:, perm], batch.values[:, perm], batch.queries)
        outs[rule] = (a - b).abs().max().item()
    print("largest change of a read when the writes are reordered:", outs)
    assert outs["sum"] < 1e-5 and outs["delta"] > 1e-3


def test_delta_rule_solves_setting_2_where_the_sum_rule_does_not():
    task = RetrievalTask(2, 6, num_pairs=12, num_queries=4)
    train = TrainConfig(d_key=8, max_steps=600, eval_every=50, loss_threshold=0.05)
    results = {rule: train_memory(task, rule, "dpfp2", train, seed=0) for rule in ("sum", "delta")}
    for rule, r in results.items():
        print(f"{rule}: loss {r['loss']:.3f}, accuracy {r['accuracy']:.3f}, {r['steps']} steps, {r['seconds']:.1f} s")
    assert results["delta"]["reached"] and results["delta"]["accuracy"] > 0.95
    assert not results["sum"]["reached"] and results["sum"]["accuracy"] < 0.9


def test_dpfp_buys_capacity():
    """At S = 16 keys with d_key = 8: DPFP-2 (d_dot = 32) reaches the threshold, the linear map (d_dot = 8) does not."""
    task = RetrievalTask(1, 16, num_queries=16)
    train = TrainConfig(d_key=8, max_steps=400, loss_threshold=0.05)
    dpfp = train_memory(task, "sum", "dpfp2", train, seed=0)
    linear = train_memory(task, "sum", "linear", train, seed=0)
    print(f"dpfp2: loss {dpfp['loss']:.3f} in {dpfp['steps']} steps; linear: loss {linear['loss']:.3f}")
    assert dpfp["reached"] and not linear["reached"] and linear["loss"] > 3 * dpfp["loss"]


def test_training_is_deterministic():
    task = RetrievalTask(1, 6, num_queries=6)
    train = TrainConfig(d_key=8, max_steps=20, eval_every=10)
    a = train_memory(task, "delta", "dpfp1", train, seed=5)
    b = train_memory(task, "delta", "dpfp1", train, seed=5)
    assert a["history"] == b["history"]


def test_feature_map_widths():
    assert [make_feature_map(m, 64).output_dim(64) for m in ("linear", "dpfp1", "dpfp2", "dpfp3", "favor")] == \
        [64, 128, 256, 384, 128]
    with pytest.raises(ValueError, match="feature_map"):
        make_feature_map("cosine", 8)
    with pytest.raises(ValueError, match="rule"):
        FastWeightRetriever(4, 4, rule="oja")


def test_study_files(tmp_path):
    config = RetrievalConfig(memories=(("sum", "dpfp1"),), sizes=(4, 64), setting2_rules=("delta",),
                             setting2_keys=4, setting2_pairs=6, setting2_queries=2,
                             train=TrainConfig(d_key=4, max_steps=30, eval_every=10, eval_batch=32))
    torch.set_num_threads(2)
    try:
        result = run_retrieval(config, out_dir=tmp_path, progress=False)  # trains on config.threads = 1
        assert torch.get_num_threads() == 2  # ... and gives the caller's setting back
    finally:
        torch.set_num_threads(1)
    saved = json.loads((tmp_path / "retrieval.json").read_text())
    th = saved["thresholds"]["sum/dpfp1"]
    assert th["d_dot"] == 8 and th["published_S_at_d_key_64"] == 128
    assert [r["S"] for r in saved["table"] if r["setting"] == 1][0] == 4
    assert (tmp_path / "retrieval.csv").exists()
    for name in ("retrieval_loss_vs_S.png", "retrieval_setting2.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert result["runtime_s"] > 0


@pytest.mark.parametrize("bad, match", [
    (dict(memories=(("sum", "cosine"),)), "memories"),
    (dict(memories=(("oja", "linear"),)), "memories"),
    (dict(sizes=(16, 8)), "sizes"),
    (dict(setting2_keys=4, setting2_pairs=2, setting2_queries=3), "num_queries"),
])
def test_bad_config_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        RetrievalConfig(**bad)
