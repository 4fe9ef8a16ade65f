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

    python -m fastweights.bench.grad_checkpointing [--batch 8 --seq-len 512 --d-model 256 --n-layers 8
                                            --mixer deltanet --threads 1 --json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..config import atomic_write_text
from ..models import LM, LMConfig
from .chunk_speed import _reset_peak_rss, _status_kib

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the package (the child imports it from there)


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--mixer", default="deltanet", help='a mixer name, or a JSON list such as \'["deltanet", "softmax"]\'')
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows and the shape here")
    p.add_argument("--checkpointing", choices=["on", "off"], help=argparse.SUPPRESS)  # set in the child
    args = p.parse_args()
    if args.checkpointing:
        print(json.dumps(child(args)))
        return 0
    rows = []
    for flag in ("off", "on"):
        cmd = [sys.executable, "-m", "fastweights.bench.grad_checkpointing", *sys.argv[1:], "--checkpointing", flag]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if res.returncode:
            raise SystemExit(f"child ({flag}) failed: {res.stderr.strip()[-2000:]}")
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


if __name__ == "__main__":
    sys.exit(main())
