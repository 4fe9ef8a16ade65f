"""``fastweights bench --cpu-peers`` (``benchmarks/cpu_peers.py``) on a tiny prefill: every
row is timed or skipped with its reason (a missing peer never fails the run), ratios are the
peer's time over ours, every timed peer computes what ours does (fp32 rows: its output within
1e-4 of ours; bf16 rows: within 2 % of our output's largest entry), and the path each compiled
kernel took is recorded. The serving engines' CPU op (SGLang's, not installable here) is stood in
for by an op with each of its two schemas, computed by our float64 recurrence, so the adapter's
arguments and layouts are checked. No speed asserted."""

import json

import pytest
import torch

from benchmarks import cpu_peers
from benchmarks.run import main as run_benchmarks
from fastweights import ops


def test_every_peer_is_a_timed_row_or_a_skipped_row_with_its_reason(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cpu_peers, "SHAPES", {"H 2 x 128": 2})
    out = tmp_path / "peers.json"
    assert run_benchmarks(["cpu_peers", "--T", "64", "--threads", "1", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["phase"] for r in rows} == {"prefill", "decode", "prefill bf16"}
    names = {r["impl"] for r in rows}
    assert {"fastweights chunk_gated_delta_rule", "fastweights gated_delta_rule_step", "attn-gym reference",
            "transformers torch_chunk_gated_delta_rule", "fla naive_recurrent_gated_delta_rule",
            "fastweights chunk_gated_delta_rule (bf16 products)", "sglang chunk_gated_delta_rule_cpu"} <= names
    assert {r["phase"] for r in rows if r["impl"] == "attn-gym reference"} == {"prefill", "decode"}
    for r in rows:
        if "skipped" in r:
            assert isinstance(r["skipped"], str) and r["skipped"]
        else:
            assert r["ms"] > 0 and r["peer_time_over_ours"] > 0
            if r["dtype"] == "float32":
                assert isinstance(r["max_abs_diff_vs_ours"], float) and r["max_abs_diff_vs_ours"] < 1e-4, r
            else:
                assert r["dtype"] == "bfloat16" and r["max_rel_diff_vs_ours"] < 0.02, r
    try:
        from attn_gym.linear import chunk_gdn  # noqa: F401
    except Exception:  # not installed: its rows are skips with the reason, checked above
        pass
    else:
        assert all("skipped" not in r for r in rows if r["impl"] == "attn-gym reference")
    ours = [r for r in rows if r["impl"].startswith("fastweights")]
    assert all(r["peer_time_over_ours"] == 1.0 for r in ours)
    assert "ISA path" in result["cpu_path"] or "PyTorch path" in result["cpu_path"]
    assert "skipped:" in capsys.readouterr().out or all("skipped" not in r for r in rows)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="`--threads` must be >= 1, got 0"):
        run_benchmarks(["cpu_peers", "--threads", "0"])


def _stand_in(lib: torch.library.Library, pooled: bool) -> None:
    """An op with the serving engines' CPU schema (``pooled``: the newer form, with pool indices; the
    state [N, H, K, V] in both), computed by our float64 recurrence at the engines' scale K^-1/2, its
    output rounded to the input dtype; it updates the state in place, as theirs does."""
    lib.define("chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
               "Tensor initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first, "
               "bool use_qk_l2norm_in_kernel, " + ("Tensor initial_state_indices, " if pooled else "")
               + "float eps=1e-5) -> (Tensor, Tensor)")

    def impl(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
             use_qk_l2norm_in_kernel, *rest):
        assert not head_first and not use_qk_l2norm_in_kernel and cu_seqlens.tolist() == [0, query.shape[1]]
        assert beta.dtype == torch.bfloat16 and g.dtype == torch.float32 and initial_state.dtype == torch.float32
        if pooled:  # one sequence, in pool slot 0
            (indices,) = rest[:1]
            assert indices.dtype == torch.int32 and indices.tolist() == [0] and initial_state.shape[0] == 1
        o, h = ops.recurrent_gated_delta_rule(*(t.double() for t in (query, key, value, g, beta)),
                                              initial_state=initial_state.double(), output_final_state=True)
        initial_state.copy_(h)
        return o.to(query.dtype), h.float()

    lib.impl("chunk_gated_delta_rule_cpu", impl, "CPU")


@pytest.mark.parametrize("pooled", [False, True], ids=["state", "pooled-state"])
def test_the_serving_engines_op_is_called_in_its_own_layout(monkeypatch, pooled):
    namespace = "fastweights_test_engine_" + ("pooled" if pooled else "plain")
    with torch.library._scoped_library(namespace, "DEF") as lib:
        _stand_in(lib, pooled)
        monkeypatch.setattr(cpu_peers, "SGLANG_OP", (namespace, "chunk_gated_delta_rule_cpu"))
        gen = torch.Generator().manual_seed(0)
        cases = cpu_peers.prefill_bf16_cases(100, 2, gen)
        theirs, ours = cases["sglang chunk_gated_delta_rule_cpu"], cases["fastweights chunk_gated_delta_rule (bf16 products)"]
        assert callable(theirs), theirs
        (o, h), (o_ref, h_ref) = theirs(), ours()
        assert o.shape == o_ref.shape and h.shape == h_ref.shape == (1, 2, 128, 128)
        # the stand-in is exact on the bf16 values; ours has bf16 products: a few bf16 ulps apart
        assert (o.float() - o_ref.float()).abs().max() <= 0.02 * o_ref.float().abs().max()
        assert (h - h_ref).abs().max() <= 0.02 * h_ref.abs().max()


def test_a_missing_engine_op_is_a_skipped_row_with_its_reason(monkeypatch):
    monkeypatch.setattr(cpu_peers, "SGLANG_OP", ("fastweights_test_absent", "chunk_gated_delta_rule_cpu"))
    reason = cpu_peers._sglang()
    assert isinstance(reason, str) and "not installed" in reason and "--load-library" in reason


def test_load_library_names_a_file():
    with pytest.raises(ValueError, match="`--load-library` '/nonexistent/libx.so' is not a file"):
        run_benchmarks(["cpu_peers", "--load-library", "/nonexistent/libx.so"])
