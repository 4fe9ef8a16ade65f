"""``fastweights bench``: the benchmarks of the repository (``benchmarks/`` beside the package), from
the command line: training speed of the delta rule's chunk path and the roofline (``chunk_speed``);
``--lm``: the whole LM per mixer, training step and decoding step (``lm_speed``); ``--cpu-peers``: the
gated delta rule against its CPU peers (``cpu_peers``). Each runs through the same registry as
``python -m benchmarks.run NAME``.

The benchmarks are not installed with the package (the wheel holds no benchmark code): from an
installed copy this command says where to find them."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

#: The checkout's root, when this package runs from one (it holds ``benchmarks/`` beside ``fastweights/``).
CHECKOUT = Path(__file__).resolve().parents[2]

MISSING = ("fastweights bench: the benchmarks are not part of the installed package; they live in benchmarks/ "
           "at the top of a checkout of the fastweights repository. From the checkout's root run "
           "`fastweights bench` or `python -m benchmarks.run NAME` (`python -m benchmarks.run --list` names them).")


def runner():
    """The benchmark runner (:mod:`benchmarks.run`) of the checkout this package runs from, or ``None``
    when there is none (an installed copy)."""
    if not (CHECKOUT / "benchmarks" / "__init__.py").is_file():
        return None
    if str(CHECKOUT) not in sys.path:
        sys.path.append(str(CHECKOUT))
    try:
        package = importlib.import_module("benchmarks")
    except ImportError:
        return None
    if not getattr(package, "FASTWEIGHTS_BENCHMARKS", False):  # another project's `benchmarks` came first
        return None
    return importlib.import_module("benchmarks.run")


def command_config(run):
    """The flags of ``fastweights bench``: those of ``chunk_speed``, then ``--lm`` and those of ``lm_speed``
    that ``chunk_speed`` lacks, then ``--cpu-peers`` (one dataclass, declared flags)."""
    chunk, lm = run.load("chunk_speed").Config, run.load("lm_speed").Config
    fields, seen = [], set()

    def copy(f):
        kw = {"default": f.default} if f.default_factory is dataclasses.MISSING else {"default_factory": f.default_factory}
        return (f.name, f.type, dataclasses.field(metadata=f.metadata, **kw))

    from ..config import flag

    for f in dataclasses.fields(chunk):
        fields.append(copy(f))
        seen.add(f.name)
    fields.append(("lm", bool, dataclasses.field(default=False, metadata=flag(
        action="store_true", help="time the LM per mixer instead (benchmarks/lm_speed.py; JSON to docs/results/lm_speed.json)"))))
    fields += [copy(f) for f in dataclasses.fields(lm) if f.name not in seen]
    fields.append(("cpu_peers", bool, dataclasses.field(default=False, metadata=flag(
        action="store_true", help="time the gated delta rule against what a CPU user would otherwise run (transformers, fla, "
        "attn-gym, SGLang's CPU kernel where installed), prefill and decode, fp32 and bf16 prefill, 1 and 2 threads "
        "(benchmarks/cpu_peers.py; its --load-library loads a peer's kernels built from source)"))))
    return dataclasses.make_dataclass("BenchCommand", fields)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time recurrent vs textbook chunk vs fast chunk delta rule (forward, forward+backward, memory); "
        "with --lm, the LM of each mixer (training step, decoding step); write JSON (needs a checkout: benchmarks/)",
    )
    run = runner()
    if run is None:  # an installed copy: any flags are answered with where the benchmarks are
        p.error = lambda message: p.exit(2, MISSING + "\n")
        p.set_defaults(func=missing)
        return
    from ..config import add_declared_arguments

    config = command_config(run)
    add_declared_arguments(p, config)
    p.set_defaults(func=lambda args: bench(run, config, args))


def missing(args) -> int:
    print(MISSING, file=sys.stderr)
    return 2


# Flags that are sizes or counts: each must be >= 1 (negatives are refused by the parser).
POSITIVE = ("T", "batch", "heads", "head_dim", "chunk_size", "threads", "repeats", "recurrent_max_t", "piece",
            "long_tokens", "decode_steps", "real_prefill_max", "d_model", "layers", "lm_heads", "vocab")


def bench(run, config, args) -> int:
    from ..config import config_from_declared

    options = config_from_declared(args, config)
    for name in POSITIVE:
        value = getattr(options, name, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and v < 1:
                raise ValueError(f"bench: `--{name.replace('_', '-')}` must be >= 1, got {v}")

    def pick(name):  # the benchmark's own Config, from the command's values
        cls = run.load(name).Config
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})

    if options.cpu_peers:
        peers = dataclasses.replace(run.load("cpu_peers").Config(), repeats=options.repeats or 5)
        if options.json:
            peers = dataclasses.replace(peers, json=options.json)
        return run.run("cpu_peers", peers)
    if options.lm:
        return run.run("lm_speed", pick("lm_speed"))
    return run.run("chunk_speed", pick("chunk_speed"))
