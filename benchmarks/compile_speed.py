"""torch.compile on the CPU: the training step of a small LM, eager vs inductor, and graph-break counts.

Usage (repository root)::

    python -m benchmarks.run compile_speed                    # DeltaNet LM, d_model 128, 4 layers, B=8, T=256, 1 thread
    python -m benchmarks.run compile_speed --mixer hybrid     # deltanet / gated_deltanet / linear / softmax layers
    python -m benchmarks.run compile_speed --breaks-only      # only the graph-break table (no timing)

Speed. One training step is ``loss = cross_entropy(model(ids))``, ``loss.backward()``,
``AdamW.step()``, ``zero_grad()``. Two copies of the same model (same weights) run
it: one eager, one whose loss computation is ``torch.compile(..., backend="inductor",
fullgraph=True)`` (forward and backward compiled; the optimizer step stays eager in
both). The first compiled call (compilation) is timed on its own; then the two
steps alternate, ``--repeats`` times each, so a noisy shared machine slows both
alike. Reported: median and minimum ms per step, tokens/s, and the speed-up
eager / compiled (medians). The chunk ops are torch.library custom ops, opaque to
inductor: what inductor fuses is the rest (projections' epilogues, norms, the short
convolution, SwiGLU, the loss).

Graph breaks (``torch._dynamo.explain``): every op on a plain batch, on packed
sequences (``cu_seqlens``) without and with the ``max_seqlen`` hint, and the LM's
training forward (``return_cache=False``) on a batch, with a left-padded
``attention_mask``, and with model-level ``cu_seqlens`` without and with
``max_seqlen``; plus whether ``torch.compile(fullgraph=True, backend="aot_eager")`` runs
the op forward and backward ("ok", or the error). The script runs on older
versions of the package too (arguments they lack are reported as "n/a"), which is
how the "before" column of the issue's report was measured.

Writes ``docs/results/compile_speed.json`` (``--out``); ``--breaks-only`` replaces
only its graph-break table (``graph_breaks_meta`` then says when and how that was measured)
and keeps the timings of the last full run.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F

from fastweights import ops
from fastweights.config import atomic_write_text, flag
from fastweights.models import LM, LMConfig

HYBRID = ["deltanet", "gated_deltanet", "linear", "softmax"]
OPS = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_linear_attn", "recurrent_delta_rule",
       "recurrent_gated_delta_rule", "recurrent_linear_attn", "parallel_delta_rule", "softmax_attn")


# -- graph breaks -------------------------------------------------------------------------

def _op_call(name: str, packed: bool, hint: bool):
    """``(fn, inputs)``: one op on tiny inputs (B=2, T=24, or 3 sequences packed along T=24)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = (1, 24, 2, 8) if packed else (2, 24, 2, 8)
    x = {n: torch.randn(B, T, H, K, generator=gen, requires_grad=True) for n in "qkv"}
    extra = {}
    if "delta" in name:
        extra["beta"] = torch.rand(B, T, H, generator=gen).requires_grad_()
    if "gated" in name or "linear_attn" in name:
        extra["g"] = (-torch.rand(B, T, H, generator=gen)).requires_grad_()
    options = dict(output_final_state=True)
    if name.startswith("chunk_"):  # only the chunk forms have a chunk length
        options["chunk_size"] = 8
    if name.endswith("delta_rule") and not name.startswith("softmax"):
        options["qk_norm"] = "l2"
    if packed:
        options["cu_seqlens"] = torch.tensor([0, 5, 17, 24])
        if hint:
            options["max_seqlen"] = 12
    op = getattr(ops, name)

    def fn(inputs):
        o, h = op(**inputs, **options)
        h = h.keys if isinstance(h, ops.KVCache) else h
        return o.sum() + h.sum()

    return fn, {**x, **extra}


def _breaks(fn, *args) -> str:
    try:
        explanation = torch._dynamo.explain(fn)(*args)
    except TypeError as e:  # an argument this version does not have
        return "n/a" if "unexpected keyword" in str(e) else f"error: {str(e).splitlines()[0][:80]}"
    finally:
        torch._dynamo.reset()
    return str(explanation.graph_break_count)


def _aot_eager(fn, inputs) -> str:
    try:
        torch.compile(fn, backend="aot_eager", fullgraph=True)(inputs).backward()
        return "ok"
    except TypeError as e:
        if "unexpected keyword" in str(e):
            return "n/a"
        return f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
    except Exception as e:  # report whatever the compiler raised
        return f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
    finally:
        torch._dynamo.reset()


def graph_break_table():
    rows = []
    for name in OPS:
        for case, packed, hint in (("batch", False, False), ("cu_seqlens", True, False), ("cu_seqlens+max_seqlen", True, True)):
            fn, inputs = _op_call(name, packed, hint)
            rows.append(dict(what=name, case=case, graph_breaks=_breaks(fn, inputs), fullgraph_aot_eager=_aot_eager(fn, inputs)))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :7] = 0  # row 0 left-padded by 7
    lm_cases = {  # case -> (ids, forward keywords); training calls (return_cache=False)
        "forward": ((2, 40), {}),
        "attention_mask": ((2, 40), dict(attention_mask=mask)),
        "cu_seqlens": ((1, 40), dict(cu_seqlens=torch.tensor([0, 13, 40]))),
        "cu_seqlens+max_seqlen": ((1, 40), dict(cu_seqlens=torch.tensor([0, 13, 40]), max_seqlen=27)),
    }
    for mixer in ("deltanet", "hybrid"):
        model = _model(mixer, d_model=32, layers=4, heads=2, chunk_size=16)
        for case, (shape, kwargs) in lm_cases.items():
            ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(0))
            fn = (lambda i, kw=kwargs: model(i, return_cache=False, **kw)[0].float().sum())
            rows.append(dict(what=f"LM ({mixer})", case=case, graph_breaks=_breaks(fn, ids),
                             fullgraph_aot_eager=_aot_eager(fn, ids)))
    return rows


# -- speed --------------------------------------------------------------------------------

def _model(mixer: str, d_model: int, layers: int, heads: int, chunk_size: int) -> LM:
    mixers = (HYBRID * layers)[:layers] if mixer == "hybrid" else mixer
    return LM(LMConfig(vocab_size=256, d_model=d_model, n_layers=layers, n_heads=heads, mixer=mixers,
                       chunk_size=chunk_size, max_seq_len=4096))


def _loss(model, ids):
    logits, _ = model(ids[:, :-1], return_cache=False)
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def speed(args) -> dict:
    torch.manual_seed(0)
    eager = _model(args.mixer, args.d_model, args.layers, args.heads, args.chunk_size)
    compiled = _model(args.mixer, args.d_model, args.layers, args.heads, args.chunk_size)
    compiled.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    compiled_loss = torch.compile(_loss, backend="inductor", fullgraph=True)
    contenders = {
        "eager": (eager, _loss, torch.optim.AdamW(eager.parameters(), lr=1e-3)),
        "inductor": (compiled, compiled_loss, torch.optim.AdamW(compiled.parameters(), lr=1e-3)),
    }

    def step(name):
        model, loss_fn, opt = contenders[name]
        t0 = time.perf_counter()
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss.item()

    first = {name: step(name) for name in contenders}  # compilation happens in the inductor's first call
    print(f"first step: eager {first['eager'][0] * 1e3:.0f} ms, inductor {first['inductor'][0]:.1f} s (compilation); "
          f"losses {first['eager'][1]:.5f} / {first['inductor'][1]:.5f}")
    for _ in range(args.warmup):
        for name in contenders:
            step(name)
    times = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name in contenders:
            times[name].append(step(name)[0])
    tokens = args.batch * args.seq_len
    rows = {}
    for name, ts in times.items():
        rows[name] = dict(ms_median=statistics.median(ts) * 1e3, ms_min=min(ts) * 1e3,
                          tokens_per_s=tokens / statistics.median(ts))
    rows["inductor"]["compile_s"] = first["inductor"][0]
    return dict(rows=rows, speedup_median=rows["eager"]["ms_median"] / rows["inductor"]["ms_median"],
                speedup_min=rows["eager"]["ms_min"] / rows["inductor"]["ms_min"],
                first_losses=[first["eager"][1], first["inductor"][1]])


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run compile_speed``."""

    mixer: str = field(default="deltanet", metadata=flag(help="deltanet, gated_deltanet, linear, softmax or hybrid (default deltanet)"))
    d_model: int = field(default=128, metadata=flag(type=int, help="default 128"))
    layers: int = field(default=4, metadata=flag(type=int, help="default 4"))
    heads: int = field(default=4, metadata=flag(type=int, help="default 4 (head size 32)"))
    chunk_size: int = field(default=64, metadata=flag(type=int, help="default 64"))
    batch: int = field(default=8, metadata=flag(type=int, help="B, default 8"))
    seq_len: int = field(default=256, metadata=flag(type=int, help="T, default 256"))
    threads: int = field(default=1, metadata=flag(type=int, help="torch.set_num_threads, default 1 (on a shared, loaded machine more threads spin)"))
    repeats: int = field(default=10, metadata=flag(type=int, help="timed steps per contender, default 10"))
    warmup: int = field(default=2, metadata=flag(type=int, help="untimed steps per contender after the first, default 2"))
    breaks_only: bool = field(default=False, metadata=flag(action="store_true", help="only the graph-break table"))
    out: str = field(default="docs/results/compile_speed.json", metadata=flag(help="the JSON file (default docs/results/compile_speed.json)"))


def main(args: Config) -> int:
    torch.set_num_threads(args.threads)
    meta = dict(torch=torch.__version__, python=platform.python_version(), threads=torch.get_num_threads(),
                machine=platform.machine(), dtype="float32", device="cpu")
    result = dict(meta=meta, config=vars(args))

    table = graph_break_table()
    print("\nGraph breaks (torch._dynamo.explain) and fullgraph aot_eager forward+backward")
    print(f"{'what':28s} {'case':24s} {'breaks':>6s}  aot_eager fullgraph")
    for r in table:
        print(f"{r['what']:28s} {r['case']:24s} {r['graph_breaks']:>6s}  {r['fullgraph_aot_eager']}")
    result["graph_breaks"] = table
    out = Path(args.out)
    if args.breaks_only and out.exists():  # keep the timings of the last full run
        previous = json.loads(out.read_text())
        if "speed" in previous:
            result = dict(previous, graph_breaks=table, graph_breaks_meta=meta)

    if not args.breaks_only:
        shape = f"{args.mixer} LM, d_model {args.d_model}, {args.layers} layers, {args.heads} heads, B={args.batch}, T={args.seq_len}"
        print(f"\nTraining step (forward, backward, AdamW), fp32 on the CPU, {args.threads} threads: {shape}")
        s = speed(args)
        print(f"{'':10s} {'ms median':>10s} {'ms min':>8s} {'tokens/s':>10s}")
        for name, r in s["rows"].items():
            print(f"{name:10s} {r['ms_median']:10.1f} {r['ms_min']:8.1f} {r['tokens_per_s']:10.0f}")
        print(f"inductor speed-up (eager / inductor): {s['speedup_median']:.2f}x median, {s['speedup_min']:.2f}x min; "
              f"compilation {s['rows']['inductor']['compile_s']:.1f} s")
        result["speed"] = dict(shape=shape, **s)

    atomic_write_text(out, json.dumps(result, indent=2, default=str))
    print(f"\nwrote {out}")
    return 0

