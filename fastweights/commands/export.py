"""``fastweights export``: a run's model as one safetensors file.

The file holds the weights, the model config and a SHA-256 of the tensors; ``generate``,
``eval`` and ``hf convert`` take it where they take a checkpoint folder. The source is a
run folder (its latest checkpoint), or a checkpoint folder, written by one process, by
data-parallel processes, or sharded by an FSDP run (``train --fsdp``: its shards are
reassembled here, in one process).

Examples::

    fastweights export runs/fsdp --out model.safetensors
    fastweights generate model.safetensors --prompt "the "
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run's (or checkpoint's) model as one safetensors file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="run folder, checkpoint folder (single-process or sharded), or model file")
    p.add_argument("--out", metavar="FILE", required=True, help="the .safetensors file to write (a temp file, then a rename); an existing file is "
                        "kept unless --overwrite; a path inside a checkpoint folder is refused")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (never a checkpoint's own file)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default=None,
                   help="the weights' dtype in the file (default: as saved)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..io.checkpoint import export_model

    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    path = export_model(args.run, args.out, dtype, overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0
