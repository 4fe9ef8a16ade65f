"""``fastweights bench --roofline-only``: the limits and the ops' fractions of them, in one run (tiny shapes)."""

import json

import pytest

from fastweights.ops import cpu as cpu_kernels
from benchmarks.roofline import chunk_backward_flops, chunk_forward_flops, has_bf16_matmul, op_flops
from benchmarks.run import main as run_benchmarks


def test_flop_counts_per_head_and_chunk():
    # C = 64, K = V = 128: Q Kᵀ, K Kᵀ, W (3 × 2·64²·128), U, P U' (2 × 2·64²·128), three C·K·V products, C³/3
    assert chunk_forward_flops(64, 128, 128) == 3 * 1048576 + 2 * 1048576 + 3 * 2097152 + 262144 / 3
    assert chunk_backward_flops(64, 128, 128) == 5 * 1048576 + 4 * 1048576 + 6 * 2097152
    # K != V keeps the terms apart; a partial chunk counts as a whole one
    assert chunk_forward_flops(2, 3, 5) == 2 * (3 * 4 * 3 + 2 * 4 * 5 + 3 * 2 * 3 * 5) + 8 / 3
    assert op_flops(2, 3, 65, 8, 8, 64) == 2 * 3 * 2 * chunk_forward_flops(64, 8, 8)
    assert op_flops(1, 1, 64, 8, 8, 64, backward=True) == chunk_forward_flops(64, 8, 8) + chunk_backward_flops(64, 8, 8)


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_roofline_only_writes_every_row_with_its_fraction(tmp_path, clock, one_thread):
    out = tmp_path / "roofline.json"
    argv = ["--roofline-only", "--roofline-T", "64", "--roofline-heads", "1", "--roofline-head-dim", "16",
            "--chunk-size", "32", "--decode-batch", "1", "--repeats", "1", "--threads", "1", "--clock", clock,
            "--json", str(out)]
    assert run_benchmarks(["chunk_speed", *argv]) == 0
    result = json.loads(out.read_text())["roofline"]
    assert result["clock"] == clock and result["shape"]["K"] == 16
    limits = {n: lim["rate"] for n, lim in result["limits"].items()}
    assert {"matmul_fp32_tile_state", "matmul_fp32_square_1024", "copy_state", "copy_64MiB"} <= set(limits)
    assert all(rate > 0 for rate in limits.values())
    ops = {r["op"] for r in result["rows"]}
    expected = {f"{name} {mode}" for name in ("chunk_delta_rule", "chunk_gated_delta_rule") for mode in ("fwd fp32", "fwd+bwd fp32")}
    if cpu_kernels.available():  # the compiled path's rows, and the PyTorch path's beside them
        expected |= {f"{op}, PyTorch path" for op in expected}
        assert result["cpu_path"].startswith("compiled CPU kernels")
    if has_bf16_matmul("cpu"):
        expected |= {"chunk_delta_rule fwd bf16 products", "chunk_gated_delta_rule fwd bf16 products"}
        assert "matmul_bf16_tile_state" in limits and set(result["bf16_speedup_over_fp32"]) == {"chunk_delta_rule", "chunk_gated_delta_rule"}
    decode = {"decode: recurrent_gated_delta_rule T=1", "decode: gated_delta_rule_step inplace",
              "decode: delta_rule_step inplace"}
    if cpu_kernels.available():
        decode |= {"decode: gated_delta_rule_step inplace, PyTorch path", "decode: delta_rule_step inplace, PyTorch path"}
    assert expected <= ops and {op for op in ops if op.startswith("decode")} == decode
    for row in result["rows"]:
        assert row["rate"] > 0 and row["ms_min"] > 0
        for limit, fraction in row["fraction_of"].items():
            assert fraction == pytest.approx(row["rate"] / limits[limit])
        assert row["unit"] == ("GB/s" if row["op"].startswith("decode") else "GFLOP/s")


def test_cpu_table_times_every_row_and_the_comparisons(tmp_path, one_thread):
    out = tmp_path / "table.json"
    assert run_benchmarks(["cpu_table", "--T", "64", "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    names = {r["name"] for r in result["rows"]}
    for rule in ("chunk_delta_rule", "chunk_gated_delta_rule"):
        for mode in ("fp32", "bf16 inputs", "autocast bf16", "bf16 products"):
            assert f"{rule} fwd H=8 K=V=128 {mode}" in names and f"{rule} fwd H=4 K=V=64 {mode}" in names
    assert all(r["ms"] > 0 and r["gflops"] > 0 for r in result["rows"])
    fp32 = result["fp32_mm_rate"]
    for r in result["rows"]:
        if "fraction_of_fp32_mm" in r:
            assert r["fraction_of_fp32_mm"] == pytest.approx(r["gflops"] / fp32)
    assert "chunk_delta_rule fwd H=8 K=V=128: bf16 products speed-up over fp32" in result["ratios"]
    for op in ("chunk_kda", "chunk_linear_attn"):
        assert f"{op} fwd H=8 K=V=128: bf16 inputs speed-up over fp32" in result["ratios"]
