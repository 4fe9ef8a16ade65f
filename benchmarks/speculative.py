"""Speculative decoding on the CPU: the verify window's crossover k, and prompt lookup against greedy.

Usage (repository root)::

    python -m benchmarks.run speculative --part crossover    # window forms against k one-token steps
    python -m benchmarks.run speculative --part lookup --checkpoint runs/recall   # greedy vs prompt lookup
    python -m benchmarks.run speculative --part lookup --train   # writes a repeating text, trains a DeltaNet on it first

**crossover**: a DeltaNet LM (d_model 256, 4 layers, 4 heads, vocabulary 256, fp32,
B = 1) reads a 128-token prompt; then, for each k, the time to read k more tokens:
as k one-token steps (plain decoding), as one window whose memory runs the recurrent
form, as one window with the chunk form (both unpadded: ``window_width`` = 1), and as
the default window (padded to 16 rows, chunk form from ``CHUNK_FROM`` rows). Interleaved
repeats, minimum reported. The crossover is the smallest k from which the chunk form
beats the recurrent form in a window (and stays ahead).

**lookup**: a DeltaNet LM trained by ``fastweights train`` on text that repeats itself
(``--train``: lines that say a random sentence three times, :func:`write_repeating_text`,
with prompts the first 60% of a line; or a recall-task checkpoint, prompts its writes,
separator and first query); per prompt ``max_new_tokens`` tokens by plain greedy decoding
and by prompt lookup (k proposals per round), interleaved; tokens/s, acceptance rate,
speed-up and whether the tokens are identical.

Writes ``docs/results/speculative.json``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from fastweights.config import atomic_write_text, flag
from fastweights.models import LM, LMConfig
from fastweights.models import window as windows
from fastweights.models.speculative import speculative_generate

DEFAULT_JSON = "docs/results/speculative.json"
KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: ``wall``: time.perf_counter; ``cpu``: time.process_time, the work of the process (all its
#: threads): on a shared, oversubscribed machine wall time mostly measures the scheduler.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = CLOCKS["wall"]


def _read(model: LM, cache, ids: torch.Tensor, how: str):
    """Read ``ids [1, k]`` after ``cache`` by ``how``; returns the new cache (the input is left as it was)."""
    if how == "steps":
        for t in range(ids.shape[1]):
            _, cache = model(ids[:, t: t + 1], cache)
        return cache
    width, chunk_from = {"recurrent": (1, 10 ** 9), "chunk": (1, 1), "default": (windows.WINDOW_WIDTH, windows.CHUNK_FROM)}[how]
    model.window_width, model.window_chunk_from = width, chunk_from
    _, new = model(ids, cache, keep_window=True)
    return new


@torch.no_grad()
def crossover(repeats: int = 15, d_model: int = 256, n_layers: int = 4, n_heads: int = 4, ks=KS) -> dict:
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=256, d_model=d_model, n_layers=n_layers, n_heads=n_heads, mixer="deltanet")).eval()
    prompt = torch.randint(0, 256, (1, 128))
    _, cache = model(prompt)
    hows = ("steps", "recurrent", "chunk", "default")
    times = {(k, h): [] for k in ks for h in hows}
    for _ in range(repeats + 2):  # two warm-up rounds, dropped below
        for k in ks:
            ids = torch.randint(0, 256, (1, k))
            for how in hows:
                start = CLOCK()
                _read(model, cache, ids, how)
                times[k, how].append(CLOCK() - start)
    rows = []
    for k in ks:
        best = {h: min(times[k, h][2:]) for h in hows}
        rows.append({"k": k, **{f"{h}_ms": 1e3 * best[h] for h in hows},
                     "chunk_over_recurrent": best["chunk"] / best["recurrent"],
                     "default_over_steps": best["default"] / best["steps"]})
    faster = [r["k"] for r in rows if r["chunk_over_recurrent"] < 1]
    cross = next((k for k in ks if all(r["chunk_over_recurrent"] < 1 for r in rows if r["k"] >= k)), None)
    print(f"crossover (DeltaNet d_model={d_model}, {n_layers} layers, {n_heads} heads, fp32, B=1, "
          f"threads={torch.get_num_threads()}; minimum of {repeats} interleaved repeats)")
    print(f"{'k':>3} {'k steps ms':>11} {'win recur ms':>13} {'win chunk ms':>13} {'default ms':>11} {'chunk/recur':>12} {'default/steps':>14}")
    for r in rows:
        print(f"{r['k']:>3} {r['steps_ms']:>11.2f} {r['recurrent_ms']:>13.2f} {r['chunk_ms']:>13.2f} {r['default_ms']:>11.2f} "
              f"{r['chunk_over_recurrent']:>12.2f} {r['default_over_steps']:>14.2f}")
    print(f"chunk faster than recurrent at k = {faster}; crossover k = {cross} (CHUNK_FROM = {windows.CHUNK_FROM})")
    return {"shape": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "prompt": 128, "dtype": "float32"},
            "rows": rows, "crossover_k": cross}


WORDS = ("red blue green cat dog bird runs sits eats the a one two big small old new fast slow tree house river "
         "stone moon sun rain wind jumps sleeps sings reads writes").split()


def write_repeating_text(path: str, lines: int = 12000, seed: int = 0) -> str:
    """A text whose lines say a random sentence of 5-9 words three times ("s. s. s."): the
    continuation of a line copies a span of its beginning."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9)))
        out.append(f"{sentence}. {sentence}. {sentence}.\n")
    atomic_write_text(Path(path), "".join(out))
    return path


def _train(out: str, data: str, steps: int = 800) -> str:
    from fastweights.cli import main as cli

    cli(["train", "--out", out, "--overwrite", "--data", data, "--seq-len", "128", "--mixer", "deltanet",
         "--d-model", "128", "--n-layers", "2", "--n-heads", "4", "--steps", str(steps), "--threads", "1",
         "--progress", "off"])
    return out


def _prompts(ckpt, count: int, seed: int, data):
    """Prompts for a checkpoint: recall sequences up to their first query key, or the first 60% of
    lines of the text file ``data`` (for a byte-level model)."""
    from fastweights.tasks.adapters import RecallData
    from fastweights.tasks.recall import SEP
    from fastweights.training import TrainConfig

    if (ckpt.train or {}).get("tokenizer") == "recall":
        task = RecallData(TrainConfig.from_dict(ckpt.train["train_config"])).task
        batch = task.sample(count, torch.Generator().manual_seed(seed))
        return [row[: int((row == SEP).nonzero()[0]) + 2][None] for row in batch.tokens]
    if data is None:
        raise ValueError("lookup: a byte-level checkpoint needs `data`, a text file to take prompts from")
    lines = [line for line in Path(data).read_text().splitlines() if len(line) > 10][:count]
    return [torch.tensor([list(line[: int(0.6 * len(line))].encode())]) for line in lines]


@torch.no_grad()
def lookup(checkpoint: str, k: int = 4, prompts: int = 8, max_new_tokens: int = 64, repeats: int = 3, seed: int = 0,
           data=None) -> dict:
    from fastweights.io.checkpoint import load_model

    model, ckpt = load_model(checkpoint)
    model.eval()
    rows = _prompts(ckpt, prompts, seed, data)
    plain_t, spec_t, identical, proposed, accepted, rounds = [], [], True, 0, 0, 0
    for prompt in rows:
        best_plain = best_spec = float("inf")
        for _ in range(repeats):
            start = CLOCK()
            plain = model.generate(prompt, max_new_tokens, temperature=0)
            best_plain = min(best_plain, CLOCK() - start)
            start = CLOCK()
            spec, _, stats = speculative_generate(model, prompt, max_new_tokens, prompt_lookup=k)
            best_spec = min(best_spec, CLOCK() - start)
        identical &= torch.equal(plain, spec)
        plain_t.append(best_plain)
        spec_t.append(best_spec)
        proposed, accepted, rounds = proposed + stats.proposed, accepted + stats.accepted, rounds + stats.rounds
    tokens = prompts * max_new_tokens
    result = {
        "checkpoint": str(checkpoint), "k": k, "prompts": prompts, "max_new_tokens": max_new_tokens,
        "plain_tokens_per_s": tokens / sum(plain_t), "lookup_tokens_per_s": tokens / sum(spec_t),
        "speedup": sum(plain_t) / sum(spec_t), "acceptance": accepted / max(proposed, 1),
        "tokens_per_round": (accepted + rounds) / max(rounds, 1), "identical": bool(identical),
    }
    print(f"prompt lookup k={k} vs greedy ({prompts} prompts, {max_new_tokens} new tokens each, fp32, B=1, "
          f"threads={torch.get_num_threads()}, best of {repeats})")
    print(f"greedy {result['plain_tokens_per_s']:.0f} tok/s, lookup {result['lookup_tokens_per_s']:.0f} tok/s, "
          f"speed-up {result['speedup']:.2f}x, acceptance {result['acceptance']:.2f}, "
          f"{result['tokens_per_round']:.2f} tokens per verify round, identical tokens: {identical}")
    return result


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run speculative``."""

    part: str = field(default="all", metadata=flag(choices=("crossover", "lookup", "all"),
                                                   help="which measurement (default all: crossover, then lookup)"))
    checkpoint: Optional[str] = field(default=None, metadata=flag(help="a recall-task DeltaNet run folder (for lookup)"))
    train: bool = field(default=False, metadata=flag(action="store_true", help="train one into runs/specdec_recall first"))
    data: Optional[str] = field(default=None, metadata=flag(help="for a byte-level checkpoint: the text file to take prompts from"))
    k: int = field(default=4, metadata=flag(type=int, help="proposals per round (default 4)"))
    threads: int = field(default=1, metadata=flag(type=int, help="default 1"))
    repeats: int = field(default=15, metadata=flag(type=int, help="default 15"))
    clock: str = field(default="cpu", metadata=flag(choices=tuple(CLOCKS), help="cpu (default): process time, robust on a shared machine; wall: elapsed time"))
    json: str = field(default=DEFAULT_JSON, metadata=flag(help=f"where to write the results (default {DEFAULT_JSON})"))


def main(args: Config) -> int:
    if args.part in ("lookup", "all") and args.checkpoint is None and not args.train:
        raise ValueError("speculative: lookup needs `--checkpoint` or `--train` (or pass --part crossover)")
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads, "clock": args.clock,
                       "torch": torch.__version__}}
    if args.part in ("crossover", "all"):
        out["crossover"] = crossover(args.repeats)
    if args.part in ("lookup", "all"):
        ckpt = args.checkpoint
        if args.train:
            args.data = args.data or write_repeating_text("runs/specdec_repeat.txt")
            ckpt = _train("runs/specdec_repeat", args.data)
        out["lookup"] = lookup(ckpt, k=args.k, data=args.data)
    atomic_write_text(Path(args.json), json.dumps(out, indent=2) + "\n")
    return 0

