"""``python -m benchmarks.run triton_resources``: every Triton kernel config compiled for sm_90 on the CPU fits.

The default run compiles one cheap case (the decode step, fp32, K = V = 64, its
configs) into a fresh cache and checks what the script reports; the slow run
(``-m slow``) compiles every kernel × config × {bf16, fp32} × K = V ∈ {64, 128, 256}
× {plain, gated} (cached on disk; the first run takes tens of minutes on one core)
and requires that all fit in sm_90's shared memory and that none spills more than
512 bytes per thread at K = V = 128, bf16. Skipped without triton.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SM90_SHARED = 232_448


def _run(args, timeout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, never interpret
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "triton_resources", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    return proc


def test_quick_case_compiles_for_sm90_and_reports(tmp_path):
    out = tmp_path / "resources.json"
    proc = _run(["--quick", "--cache", str(tmp_path / "cache"), "--json", str(out)], timeout=600)
    assert proc.returncode == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["kernel"] for r in rows} == {"decode_step"} and len(rows) >= 2
    for r in rows:
        assert 0 < r["shared"] <= SM90_SHARED and r["regs"] > 0 and r["spill_store"] >= 0, r
    assert not result["failures"]
    again = _run(["--quick", "--cache", str(tmp_path / "cache")], timeout=600)  # from the cache now
    assert again.returncode == 0 and again.stdout.count("(cached)") == len(rows)


@pytest.mark.slow
def test_every_config_fits_sm90_and_spills_little(tmp_path):
    proc = _run(["--max-spill", "512", "--json", str(tmp_path / "resources.json")], timeout=6 * 3600)
    assert proc.returncode == 0, "a config does not fit sm_90 or spills > 512 B/thread at K=V=128 bf16"
