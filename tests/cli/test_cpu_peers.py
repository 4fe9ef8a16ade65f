"""``fastweights bench --cpu-peers`` (``benchmarks/cpu_peers.py``) on a tiny prefill: every
row is timed or skipped with its reason (a missing peer never fails the run), ratios are the
peer's time over ours, every timed peer computes what ours does (its output within 1e-4 of ours),
and the path each compiled kernel took is recorded. No speed asserted."""

import json

import pytest

from benchmarks import cpu_peers
from benchmarks.run import main as run_benchmarks


def test_every_peer_is_a_timed_row_or_a_skipped_row_with_its_reason(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cpu_peers, "SHAPES", {"H 2 x 128": 2})
    out = tmp_path / "peers.json"
    assert run_benchmarks(["cpu_peers", "--T", "64", "--threads", "1", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["phase"] for r in rows} == {"prefill", "decode"}
    names = {r["impl"] for r in rows}
    assert {"fastweights chunk_gated_delta_rule", "fastweights gated_delta_rule_step", "attn-gym reference",
            "transformers torch_chunk_gated_delta_rule", "fla naive_recurrent_gated_delta_rule"} <= names
    assert {r["phase"] for r in rows if r["impl"] == "attn-gym reference"} == {"prefill", "decode"}
    for r in rows:
        if "skipped" in r:
            assert isinstance(r["skipped"], str) and r["skipped"]
        else:
            assert r["ms"] > 0 and r["peer_time_over_ours"] > 0
            assert isinstance(r["max_abs_diff_vs_ours"], float) and r["max_abs_diff_vs_ours"] < 1e-4, r
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
