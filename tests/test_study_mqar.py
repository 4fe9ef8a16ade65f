"""MQAR (Arora et al. 2023): the generator's contract, and the study on small runs."""

import json

import pytest
import torch

from fastweights.studies.mqar import MIXERS, MQARConfig, learning_rate, run_mqar, train_mqar_model
from fastweights.tasks.mqar import MQAR
from fastweights.tasks.recall import IGNORE


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def test_every_key_is_asked_once_and_answered_by_its_value():
    task = MQAR(vocab_size=64, seq_len=48, num_kv_pairs=6)
    batch = task.sample(16, torch.Generator().manual_seed(0))
    assert batch.inputs.shape == batch.targets.shape == (16, 48)
    half = 32
    for b in range(16):
        x, y = batch.inputs[b].tolist(), batch.targets[b].tolist()
        context = dict(zip(x[0:12:2], x[1:12:2]))
        assert len(context) == 6                                    # distinct keys
        assert all(1 <= k < half for k in context) and all(half <= v < 64 for v in context.values())
        asked = [t for t in range(12, 48) if y[t] != IGNORE]
        assert sorted(x[t] for t in asked) == sorted(context)      # every key asked once, after the context
        assert all(y[t] == context[x[t]] for t in asked)           # ... answered by its value
        assert all(y[t] == IGNORE for t in range(12))
        for t in asked:                                              # the value follows the asked key
            assert t + 1 == 48 or x[t + 1] == y[t]
        assert all(x[t] == 0 for t in range(12, 48) if t not in asked and (t - 1) not in asked)
    again = task.sample(16, torch.Generator().manual_seed(0))
    assert torch.equal(batch.inputs, again.inputs) and torch.equal(batch.targets, again.targets)


def test_query_gaps_follow_a_power_law():
    """α = 0.01 puts most queries right after the context; α = 1 spreads them uniformly."""
    near = {}
    for a in (0.01, 1.0):
        task = MQAR(vocab_size=512, seq_len=256, num_kv_pairs=8, power_a=a)
        slots = task.sample(400, torch.Generator().manual_seed(1)).slots
        near[a] = (slots <= task.num_slots // 8).float().mean().item()
        p = task.gap_probabilities()
        assert torch.isclose(p.sum(), torch.tensor(1.0, dtype=torch.float64))
        assert bool((p[1:] <= p[:-1]).all())
    print("fraction of queries in the nearest eighth of the slots:", near)
    assert near[0.01] > 0.4 and near[1.0] < 0.2


@pytest.mark.parametrize("bad, match", [
    (dict(seq_len=15, num_kv_pairs=4), "seq_len"),
    (dict(vocab_size=8, num_kv_pairs=4), "vocab_size"),
    (dict(power_a=0.0), "power_a"),
    (dict(num_kv_pairs=0), "num_kv_pairs"),
])
def test_bad_task_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        MQAR(**{**dict(vocab_size=64, seq_len=32, num_kv_pairs=4), **bad})


def test_learning_rate_schedule():
    assert learning_rate(0, 100, 1.0) == pytest.approx(0.1)
    assert learning_rate(9, 100, 1.0) == pytest.approx(1.0)
    assert learning_rate(99, 100, 1.0) == pytest.approx(0.1, abs=1e-3)


@pytest.mark.parametrize("mixer", MIXERS)
def test_every_mixer_trains(mixer):
    config = MQARConfig(steps=3, batch_size=4, eval_batch=8, d_models=(16,), vocab_size=32, seq_len=16)
    task = MQAR(32, 16, 4)
    r = train_mqar_model(mixer, 16, task, config, seed=0)
    assert 0.0 <= r["accuracy"] <= 1.0 and r["steps"] == 3 and len(r["train_loss"]) == 3
    again = train_mqar_model(mixer, 16, task, config, seed=0)
    assert again["train_loss"] == r["train_loss"]  # deterministic from the seed


def test_study_files(tmp_path):
    config = MQARConfig(mixers=("deltanet", "softmax"), steps=2, batch_size=4, eval_batch=8, d_models=(16,),
                        vocab_size=32, seq_len=16)
    result = run_mqar(config, out_dir=tmp_path, progress=False)
    saved = json.loads((tmp_path / "mqar.json").read_text())
    assert [r["mixer"] for r in saved["table"]] == ["deltanet", "softmax"]
    assert (tmp_path / "mqar.png").stat().st_size > 1000 and (tmp_path / "mqar.csv").exists()
    assert result["runtime_s"] > 0


@pytest.mark.parametrize("bad, match", [
    (dict(mixers=("mamba",)), "mixers"),
    (dict(d_models=(30,), n_heads=4), "d_models"),
    (dict(num_kv_pairs=(16,), seq_len=32), "seq_len"),
])
def test_bad_config_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        MQARConfig(**bad)


@pytest.mark.slow
def test_quick_default_models_learn_far_above_chance():
    """The quick default cell (a few CPU minutes): every model ends far above chance (1/32), one solves it."""
    result = run_mqar(MQARConfig(), progress=False)
    for r in result["table"]:
        print(r["mixer"], r["accuracy"])
        assert r["accuracy"] > 0.25
    assert max(r["accuracy"] for r in result["table"]) > 0.9
