"""``fastweights bench``: training speed of the delta rule's chunk path (``fastweights/bench/chunk_speed.py``);
``fastweights bench --lm``: the whole LM per mixer, training step and decoding step (``fastweights/bench/lm_speed.py``);
``fastweights bench --cpu-peers``: the gated delta rule against its CPU peers (``fastweights/bench/cpu_peers.py``)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from ..bench.chunk_speed import add_arguments
    from ..bench.lm_speed import add_arguments as add_lm_arguments

    p = sub.add_parser(
        "bench",
        help="time recurrent vs textbook chunk vs fast chunk delta rule (forward, forward+backward, memory); "
        "with --lm, the LM of each mixer (training step, decoding step); write JSON",
    )
    add_arguments(p)
    p.add_argument("--lm", action="store_true",
                   help="time the LM per mixer instead (fastweights/bench/lm_speed.py; JSON to docs/results/lm_speed.json)")
    add_lm_arguments(p, standalone=False)
    p.add_argument("--cpu-peers", action="store_true",
                   help="time the gated delta rule against what a CPU user would otherwise run (transformers, fla, "
                   "attn-gym where installed), prefill and decode, 1 and 2 threads (fastweights/bench/cpu_peers.py)")
    p.set_defaults(func=run)


# Flags that are sizes or counts: each must be >= 1 (negatives are refused by the parser).
POSITIVE = ("T", "batch", "heads", "head_dim", "chunk_size", "threads", "repeats", "recurrent_max_t", "piece",
            "long_tokens", "decode_steps", "real_prefill_max", "d_model", "layers", "lm_heads", "vocab")


def run(args) -> int:
    for name in POSITIVE:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v < 1:
                raise ValueError(f"bench: `--{name.replace('_', '-')}` must be >= 1, got {v}")
    if getattr(args, "cpu_peers", False):
        from ..bench.cpu_peers import main as run_peers

        return run_peers(["--repeats", str(args.repeats or 5)] + (["--json", args.json] if args.json else []))
    if args.lm:
        from ..bench.lm_speed import run as run_lm

        return run_lm(args)
    from ..bench.chunk_speed import run as run_chunk

    return run_chunk(args)
