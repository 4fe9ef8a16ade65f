"""``fastweights train``: train an LM on a text file or the built-in recall task.

The configuration is two checked dataclasses, :class:`~fastweights.models.LMConfig`
and :class:`~fastweights.training.TrainConfig`. Values come from, in order of
precedence: command-line flags (one per field, e.g. ``--d-model 64 --steps 500``),
a JSON file given with ``--config`` (``{"model": {...}, "train": {...}}``), the
defaults. ``--resume`` continues the run in ``--out`` from its latest checkpoint.

Examples::

    fastweights train --out runs/recall --mixer deltanet --steps 600
    fastweights train --out runs/text --data notes.txt --seq-len 128 --mixer gated_deltanet
    fastweights train --out runs/text --data notes.txt --val-data held_out.txt --precision bf16
    fastweights train --out runs/hybrid --data notes.txt --mixer '["deltanet", "softmax"]' --eval-tokens 20000
    fastweights train --out runs/recall --resume                  # after a crash or kill
    torchrun --nproc_per_node=2 -m fastweights.cli train --out runs/ddp --steps 100
    torchrun --nproc_per_node=4 -m fastweights.cli train --out runs/fsdp --fsdp --precision bf16
    torchrun --nproc_per_node=4 -m fastweights.cli train --out runs/cp --data notes.txt --seq-len 8192 --context-parallel 2
"""

from __future__ import annotations

import argparse

from ..config import add_config_arguments, overrides_from_args

# Model defaults of the command line (LMConfig's own defaults are for a larger model).
MODEL_DEFAULTS = {"d_model": 64, "n_layers": 2, "n_heads": 2, "mixer": "deltanet"}
# Fields of TrainConfig that may change when a run is resumed.
RESUMABLE = ("steps", "eval_every", "eval_batches", "eval_tokens", "save_every", "keep_checkpoints", "threads", "ddp_timeout",
             "context_parallel")
# What the help shows for the model fields this command fills in itself.
MODEL_HELP_DEFAULTS = {**MODEL_DEFAULTS, "vocab_size": "from the data (256 for text)", "max_seq_len": "max(seq_len, 64)"}


def add_parser(sub) -> None:
    from ..models import LMConfig
    from ..training.config import TrainConfig

    p = sub.add_parser("train", help="train an LM (text file or built-in recall task), with checkpoints and --resume",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help='JSON file {"model": {...}, "train": {...}}')
    p.add_argument("--out", metavar="DIR", help="run folder for checkpoints and metrics.jsonl")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run that --out holds (without it, or --resume, a used --out is refused)")
    p.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: continue even if --data/--val-data is not the file the run recorded "
                        "(another file, or the same path edited); refused without it")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar (auto: on a terminal and not under CI)")
    add_config_arguments(p, LMConfig, "model (LMConfig)", MODEL_HELP_DEFAULTS)
    add_config_arguments(p, TrainConfig, "training (TrainConfig)")
    p.set_defaults(func=run)


def build_configs(args):
    """(LMConfig, TrainConfig) from defaults, ``--config`` and the flags; resumes read the run's own."""
    from ..models import LMConfig
    from ..tasks import make_task
    from ..training import TrainConfig, load_config_file, load_resume_checkpoint

    model_flags = overrides_from_args(args, LMConfig)
    train_flags = overrides_from_args(args, TrainConfig)
    if args.resume:
        if not args.out:
            raise ValueError("train: --resume needs --out, the folder of the run to continue")
        # train.json checked against its schema; without `latest`, the newest checkpoint that verifies
        ckpt = load_resume_checkpoint(args.out)
        # a run saved before a TrainConfig field existed ran as its default (fp32, no --val-data)
        stored_model, stored_train = ckpt.config.to_dict(), {**TrainConfig().to_dict(), **ckpt.train["train_config"]}
        # Repeating the original command with --resume is fine; changing the run is not.
        changed = sorted(k for k, v in model_flags.items() if stored_model[k] != v)
        changed += sorted(k for k, v in train_flags.items() if stored_train[k] != v and k not in RESUMABLE)
        if changed or args.config:
            raise ValueError(
                f"train: a resumed run keeps its model and training config; {changed or '--config'} would change it "
                f"(only {', '.join(RESUMABLE)} may differ)"
            )
        train_config = TrainConfig.from_dict({**stored_train, **train_flags}, source=f"{ckpt.path}/train.json")
        return ckpt.config, train_config
    model_file, train_file = load_config_file(args.config) if args.config else ({}, {})
    train_config = TrainConfig.from_dict({**train_file, **train_flags}, source=args.config or "flags")
    task = make_task(train_config)
    model_dict = {**MODEL_DEFAULTS, "vocab_size": task.vocab_size, "max_seq_len": max(task.seq_len, 64), **model_file, **model_flags}
    return LMConfig.from_dict(model_dict, source=args.config or "flags"), train_config


def run(args) -> int:
    import os
    import sys

    from ..training import DistributedTimeout, TrainingInterrupted, train

    model_config, train_config = build_configs(args)
    progress = {"auto": None, "on": True, "off": False}[args.progress]
    try:
        result = train(model_config, train_config, args.out, resume=args.resume, overwrite=args.overwrite,
                       progress=progress, allow_data_change=args.allow_data_change)
    except TrainingInterrupted as e:  # SIGINT/SIGTERM: saved, then 130/143 as a shell expects
        if os.environ.get("RANK", "0") == "0":  # the one that saved speaks for the job
            print(e, file=sys.stderr)
        return e.exit_code
    except DistributedTimeout as e:
        print(e, file=sys.stderr)
        return 1
    if result.history and result.rank == 0:  # a distributed run: rank 0 reports for every rank
        last = result.evals[-1] if result.evals else {}
        print(f"done: step {result.history[-1]['step']}, loss {result.history[-1]['loss']:.4f}"
              + (f", eval accuracy {last['eval_accuracy']:.3f}" if last else "")
              + (f"; checkpoint in {args.out}" if args.out else ""))
    return 0
