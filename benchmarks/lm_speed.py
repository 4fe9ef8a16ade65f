"""Speed of the whole LM per mixer: a training step and one decoding step, side by side in one run.

``fastweights bench --lm`` and ``python -m benchmarks.run lm_speed`` run :func:`main`. One
:class:`~fastweights.models.LM` per mixer (``deltanet``, ``gated_deltanet``,
``linear``, ``softmax``), all of the same shape (default d_model 128, 4 layers,
4 heads, vocabulary 256, fp32), is timed on:

- **train**: one training step, forward + cross-entropy + backward + ``AdamW.step``,
  at (T, B) = (256, 8), (2048, 1), (8192, 1);
- **realistic** (``--realistic``): one training step of a DeltaNet and a softmax LM
  at a realistic layer shape, d_model 1024, 8 heads of 128, (T, B) = (2048, 1), 2 layers
  (``REALISTIC``; softmax through ``F.scaled_dot_product_attention``, causal); behind a
  flag because it adds about a minute of CPU time (``--quick`` runs a tiny version);
- **decode**: one call ``model(token, cache)`` with a single new token after a
  context of 256, 4096 and 32768 tokens (B = 1, under ``no_grad``).

``clock`` (``--clock``): ``wall`` (default) times with ``time.perf_counter``; ``cpu``
with ``time.process_time``, the CPU time of the process (all its threads). On a shared,
oversubscribed machine wall time mostly measures the scheduler: a 2-thread step waits
at every parallel region for its second thread to be given a core, so a mixer of many
small ops (the chunk form) is slowed far more than one of a few large matmuls. With
``--threads 1 --clock cpu`` each step's time is the work it did, whatever the load.

Every measurement is interleaved: each repeat times every mixer once before the
next repeat starts, so a noisy shared machine disturbs all contenders alike;
the table reports the minimum (and median) over the repeats, tokens/s from the
minimum, and the ratio of each mixer's minimum time to softmax's in the same run
(below 1: faster than softmax).

The decoding context is made by a real prefill (``model(prompt)``, the chunk
form) for every fast-weight mixer at every length; their state has the same size
whatever the context, which is what the decode row shows. Softmax is prefilled
for real up to ``real_prefill_max`` tokens (4096 by default); beyond that its KV
cache is the real prefill's rows followed by random rows up to the context
length, because a quadratic 32768-token prefill would take minutes here and the
cost of a decoding step depends only on the cache's size, not on its contents.
Each decode row times ``decode_steps`` consecutive single-token steps per repeat
(continuing from the previous repeat's cache, after two warm-up steps, which
include any one-off growth of the cache), and reports per-step times.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from fastweights import tune_cpu_allocator
from fastweights.config import atomic_write_text, flag

MIXERS = ("deltanet", "gated_deltanet", "kda", "linear", "softmax")
TRAIN_SHAPES = ((256, 8), (2048, 1), (8192, 1))  # (T, B)
DECODE_CONTEXTS = (256, 4096, 32768)
QUICK_TRAIN_SHAPES = ((64, 2), (128, 1))
QUICK_DECODE_CONTEXTS = (32, 128)
DEFAULT_JSON = "docs/results/lm_speed.json"
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}

#: The targets: time ratio DeltaNet / softmax (<=), and flatness of every
#: fast-weight mixer's decode step (time at the longest context / at the shortest, <=).
TRAIN_TARGETS = {256: 1.1, 2048: 0.6}
#: The realistic row: the LM's shape and the one target, DeltaNet / softmax <= 1.
REALISTIC = dict(d_model=1024, n_heads=8, n_layers=2, T=2048, B=1)
QUICK_REALISTIC = dict(d_model=32, n_heads=2, n_layers=1, T=64, B=1)
REALISTIC_MIXERS = ("deltanet", "softmax")
REALISTIC_TARGET = 1.0
DECODE_TARGETS = {256: 1.0, 4096: 0.5}
FLAT_DECODE = 1.25


def make_model(mixer: str, d_model: int, n_layers: int, n_heads: int, vocab: int, max_len: int, seed: int = 0):
    from fastweights.models import LM, LMConfig

    torch.manual_seed(seed)
    config = LMConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, mixer=mixer, max_seq_len=max_len)
    return LM(config)


def train_step(model, optimizer, ids: torch.Tensor) -> float:
    """One step on ``ids (B, T + 1)``: next-token cross-entropy, backward, AdamW. Returns the loss."""
    logits, _ = model(ids[:, :-1], return_cache=False)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def decode_context(model, length: int, real_prefill_max: int, gen: torch.Generator):
    """An :class:`~fastweights.models.LMCache` after ``length`` tokens of batch 1 (see the module docstring)."""
    from fastweights.ops import KVCache

    vocab = model.config.vocab_size
    softmax = "softmax" in model.config.mixers
    real = min(length, real_prefill_max) if softmax else length
    _, cache = model(torch.randint(0, vocab, (1, real), generator=gen))
    if real < length:
        for i, state in enumerate(cache.states):
            if isinstance(state, KVCache):
                extra = length - real
                shape = state.keys.shape[:2]
                keys = torch.cat([state.keys, torch.randn(*shape, extra, state.keys.shape[-1], generator=gen)], dim=2)
                values = torch.cat([state.values, torch.randn(*shape, extra, state.values.shape[-1], generator=gen)], dim=2)
                cache.states[i] = KVCache(keys, values, state.lengths + extra)
        cache.length = length
    return cache


def _row_stats(times: List[float]) -> Dict:
    return dict(repeats=len(times), ms_min=1e3 * min(times), ms_median=1e3 * statistics.median(times))


def time_train(models, shapes, repeats: int, gen: torch.Generator, log, clock=time.perf_counter,
               label: str = "train") -> List[Dict]:
    rows = []
    optimizers = {m: torch.optim.AdamW(model.parameters(), lr=1e-4) for m, model in models.items()}
    for T, B in shapes:
        ids = torch.randint(0, next(iter(models.values())).config.vocab_size, (B, T + 1), generator=gen)
        for m, model in models.items():  # warm-up: lazy state, allocator, AdamW's moments
            train_step(model, optimizers[m], ids)
        times = {m: [] for m in models}
        for _ in range(repeats):
            for m, model in models.items():
                t0 = clock()
                train_step(model, optimizers[m], ids)
                times[m].append(clock() - t0)
        for m in models:
            row = dict(mixer=m, T=T, B=B, **_row_stats(times[m]))
            row["tokens_per_s"] = B * T / (row["ms_min"] / 1e3)
            rows.append(row)
        log(f"  {label} T={T} B={B}: " + ", ".join(f"{m} {1e3 * min(times[m]):.1f} ms" for m in models))
    return rows


@torch.no_grad()
def time_decode(models, contexts, repeats: int, steps: int, real_prefill_max: int, gen: torch.Generator, log,
                clock=time.perf_counter) -> List[Dict]:
    rows = []
    for length in contexts:
        caches, tokens = {}, {}
        for m, model in models.items():
            cache = decode_context(model, length, real_prefill_max, gen)
            token = torch.randint(0, model.config.vocab_size, (1, 1), generator=gen)
            for _ in range(2):  # warm-up (and any one-off growth of a cache)
                _, cache = model(token, cache)
            caches[m], tokens[m] = cache, token
        times = {m: [] for m in models}
        for _ in range(repeats):
            for m, model in models.items():
                cache, token = caches[m], tokens[m]
                for _ in range(steps):
                    t0 = clock()
                    _, cache = model(token, cache)
                    times[m].append(clock() - t0)
                caches[m] = cache
        for m in models:
            row = dict(mixer=m, context=length, steps=len(times[m]), **_row_stats(times[m]))
            row["tokens_per_s"] = 1.0 / (row["ms_min"] / 1e3)
            row["cache_bytes"] = caches[m].nbytes
            rows.append(row)
        caches.clear()
        log(f"  decode after {length}: " + ", ".join(f"{m} {1e3 * min(times[m]):.2f} ms" for m in models))
    return rows


def _load_average() -> Optional[List[float]]:
    """The 1, 5 and 15 minute load averages (None where the OS has none): how busy the machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def add_ratios(rows: List[Dict], key: str) -> None:
    """``ratio_to_softmax``: each row's minimum time over softmax's at the same ``key`` value."""
    base = {r[key]: r["ms_min"] for r in rows if r["mixer"] == "softmax"}
    for r in rows:
        b = base.get(r[key])
        r["ratio_to_softmax"] = None if b is None else r["ms_min"] / b


def time_realistic(shape: Dict, vocab: int, repeats: int, gen: torch.Generator, log, clock=time.perf_counter) -> List[Dict]:
    """The realistic row: a training step of each of ``REALISTIC_MIXERS`` at ``shape`` (keys as ``REALISTIC``),
    interleaved like :func:`time_train`; rows carry the shape and ``ratio_to_softmax``."""
    models = {m: make_model(m, shape["d_model"], shape["n_layers"], shape["n_heads"], vocab, shape["T"])
              for m in REALISTIC_MIXERS}
    rows = time_train(models, [(shape["T"], shape["B"])], repeats, gen, log, clock, label="realistic")
    for r in rows:
        r.update(d_model=shape["d_model"], n_heads=shape["n_heads"], head_dim=shape["d_model"] // shape["n_heads"],
                 n_layers=shape["n_layers"])
    add_ratios(rows, "T")
    return rows


def check_targets(train: List[Dict], decode: List[Dict], realistic: Sequence[Dict] = ()) -> List[Dict]:
    def ratio(rows, key, value, mixer="deltanet"):
        return next((r["ratio_to_softmax"] for r in rows if r["mixer"] == mixer and r[key] == value), None)

    out = []
    for T, want in TRAIN_TARGETS.items():
        got = ratio(train, "T", T)
        out.append(dict(target=f"train step deltanet/softmax at T={T}", want_at_most=want, got=got,
                        met=None if got is None else got <= want))
    for L, want in DECODE_TARGETS.items():
        got = ratio(decode, "context", L)
        out.append(dict(target=f"decode deltanet/softmax after {L} tokens", want_at_most=want, got=got,
                        met=None if got is None else got <= want))
    if realistic:
        r0 = realistic[0]
        got = ratio(realistic, "T", r0["T"])
        out.append(dict(target=f"realistic train step deltanet/softmax (d_model {r0['d_model']}, {r0['n_heads']} heads "
                               f"of {r0['head_dim']}, T={r0['T']} B={r0['B']})",
                        want_at_most=REALISTIC_TARGET, got=got, met=None if got is None else got <= REALISTIC_TARGET))
    contexts = sorted({r["context"] for r in decode})
    if len(contexts) >= 2:
        for m in sorted({r["mixer"] for r in decode} - {"softmax"}):
            t = {r["context"]: r["ms_min"] for r in decode if r["mixer"] == m}
            got = t[contexts[-1]] / t[contexts[0]]
            out.append(dict(target=f"decode {m} flat: time after {contexts[-1]} / after {contexts[0]}",
                            want_at_most=FLAT_DECODE, got=got, met=got <= FLAT_DECODE))
    return out


def print_table(meta: Dict, train: List[Dict], decode: List[Dict], targets: List[Dict],
                realistic: Sequence[Dict] = ()) -> None:
    print(f"\nLM speed: d_model {meta['d_model']}, {meta['n_layers']} layers, {meta['n_heads']} heads, vocab "
          f"{meta['vocab_size']}, {meta['dtype']}, {meta['threads']} threads, torch {meta['torch']}, {meta['device_name']}")
    print(f"{meta['clock']} clock; load average before {meta['load_average']}, after {meta.get('load_average_after')}")
    print("times: minimum over interleaved repeats (median in brackets); ratio = time / softmax's time, same run\n")
    head = f"{'':34} " + " ".join(f"{m:>22}" for m in MIXERS)
    print(head)
    print("-" * len(head))

    def cell(r):
        if r is None:
            return f"{'-':>22}"
        ratio = "" if r["ratio_to_softmax"] is None else f" {r['ratio_to_softmax']:.2f}x"
        return f"{r['ms_min']:>9.2f} ({r['ms_median']:.1f}){ratio:>7}"

    for T, B in sorted({(r["T"], r["B"]) for r in train}, key=lambda s: s[0]):
        by = {r["mixer"]: r for r in train if r["T"] == T}
        print(f"{f'train step ms, T={T} B={B}':34} " + " ".join(cell(by.get(m)) for m in MIXERS))
        print(f"{'  tokens/s':34} " + " ".join(f"{by[m]['tokens_per_s']:>22.0f}" if m in by else f"{'-':>22}" for m in MIXERS))
    for L in sorted({r["context"] for r in decode}):
        by = {r["mixer"]: r for r in decode if r["context"] == L}
        print(f"{f'decode ms, after {L} tokens':34} " + " ".join(cell(by.get(m)) for m in MIXERS))
        print(f"{'  tokens/s':34} " + " ".join(f"{by[m]['tokens_per_s']:>22.0f}" if m in by else f"{'-':>22}" for m in MIXERS))
    if realistic:
        r0, by = realistic[0], {r["mixer"]: r for r in realistic}
        label = f"realistic train ms, T={r0['T']} B={r0['B']}"
        print(f"{label:34} " + " ".join(cell(by.get(m)) for m in MIXERS))
        print(f"  (d_model {r0['d_model']}, {r0['n_heads']} heads of {r0['head_dim']}, {r0['n_layers']} layers)")
    print("\nTargets:")
    for t in targets:
        got = "n/a" if t["got"] is None else f"{t['got']:.2f}"
        verdict = "" if t["met"] is None else (" (met)" if t["met"] else " (MISSED)")
        print(f"  {t['target']}: want <= {t['want_at_most']:g}, got {got}{verdict}")


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run lm_speed`` (``fastweights bench --lm`` has them too)."""

    quick: bool = field(default=False, metadata=flag(
        action="store_true", help="a short run (T 64/128, contexts 32/128, one repeat): checks that everything runs, not speed"))
    realistic: bool = field(default=False, metadata=flag(
        action="store_true", help="also time the realistic row: DeltaNet and softmax LMs, d_model 1024, 8 heads of 128, 2 layers, "
        "train step at T=2048 B=1 (about a minute more; tiny with --quick)"))
    mixers: Tuple[str, ...] = field(default=tuple(MIXERS), metadata=flag(
        nargs="+", choices=MIXERS, parse=tuple, help="which LMs to time"))
    decode_steps: int = field(default=16, metadata=flag(type=int, help="single-token steps timed per repeat and mixer"))
    real_prefill_max: int = field(default=4096, metadata=flag(
        type=int, help="longest real softmax prefill; longer contexts get random cache rows (see the docstring)"))
    d_model: int = field(default=128, metadata=flag(type=int, help="default 128"))
    layers: int = field(default=4, metadata=flag(type=int, help="default 4"))
    lm_heads: int = field(default=4, metadata=flag(type=int, help="attention heads of the LM"))
    vocab: int = field(default=256, metadata=flag(type=int, help="default 256"))
    clock: str = field(default="wall", metadata=flag(
        choices=sorted(CLOCKS), help="wall: elapsed time; cpu: the process's CPU time (use with --threads 1 on a busy machine)"))
    threads: int = field(default=2, metadata=flag(type=int, help="torch.set_num_threads (reported)"))
    repeats: Optional[int] = field(default=None, metadata=flag(type=int, help="interleaved repeats (default 3; 1 with --quick)"))
    json: Optional[str] = field(default=None, metadata=flag(help=f"where to write the results (default {DEFAULT_JSON})"))
    default_allocator: bool = field(default=False, metadata=flag(
        action="store_true", help="leave glibc's malloc thresholds alone (by default they are raised: fastweights/training/allocator.py)"))


def main(args: Config, log=None) -> int:
    from .chunk_speed import _cpu_name

    log = log or (lambda s: print(s, file=sys.stderr))
    torch.set_num_threads(args.threads)
    tuned = False if args.default_allocator else tune_cpu_allocator()
    shapes: Sequence[Tuple[int, int]] = QUICK_TRAIN_SHAPES if args.quick else TRAIN_SHAPES
    contexts: Sequence[int] = QUICK_DECODE_CONTEXTS if args.quick else DECODE_CONTEXTS
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    steps = 2 if args.quick else args.decode_steps
    real_max = min(args.real_prefill_max, 64) if args.quick else args.real_prefill_max
    max_len = max([T for T, _ in shapes] + list(contexts))
    meta = dict(
        d_model=args.d_model, n_layers=args.layers, n_heads=args.lm_heads, vocab_size=args.vocab, dtype="float32",
        device="cpu", device_name=_cpu_name(), threads=torch.get_num_threads(), torch=torch.__version__,
        python=platform.python_version(), clock=args.clock, load_average=_load_average(), repeats=repeats,
        decode_steps_per_repeat=steps, quick=bool(args.quick),
        train_shapes=[dict(T=T, B=B) for T, B in shapes], decode_contexts=list(contexts),
        train_step="forward + cross-entropy + backward + AdamW.step (lr 1e-4), return_cache=False",
        decode_step="model(token, cache) with one new token, batch 1, under no_grad",
        softmax_context=f"real prefill up to {real_max} tokens, random KV rows beyond (decode cost depends only on the cache size)",
        fast_weight_context="real prefill of the whole context (chunk form)",
        ratio="minimum time of the mixer / minimum time of softmax, same run",
        allocator="glibc mmap/trim thresholds raised (fastweights/training/allocator.py)" if tuned else "default malloc settings",
        time_s=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    mixers = list(dict.fromkeys(args.mixers))
    models = {m: make_model(m, args.d_model, args.layers, args.lm_heads, args.vocab, max_len) for m in mixers}
    gen = torch.Generator().manual_seed(0)
    clock = CLOCKS[args.clock]
    train = time_train(models, shapes, repeats, gen, log, clock)
    decode = time_decode(models, contexts, repeats, steps, real_max, gen, log, clock)
    realistic: List[Dict] = []
    if args.realistic:
        shape = QUICK_REALISTIC if args.quick else REALISTIC
        meta["realistic_shape"] = dict(shape, mixers=list(REALISTIC_MIXERS), vocab_size=args.vocab)
        realistic = time_realistic(shape, args.vocab, repeats, gen, log, clock)
    meta["load_average_after"] = _load_average()
    add_ratios(train, "T")
    add_ratios(decode, "context")
    targets = check_targets(train, decode, realistic)
    print_table(meta, train, decode, targets, realistic)
    result = dict(meta=meta, train=train, decode=decode, targets=targets)
    if realistic:
        result["realistic"] = realistic
    if args.json != "":  # --json "" writes nothing
        path = Path(DEFAULT_JSON if args.json is None else args.json)
        atomic_write_text(path, json.dumps(result, indent=2))
        print(f"\nwrote {path}")
    return 0
