"""Data files are memory-mapped uint8 tokens: reading a window costs that window, not the file.

The default run checks the tokens and one peak-RSS measurement at 8 MB; the slow run
measures ``eval --tokens 100`` and ``train --data`` at 60 MB (the numbers of
``benchmarks/data_memory.py`` are in BENCHMARKS.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fastweights.tasks.text import ByteText, read_bytes

import fastweights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fastweights.__file__)))  # the package under test


def write(path, size):
    block = bytes(range(256)) * 4096
    with open(path, "wb") as f:
        for i in range(0, size, len(block)):
            f.write(block[: min(len(block), size - i)])


def test_file_tokens_are_uint8_views_and_windows_are_the_bytes(tmp_path):
    path = tmp_path / "data.bin"
    write(path, 50_000)
    tokens, name = read_bytes(path)
    assert tokens.dtype == torch.uint8 and len(tokens) == 50_000 and name == str(path)
    assert torch.equal(tokens[:300].long(), torch.arange(300) % 256)
    text = ByteText(str(path), seq_len=32)
    assert text.train.dtype == torch.uint8 and text.val.dtype == torch.uint8
    x, y = text.sample(4, torch.Generator().manual_seed(0))
    assert x.dtype == torch.int64 and x.shape == (4, 32)
    assert torch.equal((x + 1) % 256, y)  # consecutive bytes of the file
    assert read_bytes(b"")[0].dtype == torch.uint8 and len(read_bytes(tmp_path / "data.bin")[0]) == 50_000
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert len(read_bytes(empty)[0]) == 0


CHILD = r"""
import sys, torch
try:
    from fastweights.training.evaluation import evaluate_file
except ImportError:  # the package from before fastweights.training
    from fastweights.commands.eval import evaluate_file
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
ckpt, small, big = sys.argv[1:4]
evaluate_file(ckpt, small, tokens=100, seq_len=64)  # warm: imports, model, first forward
before = hwm()
evaluate_file(ckpt, big, tokens=100, seq_len=64)
print("GROWTH_MB", hwm() - before)
"""


def eval_growth_mb(tmp_path, size):
    from fastweights.io.checkpoint import save_checkpoint
    from fastweights.models import LM, LMConfig

    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "ckpt", LM(LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2,
                                                              mixer="deltanet")))
    write(tmp_path / "small.bin", 4096)
    write(tmp_path / "big.bin", size)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, ckpt, str(tmp_path / "small.bin"), str(tmp_path / "big.bin")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(next(x for x in out.stdout.splitlines() if x.startswith("GROWTH_MB")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_eval_tokens_100_of_an_8_mb_file_reads_what_it_needs(tmp_path):
    growth = eval_growth_mb(tmp_path, 8_000_000)
    print(f"eval --tokens 100 of 8 MB: peak RSS grew {growth:.1f} MB")
    assert growth < 2.0  # reading the whole file as int64 took ~64 MB more


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_eval_tokens_100_of_a_60_mb_file_peak_rss(tmp_path):
    growth = eval_growth_mb(tmp_path, 60_000_000)
    print(f"eval --tokens 100 of 60 MB: peak RSS grew {growth:.1f} MB")
    assert growth < 6.0  # 10% of the file; before: ~450 MB (int64 copy, 7.5 bytes per byte)


@pytest.mark.slow
def test_eval_and_train_of_a_60_mb_file_peak_rss_benchmark():
    """``benchmarks/data_memory.py`` at 60 MB: the data adds a few MB, not the file's size
    (before: +487 MB for ``eval --tokens 100``, +457 MB for ``train --data``)."""
    from benchmarks.data_memory import Config, measure

    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    rows = measure("this", env, Config(sizes_mb=(60,)))
    for row in rows:
        print(row)
        assert row["extra_mb"] < 30, row
