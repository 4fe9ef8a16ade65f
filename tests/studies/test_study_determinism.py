"""The same root seed gives bit-identical tables for every study.

Each study runs twice on a tiny configuration, in one process, and every table
entry that is not a wall-clock measurement must be equal bit for bit (floats
compared with ``==``). The studies draw everything from generators keyed by the
root seed (never from torch's global RNG) and train on a fixed thread count
(``threads=1``); FAVOR+ redraws its features from its own seeded stream.
A different root seed must change the numbers (else the test could not fail).
"""

import pytest

from fastweights.studies.capacity import CapacityConfig, run_capacity
from fastweights.studies.costs import CostsConfig, run_costs
from fastweights.studies.mqar import MQARConfig, run_mqar
from fastweights.studies.retrieval import RetrievalConfig, MemoryTrainConfig, run_retrieval
from fastweights.studies.state_tracking import StateTrackingConfig, run_state_tracking

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

TIMING = ("seconds", "_us", "_ms", "runtime", "time", "step_vs")  # wall-clock columns and their ratios


def _numbers(rows):
    """The table without wall-clock columns (timings can never repeat)."""
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def _retrieval(seed):
    config = RetrievalConfig(root_seed=seed, seeds=2, sizes=(4, 8), arms=("dpfp1", "favor", "softmax"),
                             setting2_keys=6, setting2_pairs=12, setting2_queries=2, setting2_d_key=8,
                             setting2_max_steps=40, train=MemoryTrainConfig(d_key=4, max_steps=40, eval_every=20, eval_batch=16))
    return run_retrieval(config, progress=False, plots=False)["table"]


def _mqar(seed):
    config = MQARConfig(root_seed=seed, max_steps=4, batch_size=4, eval_every=2, val_size=8, test_size=8,
                        d_models=(16,), vocab_size=32, cells=((16, 4),), lrs=(1e-3, 1e-2), seeds=2,
                        short_conv=(False, True), workers=1)  # workers=2 equals 1: test_study_mqar.py
    return run_mqar(config, progress=False, plots=False)["table"]


def _capacity(seed):
    config = CapacityConfig(root_seed=seed, repetitions=4, dims=(8,), sweep_widths=(), loads=(0.5, 8))
    return run_capacity(config, progress=False, plots=False)["table"]


def _costs(seed):
    config = CostsConfig(root_seed=seed, contexts=(32,), repeats=1, calc_contexts=(1024,))
    return run_costs(config, progress=False, plots=False)["table"]


def _state_tracking(seed):
    config = StateTrackingConfig(root_seed=seed, tasks=("parity", "S3"), arms=("deltanet[0,2]", "linear"), train_max_length=8,
                                 test_lengths=(8, 16), d_model=16, seeds=2, max_steps=6, warmup_steps=2, batch_size=4,
                                 test_size=16, workers=1)
    return run_state_tracking(config, progress=False, plots=False)["results"]


@pytest.mark.parametrize("study", [_retrieval, _mqar, _capacity, _costs, _state_tracking],
                         ids=["retrieval", "mqar", "capacity", "costs", "state-tracking"])
def test_same_root_seed_gives_identical_tables(study):
    first, second = _numbers(study(3)), _numbers(study(3))
    print(f"{study.__name__}: {len(first)} rows; first row {first[0]}")
    assert first == second


@pytest.mark.parametrize("study", [_retrieval, _capacity, _state_tracking], ids=["retrieval", "capacity", "state-tracking"])
def test_another_root_seed_changes_the_numbers(study):
    assert _numbers(study(3)) != _numbers(study(4))
