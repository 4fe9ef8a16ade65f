"""Helpers of the multi-process training tests: ranks started as torchrun starts them (its environment,
without its agent), always with a timeout, and the run folders they leave."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

ENV = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(nproc, *args):
    """Start ``nproc`` ranks of ``fastweights.cli *args`` as torchrun would (its environment, without its agent)."""
    port, procs = free_port(), []
    for rank in range(nproc):
        env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc)}
        procs.append(subprocess.Popen([sys.executable, "-m", "fastweights.cli", *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def stop_all(procs):
    """Kill every rank still running (a stopped one is woken first, so that it can die)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def torchrun(nproc, *args, timeout=240):
    """Run ``nproc`` ranks to the end (all killed after ``timeout`` s); returncode 0 when every rank exited 0,
    stderr: every rank's, rank by rank."""
    procs = spawn(nproc, *args)
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        stop_all(procs)
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(args, code, "".join(o for o, _ in outputs),
                                       "".join(f"[rank {r}] {e}" for r, (_, e) in enumerate(outputs)))


def losses(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def rewind(run, copy, step):
    """A copy of ``run`` as a run killed right after its checkpoint of ``step``: the later checkpoints gone,
    ``latest`` naming it (the metrics after it are dropped by the resume)."""
    shutil.copytree(run, copy)
    for name in os.listdir(copy):
        if name.startswith("ckpt-") and int(name.split("-")[1]) > step:
            shutil.rmtree(os.path.join(copy, name))
    (copy / "latest").write_text(f"ckpt-{step:06d}\n")
    return copy




def write_words(path):
    """About 6 KB of words from a small vocabulary (byte-level text to train on) at ``path``; returns it."""
    import random

    rng = random.Random(0)
    words = ["memory", "delta", "rule", "state", "key", "value", "query", "write", "read", "fast", "weight"]
    path.write_text(" ".join(rng.choice(words) for _ in range(1000)))
    return path


def text_args(text):
    """A tiny hybrid LM (DeltaNet: the state exchange and the short convolution's halo; softmax attention:
    the K,V all-gather) on ``text``, 32-token windows in chunks of 8, so that 2 or 4 ranks can split them."""
    return ["--data", str(text), "--seq-len", "32", "--chunk-size", "8", "--batch-size", "4", "--eval-every", "0",
            "--eval-tokens", "256", "--progress", "off", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
            "--mixer", '["deltanet", "softmax"]', "--threads", "1", "--lr", "1e-2"]
