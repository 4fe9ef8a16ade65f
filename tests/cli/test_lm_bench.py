"""The LM speed benchmark's quick mode: it runs every mixer and writes the JSON the README and
the report read (its structure, not its timings)."""

import json

import pytest

from benchmarks import lm_speed as lm_bench
from benchmarks.run import main as run_benchmarks
from fastweights.cli import main as cli_main


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm_bench") / "lm_speed.json"
    rc = run_benchmarks(["lm_speed", "--quick", "--json", str(path), "--d-model", "32", "--layers", "2", "--lm-heads", "2", "--threads", "1"])
    assert rc == 0
    return json.loads(path.read_text())


def test_quick_json_has_every_mixer_shape_and_context(quick_result):
    r = quick_result
    assert r["meta"]["quick"] is True and r["meta"]["threads"] == 1 and r["meta"]["d_model"] == 32
    want_train = {(m, T, B) for m in lm_bench.MIXERS for T, B in lm_bench.QUICK_TRAIN_SHAPES}
    assert {(row["mixer"], row["T"], row["B"]) for row in r["train"]} == want_train
    want_decode = {(m, L) for m in lm_bench.MIXERS for L in lm_bench.QUICK_DECODE_CONTEXTS}
    assert {(row["mixer"], row["context"]) for row in r["decode"]} == want_decode
    for row in r["train"] + r["decode"]:
        assert row["ms_min"] > 0 and row["ms_median"] >= row["ms_min"] and row["tokens_per_s"] > 0
        assert row["ratio_to_softmax"] > 0
        if row["mixer"] == "softmax":
            assert row["ratio_to_softmax"] == 1.0


def test_quick_decode_cache_sizes(quick_result):
    """The decode contexts are real: softmax's cache grows with the context, a fast-weight state does not."""
    short, long = lm_bench.QUICK_DECODE_CONTEXTS
    size = {(row["mixer"], row["context"]): row["cache_bytes"] for row in quick_result["decode"]}
    print({k: v for k, v in size.items()})
    assert size[("softmax", long)] > size[("softmax", short)]
    for m in ("deltanet", "gated_deltanet", "kda", "linear"):
        assert size[(m, long)] == size[(m, short)]


def test_quick_targets_listed(quick_result):
    names = [t["target"] for t in quick_result["targets"]]
    assert sum("flat" in n for n in names) == sum(m != "softmax" for m in lm_bench.MIXERS)  # one per fast-weight mixer
    for t in quick_result["targets"]:
        assert t["met"] in (True, False, None)


def test_cli_bench_lm_writes_json(tmp_path):
    path = tmp_path / "lm.json"
    rc = cli_main(["bench", "--lm", "--quick", "--mixers", "deltanet", "softmax", "--d-model", "16", "--layers", "1",
                   "--lm-heads", "2", "--threads", "1", "--clock", "cpu", "--json", str(path)])
    assert rc == 0
    r = json.loads(path.read_text())
    assert {row["mixer"] for row in r["train"]} == {"deltanet", "softmax"}
    assert r["meta"]["clock"] == "cpu" and len(r["meta"]["load_average"]) == 3


def test_quick_realistic_row(tmp_path):
    """``--realistic`` adds the DeltaNet-vs-softmax row (tiny with ``--quick``) and its target; keys stay."""
    path = tmp_path / "lm.json"
    rc = cli_main(["bench", "--lm", "--quick", "--realistic", "--mixers", "deltanet", "softmax", "--d-model", "16",
                   "--layers", "1", "--lm-heads", "2", "--threads", "1", "--clock", "cpu", "--json", str(path)])
    assert rc == 0
    r = json.loads(path.read_text())
    assert {"meta", "train", "decode", "targets"} <= set(r)
    shape = lm_bench.QUICK_REALISTIC
    assert r["meta"]["realistic_shape"]["d_model"] == shape["d_model"]
    rows = {row["mixer"]: row for row in r["realistic"]}
    assert set(rows) == set(lm_bench.REALISTIC_MIXERS)
    for row in rows.values():
        assert (row["T"], row["B"], row["d_model"], row["n_heads"]) == (shape["T"], shape["B"], shape["d_model"], shape["n_heads"])
        assert row["head_dim"] * row["n_heads"] == row["d_model"] and row["ms_min"] > 0
    assert rows["softmax"]["ratio_to_softmax"] == 1.0
    assert rows["deltanet"]["ratio_to_softmax"] == rows["deltanet"]["ms_min"] / rows["softmax"]["ms_min"]
    target = [t for t in r["targets"] if t["target"].startswith("realistic")]
    assert len(target) == 1 and target[0]["got"] == rows["deltanet"]["ratio_to_softmax"] and target[0]["want_at_most"] == 1.0


def test_realistic_row_off_by_default(quick_result):
    assert "realistic" not in quick_result and "realistic_shape" not in quick_result["meta"]
    assert lm_bench.REALISTIC == dict(d_model=1024, n_heads=8, n_layers=2, T=2048, B=1)
