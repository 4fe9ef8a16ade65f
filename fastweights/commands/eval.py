"""``fastweights eval``: score a checkpoint on a text file (loss, bits per byte, perplexity).

Every token of the file after the first is predicted once, in consecutive windows of
``--seq-len`` tokens (default: the checkpoint's training ``seq_len``), with the context
of its own window. Reported:

- ``loss_nats``: mean next-token cross-entropy, in nats;
- ``bits_per_byte``: the same in bits per byte (byte-level checkpoints only: there
  one token is one byte, so it is ``loss_nats / ln 2``);
- ``perplexity``: ``exp(loss_nats)``.

Examples::

    fastweights eval runs/text --data held_out.txt
    fastweights eval runs/text/ckpt-000600 --data held_out.txt --tokens 100000 --json
"""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    from ..training.precision import PRECISIONS

    p = sub.add_parser("eval", help="score a checkpoint on a text file: loss (nats), bits per byte, perplexity",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its latest checkpoint)")
    p.add_argument("--data", required=True, metavar="FILE", help="the text file to score (read as bytes)")
    p.add_argument("--tokens", type=int, default=0, metavar="N",
                   help="score only the first N predicted tokens (default: 0, the whole file)")
    p.add_argument("--seq-len", type=int, default=None, metavar="L",
                   help="window length (default: the checkpoint's training seq_len, else 128)")
    p.add_argument("--batch-size", type=int, default=16, metavar="B", help="windows per forward pass (default: 16)")
    p.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                   help="autocast of the forward pass (default: fp32)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: 0, torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    threads = torch.get_num_threads()
    if args.threads < 0:
        raise ValueError(f"eval: `--threads` must be >= 0 (0: torch's choice), got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from ..training.evaluation import evaluate_file

        result = evaluate_file(args.checkpoint, args.data, tokens=args.tokens, seq_len=args.seq_len,
                               batch_size=args.batch_size, precision=args.precision)
    finally:
        torch.set_num_threads(threads)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"checkpoint     {result['checkpoint']}")
    print(f"data           {result['data']}: {result['bytes']:,} bytes, {result['tokens']:,} tokens scored "
          f"in windows of {result['seq_len']} ({result['precision']})")
    print(f"loss           {result['loss_nats']:.4f} nats/token")
    print(f"bits per byte  {result['bits_per_byte']:.4f}")
    print(f"perplexity     {result['perplexity']:.3f}")
    print(f"accuracy       {result['accuracy']:.3f} (next byte)")
    print(f"time           {result['seconds']:.2f} s, {result['tok_s']:,.0f} tok/s")
    return 0
