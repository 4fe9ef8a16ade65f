"""Context parallelism on the CPU: one LM training step on one long sequence, split over 1, 2, 4 processes.

For each length T and process count N (one context-parallel group of N ranks, gloo), this runs
one training step (forward, backward, the gradients summed over the group) of a small DeltaNet LM
on ``[1, T]`` tokens, rank r holding tokens ``[r·T/N, (r+1)·T/N)``, and reports per rank:

- ``peak_rss_mib``: the process's peak resident memory (``ru_maxrss``) after the first step;
- ``step_rss_mib``: that peak less the resident memory just before the step (what the step
  itself added: activations, gradients, buffers), which should fall about as 1/N;
- ``tokens_per_s``: T / the median wall time of the timed steps (the whole group's rate);
- ``cp_bytes_per_layer``: bytes one rank hands to the context-parallel collectives in one step,
  forward and backward, per layer (the state summaries and their gradients, the short
  convolution's halo and its gradient, the argument check), counted by
  :func:`fastweights.ops.context_parallel.count_communication` (its convention: an all-gather's
  input, a reduce-scatter's input); ``kv_bytes_per_layer``: the same count for all-gathering one
  layer's keys and values instead and passing their gradients back (``gather_sequence``, as the
  softmax layers do), measured on tensors of the layer's shape; ``grad_bytes``: the parameters'
  gradient all-reduce (the same for any T).

Every configuration runs in fresh processes (``torchrun``), so each peak is its own. With more
processes than cores the ranks share cores: tokens/s then measures the oversubscribed machine,
and memory is the point.

Run::

    python -m benchmarks.run context_parallel --tokens 16384 65536 --procs 1 2 4 \\
        --out docs/results/context_parallel.json
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

from fastweights.config import atomic_write_text, flag

ROOT = str(Path(__file__).resolve().parents[1])  # the repository root: the ranks import the benchmarks from there
MODEL = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 2, "mixer": "deltanet"}


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(tokens: int, steps: int, result: str) -> None:
    """One rank of one configuration (started by torchrun); rank 0 writes the JSON record to ``result``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fastweights.models import LM, LMConfig
    from fastweights.training import plan_parallel

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    plan = plan_parallel(rank, world, context_parallel=world)
    config = LMConfig(**MODEL, max_seq_len=tokens)
    torch.manual_seed(0)
    model = LM(config)
    ids = torch.randint(0, config.vocab_size, (1, tokens + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = plan.local_batch(ids[:, :-1], ids[:, 1:])
    params = list(model.parameters())

    def step():
        logits, _ = model(inputs, return_cache=False, **({"cp_group": plan.cp_group} if world > 1 else {}))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum") / tokens
        loss.backward()
        if world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
        for p in params:
            p.grad = None

    if world > 1:
        from fastweights.ops.context_parallel import count_communication, gather_sequence

        counting = count_communication()
    else:
        counting = contextlib.nullcontext(SimpleNamespace(records=[]))
    before = _rss_mib()
    with counting as log:
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    head = config.d_model // config.n_heads
    kv_bytes = 0
    if world > 1:  # what one layer would send all-gathering its keys and values instead, forward and backward
        k, v = (torch.randn(1, tokens // world, config.n_heads, head, requires_grad=True) for _ in range(2))
        with count_communication() as kv_log:
            (gather_sequence(k, plan.cp_group).sum() + gather_sequence(v, plan.cp_group).sum()).backward()
        kv_bytes = kv_log.sent_bytes
    by_label: Dict[str, int] = {}
    for _, what, payload, _ in log.records:
        by_label[what] = by_label.get(what, 0) + payload // config.n_layers
    record = {
        "tokens": tokens, "procs": world, "rank": rank, "peak_rss_mib": round(peak, 1),
        "step_rss_mib": round(peak - before, 1), "seconds": [round(t, 3) for t in times],
        "tokens_per_s": round(tokens / statistics.median(times), 1),
        "cp_bytes_per_layer": sum(by_label.values()), "cp_bytes_by_label": by_label,
        "kv_bytes_per_layer": kv_bytes,
        "grad_bytes": 4 * sum(p.numel() for p in params) if world > 1 else 0,
    }
    records: List[Dict] = [record]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, record)
        records = gathered
        dist.destroy_process_group()
    if rank == 0:
        with open(result, "w", encoding="utf-8") as f:
            json.dump(records, f)


def run_config(tokens: int, procs: int, steps: int, timeout: float) -> List[Dict]:
    """One configuration in fresh processes; the records of every rank."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
                   "-m", "benchmarks.context_parallel", str(tokens), str(steps), result]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode or not os.path.exists(result):
            raise RuntimeError(f"context_parallel bench: T={tokens}, {procs} processes failed:\n{done.stderr[-3000:]}")
        with open(result, encoding="utf-8") as f:
            return json.load(f)


def table(rows: List[Dict]) -> str:
    """The markdown table of BENCHMARKS.md: one line per (T, N), memory of the largest rank."""
    lines = ["| T | processes | peak RSS / rank (MiB) | step's own memory / rank (MiB) | tokens/s | "
             "CP bytes / layer / rank | K,V all-gather bytes / layer / rank |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['procs']} | {r['peak_rss_mib']:.0f} | {r['step_rss_mib']:.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['cp_bytes_per_layer']:,} | {r['kv_bytes_per_layer']:,} |")
    return "\n".join(lines)


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run context_parallel``."""

    tokens: Tuple[int, ...] = field(default=(16384, 65536), metadata=flag(type=int, nargs="+", parse=tuple, help="sequence lengths T (default 16384 65536)"))
    procs: Tuple[int, ...] = field(default=(1, 2, 4), metadata=flag(type=int, nargs="+", parse=tuple, help="process counts N (default 1 2 4)"))
    steps: int = field(default=2, metadata=flag(type=int, help="timed steps after the measured first one"))
    timeout: float = field(default=1800, metadata=flag(type=float, help="seconds one configuration may take"))
    out: Optional[str] = field(default=None, metadata=flag(help="JSON file for the results"))


def main(args: Config) -> int:
    from tqdm.auto import tqdm

    rows = []
    configs = [(t, n) for t in args.tokens for n in args.procs]
    for tokens, procs in tqdm(configs, desc="context parallel"):
        ranks = run_config(tokens, procs, args.steps, args.timeout)
        worst = max(ranks, key=lambda r: r["peak_rss_mib"])
        rows.append({**worst, "ranks": ranks})
    print(table(rows))
    if args.out:
        atomic_write_text(args.out, json.dumps({"model": MODEL, "cpu_count": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":  # one rank of one configuration, started by run_config through torchrun
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
