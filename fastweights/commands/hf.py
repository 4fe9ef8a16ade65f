"""``fastweights hf``: convert between a training checkpoint and a transformers folder.

    fastweights hf export runs/recall hf/recall      # checkpoint (or run folder) -> transformers
    fastweights hf import hf/recall ckpt/recall      # transformers folder -> checkpoint

The transformers folder loads with ``AutoModelForCausalLM.from_pretrained`` after
``import fastweights.hf``; the checkpoint with ``fastweights generate``. Needs the
``hf`` extra (transformers).

Both write only into a new or empty folder, or one they wrote before (a marker file
``.fastweights-output.json`` listing its files); any other folder is refused unless
``--overwrite`` is given. A folder that is, or holds, the source or the current
directory is refused even then.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("hf", help="convert a checkpoint to a transformers folder and back",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    e = actions.add_parser("export", help="checkpoint (or run folder) -> transformers folder")
    e.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its latest checkpoint)")
    e.add_argument("out", help="the transformers folder to write (new, empty, or an earlier output)")
    e.add_argument("--overwrite", action="store_true", help="replace OUT even if it holds other files")
    i = actions.add_parser("import", help="transformers folder -> checkpoint folder")
    i.add_argument("hf_dir", help="a folder written by save_pretrained of FastWeightsForCausalLM")
    i.add_argument("out", help="the checkpoint folder to write (new, empty, or an earlier output)")
    i.add_argument("--overwrite", action="store_true", help="replace OUT even if it holds other files")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        from .. import hf
    except ImportError as e:
        raise ValueError(str(e)) from None
    if args.action == "export":
        out = hf.checkpoint_to_hf(args.checkpoint, args.out, overwrite=args.overwrite)
    else:
        out = hf.hf_to_checkpoint(args.hf_dir, args.out, overwrite=args.overwrite)
    print(out)
    return 0
