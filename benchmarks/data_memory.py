"""Peak memory (RSS) of ``fastweights eval --tokens N`` and ``fastweights train --data`` against
the size of the data file.

Each measurement runs the command in a fresh child process and reads its peak resident
set size (``ru_maxrss`` of the child); the same command on a 64 KB file gives the
baseline (Python, torch, the model), so ``extra`` is what the data costs. Files are
random printable bytes, written once under ``--dir`` and deleted at the end.

    python -m benchmarks.run data_memory --sizes-mb 60 600
    # before/after in one run: another checkout of the package beside this one
    python -m benchmarks.run data_memory --code before=/tmp/old after=.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Tuple

from fastweights.config import flag

CHILD = r"""
import resource, sys
from fastweights.cli import main
code = main(sys.argv[1:])
print("PEAK_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""


def write_file(path: str, size: int) -> None:
    block = bytes(range(32, 127)) * (1 << 14)  # ~1.5 MB of printable bytes
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)


def peak_mb(argv, env) -> float:
    # cwd: a neutral folder, so `python -c` imports the package from PYTHONPATH, not from here
    out = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=env, timeout=1800,
                         cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise RuntimeError(f"{argv}: exit {out.returncode}: {out.stderr[-2000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("PEAK_KB"))
    return int(line.split()[1]) / 1024


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run data_memory``."""

    sizes_mb: Tuple[float, ...] = field(default=(60, 600), metadata=flag(type=float, parse=tuple, nargs="+", help="data file sizes in MB (default 60 600)"))
    dir: Optional[str] = field(default=None, metadata=flag(help="where to write the data files (default: a temporary folder)"))
    json: Optional[str] = field(default=None, metadata=flag(help="also write the results here"))
    code: Tuple[str, ...] = field(default=("this=.",), metadata=flag(
        parse=tuple, nargs="+", metavar="LABEL=DIR", help="package checkouts to measure (each: the PYTHONPATH of its children)"))


def main(args: Config) -> int:
    rows = []
    for spec in args.code:
        label, _, path = spec.partition("=")
        env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.abspath(path)}
        rows += measure(label, env, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


def measure(label, env, args):
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        subprocess.run([sys.executable, "-c", (
            "import torch\n"
            "try:\n    from fastweights.io.checkpoint import save_checkpoint\n"
            "except ImportError:  # a checkout from before fastweights.training\n"
            "    from fastweights.checkpoint import save_checkpoint\n"
            "from fastweights.models import LM, LMConfig\n"
            "torch.manual_seed(0)\n"
            f"save_checkpoint({ckpt!r}, LM(LMConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, mixer='deltanet')))")],
            check=True, env=env, cwd=tmp)
        small = os.path.join(tmp, "small.txt")
        write_file(small, 1 << 16)

        def commands(data, run):
            return {
                "eval --tokens 100": ["eval", ckpt, "--data", data, "--tokens", "100", "--seq-len", "64"],
                "train --data (3 steps)": ["train", "--out", os.path.join(tmp, run), "--data", data, "--steps", "3",
                                           "--seq-len", "64", "--batch-size", "4", "--d-model", "32", "--n-layers", "1",
                                           "--eval-every", "0", "--eval-tokens", "256", "--save-every", "0",
                                           "--progress", "off", "--threads", "1"],
            }

        base = {name: peak_mb(argv, env) for name, argv in commands(small, "base").items()}
        for size_mb in args.sizes_mb:
            data = os.path.join(tmp, f"data_{size_mb:g}mb.txt")
            write_file(data, int(size_mb * 1e6))
            for name, argv in commands(data, f"run_{size_mb:g}").items():
                peak = peak_mb(argv, env)
                row = {"code": label, "command": name, "file_mb": size_mb, "peak_rss_mb": round(peak, 1),
                       "baseline_mb": round(base[name], 1), "extra_mb": round(peak - base[name], 1),
                       "extra_bytes_per_file_byte": round((peak - base[name]) / size_mb, 3)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            os.unlink(data)
    return rows

