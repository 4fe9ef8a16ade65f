"""The costs study (the per-solver audit and the memory calculator): formulas against measurements."""

import json

import pytest
import torch

from fastweights.studies.costs import (
    SOLVERS,
    CostsConfig,
    check_lm_calculator,
    crossover_context,
    measure_solver,
    config_from_args,
    memory_per_session,
    model_weight_params,
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
    mem = memory_per_session(4096, 32, 32, 128, 128, "bfloat16", "float32", softmax_layers=4)  # explicit fp32
    assert mem["softmax"] == 2 * 2**30          # 2 GiB at 4K tokens (0.5 MiB per token)
    assert mem["fixed_state"] == 64 * 2**20     # 64 MiB, whatever the context
    assert mem["hybrid"] == 4 * (2 * 2**30 // 32) + 28 * (64 * 2**20 // 32)  # 4 KV layers + 28 fixed ones
    assert memory_per_session(2**20, 32, 32, 128, 128, "bfloat16", "float32")["fixed_state"] == mem["fixed_state"]
    assert crossover_context(128, 128, "bfloat16", "float32") == 128


def test_calculator_formula_equals_the_models_measured_cache():
    rows = check_lm_calculator(contexts=(5, 33))
    for r in rows:
        print(r)
    assert {r["mixer"] for r in rows} == {"softmax", "linear", "deltanet", "gated_deltanet", "kda", "gdn2", "deltaproduct", "rwkv7"}
    assert all(r["predicted"] == r["measured"] for r in rows)


def test_files_and_table(tmp_path):
    config = CostsConfig(contexts=(32, 64), repeats=2, calc_contexts=(1024, 2**20))
    result = run_costs(config, out_dir=tmp_path, progress=False)
    saved = json.loads((tmp_path / "costs.json").read_text())
    assert saved["state_bytes_exact"] and saved["lm_check"]["exact"]
    assert len(saved["table"]) == 2 * len(SOLVERS)
    assert all(r["step_us"] > 0 for r in saved["table"])
    rows = saved["calculator"]["rows"]
    # bf16 state (the KV cache's dtype by default): 32 MiB per session, 2560 of them in 80 GiB
    assert rows[-1]["softmax_sessions"] == 0 and rows[-1]["fixed_state_sessions"] == 2560
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


def test_softmax_query_flops_count_the_value_read():
    """K = 2, V = 3, T = 5 by hand: scores q·K 5·2 multiply-adds (20 FLOPs), softmax 3 per score (15), value read
    p·V 5·3 multiply-adds (30): 65. The old count, 4·T·K + 3·T = 55, assumed V = K and fails here."""
    assert predicted_flops("softmax", 5, 2, 3) == (0, 65)
    # The fixed-state solvers by hand at K = 2, V = 3 (D = K): the delta rule reads W k (2·K·V), forms
    # β(v − Wk) (2·V) and writes the outer product (2·K·V); its query is one read (2·K·V).
    assert predicted_flops("delta", 5, 2, 3) == (30, 12)
    assert predicted_flops("linear", 5, 2, 3) == (16, 19)  # 2·K·(V+1) each, + V divisions for the normalizer


def test_calculator_compares_state_and_kv_cache_at_one_dtype_by_default():
    from fastweights.cli import build_parser

    config = config_from_args(build_parser().parse_args(["study", "costs", "--dtype", "float16"]))
    assert config.state_dtype == "float16" == config.kv_dtype
    assert CostsConfig().state_dtype == CostsConfig().kv_dtype == "bfloat16"
    # At one dtype a head's K·V state equals its KV cache after K·V / (K + V) tokens: 64 at K = V = 128.
    assert crossover_context(128, 128, "bfloat16") == 64
    assert memory_per_session(4096, 32, 32, 128, 128)["fixed_state"] == 32 * 2**20  # bf16 state
    explicit = config_from_args(build_parser().parse_args(["study", "costs", "--state-dtype", "float32"]))
    assert explicit.state_dtype == "float32" and explicit.kv_dtype == "bfloat16"


def test_model_weight_params():
    """By hand: 2 layers, 2 heads, d_k = 3, d_v = 5, d_model 4, d_ff 6, vocab 7. Per layer q, k 4·6 each, v 4·10,
    o 10·4 (128), MLP 3·4·6 (72), two norms 8: 208; ×2 = 416; embedding and head 2·7·4 = 56; final norm 4."""
    assert model_weight_params(2, 2, 3, 5, 4, 6, 7) == 476
    assert model_weight_params(2, 2, 3, 5, 4, 6, 7, tied_embeddings=True) == 476 - 28
    # LLaMA-7B's published shape (32 layers, 32 heads of 128, d_model 4096, SwiGLU 11008, vocab 32000) has
    # 6,738,415,616 parameters; the default d_ff rule gives its 11008.
    config = CostsConfig(weights=True)
    assert config.d_model == 4096 and config.d_ff == 11008
    assert model_weight_params(32, 32, 128, 128, 4096, 11008, 32000) == 6_738_415_616


def test_calculator_takes_the_weights_off_the_budget():
    from fastweights.studies.costs import calculator_row

    plain = calculator_row(CostsConfig(), 4096)
    counted = calculator_row(CostsConfig(weights=True), 4096)
    weights = 2 * 6_738_415_616  # bf16
    assert counted["fixed_state_bytes"] == plain["fixed_state_bytes"] == 32 * 2**20
    assert counted["fixed_state_sessions"] == int((80 * 2**30 - weights) // (32 * 2**20))  # 2158, not 2560
    assert plain["fixed_state_sessions"] == 2560
    tiny = calculator_row(CostsConfig(weights=True, budget_gib=1.0), 4096)  # 12.6 GiB of weights do not fit
    assert tiny["fixed_state_sessions"] == tiny["softmax_sessions"] == 0
