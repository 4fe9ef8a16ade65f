"""The costs study (seed 000 Fig. 17.1 audit, seed 002 calculator): formulas against measurements."""

import json

import pytest
import torch

from fastweights.studies.costs import (
    SOLVERS,
    CostsConfig,
    check_lm_calculator,
    crossover_context,
    measure_solver,
    memory_per_session,
    predicted_flops,
    predicted_state_bytes,
    run_costs,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("context", [16, 100])
def test_state_bytes_formula_matches_the_ops(solver, context):
    gen = torch.Generator().manual_seed(0)
    m = measure_solver(solver, context, 12, 10, repeats=1, gamma=0.99, generator=gen)
    predicted = predicted_state_bytes(solver, context, 12, 10)
    print(f"{solver} T={context}: predicted {predicted} B, measured {m['state_bytes']} B")
    assert m["state_bytes"] == predicted


def test_only_softmax_state_grows_with_context():
    for solver in SOLVERS:
        small, large = (predicted_state_bytes(solver, t, 64, 64) for t in (256, 4096))
        if solver == "softmax":
            assert large - 8 == 16 * (small - 8)  # linear in T (the 8 bytes are the cached length)
        else:
            assert large == small
        update_small, query_small = predicted_flops(solver, 256, 64, 64)
        update_large, query_large = predicted_flops(solver, 4096, 64, 64)
        assert update_large == update_small
        assert (query_large > 10 * query_small) == (solver == "softmax")


def test_calculator_numbers():
    # A 7B-like model: 32 layers x 32 heads x 128, bf16 KV cache, fp32 fixed state.
    mem = memory_per_session(4096, 32, 32, 128, 128, "bfloat16", "float32", softmax_layers=4)
    assert mem["softmax"] == 2 * 2**30          # 2 GiB at 4K tokens (0.5 MiB per token)
    assert mem["fixed_state"] == 64 * 2**20     # 64 MiB, whatever the context
    assert mem["hybrid"] == 4 * (2 * 2**30 // 32) + 28 * (64 * 2**20 // 32)  # 4 KV layers + 28 fixed ones
    assert memory_per_session(2**20, 32, 32, 128, 128)["fixed_state"] == mem["fixed_state"]
    assert crossover_context(128, 128, "bfloat16", "float32") == 128


def test_calculator_formula_equals_the_models_measured_cache():
    rows = check_lm_calculator(contexts=(5, 33))
    for r in rows:
        print(r)
    assert {r["mixer"] for r in rows} == {"softmax", "linear", "deltanet", "gated_deltanet"}
    assert all(r["predicted"] == r["measured"] for r in rows)


def test_files_and_table(tmp_path):
    config = CostsConfig(contexts=(32, 64), repeats=2, calc_contexts=(1024, 2**20))
    result = run_costs(config, out_dir=tmp_path, progress=False)
    saved = json.loads((tmp_path / "costs.json").read_text())
    assert saved["state_bytes_exact"] and saved["lm_check"]["exact"]
    assert len(saved["table"]) == 2 * len(SOLVERS)
    assert all(r["step_us"] > 0 for r in saved["table"])
    rows = saved["calculator"]["rows"]
    assert rows[-1]["softmax_sessions"] == 0 and rows[-1]["fixed_state_sessions"] == 1280
    for name in ("costs_solver_map.png", "costs_calculator.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert result["matched"]["storage_matched_context"] == 32  # 64·64 numbers = 32 rows of K + V


@pytest.mark.parametrize("bad, match", [
    (dict(kv_dtype="fp8"), "kv_dtype"),
    (dict(softmax_layers=40), "softmax_layers"),
    (dict(contexts=(0,)), "contexts"),
    (dict(heads=0), "heads"),
])
def test_bad_config_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        CostsConfig(**bad)


def test_unknown_solver():
    with pytest.raises(ValueError, match="solver"):
        measure_solver("lstm", 8, 4, 4, 1, 0.9, torch.Generator())
