"""Memory and time of one LM training step with and without gradient checkpointing.

Each case runs in a fresh child process (so one case's peak cannot hide another's):
build the model, run one small warm-up step, then measure one forward + backward of a
``[B, T]`` batch, reporting

- ``saved_mib``: bytes of the tensors autograd keeps for the backward pass (counted
  with ``saved_tensors_hooks``; with checkpointing only each block's input is kept);
- ``peak_mib``: growth of the process's peak resident memory (VmHWM, reset before the
  step) over its resident memory before the step; on CUDA, ``max_memory_allocated``;
- ``ms``: the step's wall time (checkpointing runs each block's forward twice).

Usage::

    python -m benchmarks.run grad_checkpointing [--batch 8 --seq-len 512 --d-model 256 --n-layers 8
                                            --mixer deltanet --threads 1 --json PATH]
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from fastweights.config import atomic_write_text, flag
from fastweights.models import LM, LMConfig

from ._shapes import Threads
from .chunk_speed import _reset_peak_rss, _status_kib

ROOT = Path(__file__).resolve().parents[1]  # the repository root: the children import the package and the benchmarks from there


def child(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mixer = json.loads(args.mixer) if args.mixer.startswith("[") else args.mixer
    config = LMConfig(vocab_size=256, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, mixer=mixer,
                      max_seq_len=args.seq_len, gradient_checkpointing=args.checkpointing == "on")
    model = LM(config).to(args.device).train()

    def step(ids):
        logits, _ = model(ids, return_cache=False)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids.reshape(-1)).backward()

    step(torch.randint(0, 256, (1, 32), device=args.device))  # warm-up: lazy initialization
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 256, (args.batch, args.seq_len), device=args.device)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before, reset = _status_kib("VmRSS"), _reset_peak_rss()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(ids)
    if cuda:
        torch.cuda.synchronize()
        peak, measure = (torch.cuda.max_memory_allocated() - before) / 2**20, "torch.cuda.max_memory_allocated growth"
    else:
        peak = (_status_kib("VmHWM") - before) / 1024
        measure = "VmHWM growth over VmRSS before the step" + ("" if reset else " (HWM not reset: upper bound)")
    ms = (time.perf_counter() - t0) * 1e3
    return {"checkpointing": args.checkpointing, "saved_mib": sum(storages.values()) / 2**20, "peak_mib": peak,
            "ms": ms, "measure": measure}


@dataclass
class Config(Threads):
    """The flags of ``python -m benchmarks.run grad_checkpointing``: ``--threads`` (``_shapes.Threads``) and these."""

    batch: int = field(default=8, metadata=flag(type=int, help="default 8"))
    seq_len: int = field(default=512, metadata=flag(type=int, help="default 512"))
    d_model: int = field(default=256, metadata=flag(type=int, help="default 256"))
    n_layers: int = field(default=8, metadata=flag(type=int, help="default 8"))
    n_heads: int = field(default=4, metadata=flag(type=int, help="default 4"))
    mixer: str = field(default="deltanet", metadata=flag(help='a mixer name, or a JSON list such as \'["deltanet", "softmax"]\''))
    device: str = field(default="cpu", metadata=flag(help="default cpu"))
    json: Optional[str] = field(default=None, metadata=flag(metavar="PATH", help="also write the rows and the shape here"))
    checkpointing: str = "off"  # not a flag: main() runs one child process with "off", one with "on"


def main(args: Config) -> int:
    rows = []
    for mode in ("off", "on"):
        config = json.dumps(dataclasses.asdict(dataclasses.replace(args, checkpointing=mode)))
        code = "import json, sys; from benchmarks.grad_checkpointing import Config, child; print(json.dumps(child(Config(**json.loads(sys.argv[1])))))"
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
        res = subprocess.run([sys.executable, "-c", code, config], capture_output=True, text=True, env=env, timeout=1800)
        if res.returncode:
            raise SystemExit(f"child ({mode}) failed: {res.stderr.strip()[-2000:]}")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    off, on = rows
    shape = dict(batch=args.batch, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers,
                 n_heads=args.n_heads, mixer=args.mixer, dtype="float32", device=args.device, threads=args.threads)
    print("one training step (forward + backward), " + ", ".join(f"{k}={v}" for k, v in shape.items()))
    print(f"{'checkpointing':>14} {'saved MiB':>10} {'peak MiB':>10} {'ms':>9}")
    for r in rows:
        print(f"{r['checkpointing']:>14} {r['saved_mib']:10.1f} {r['peak_mib']:10.1f} {r['ms']:9.0f}")
    ratios = {"saved_on_over_off": on["saved_mib"] / off["saved_mib"], "peak_on_over_off": on["peak_mib"] / off["peak_mib"],
              "time_on_over_off": on["ms"] / off["ms"]}
    print("on/off: saved {saved_on_over_off:.3f}, peak {peak_on_over_off:.3f}, time {time_on_over_off:.2f}".format(**ratios))
    print(f"peak measure: {off['measure']}")
    if args.json:
        atomic_write_text(args.json, json.dumps({"shape": shape, "rows": rows, "ratios": ratios}, indent=2) + "\n")
    return 0

