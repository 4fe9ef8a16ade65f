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
import math
import time


def add_parser(sub) -> None:
    from ..train import PRECISIONS

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


def evaluate_file(checkpoint: str, data: str, *, tokens: int = 0, seq_len=None, batch_size: int = 16,
                  precision: str = "fp32") -> dict:
    """The numbers ``fastweights eval`` prints, as a dict (see the module docstring)."""
    import torch

    from ..checkpoint import load_model
    from ..tasks.text import read_bytes
    from ..train import check_precision, evaluate_tokens

    for name, value, low in (("--tokens", tokens, 0), ("--batch-size", batch_size, 1), ("--seq-len", seq_len, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"eval: `{name}` must be an int >= {low}, got {value!r}")
    model, ckpt = load_model(checkpoint)
    if precision != "fp32" and next(model.parameters()).dtype != torch.float32:
        raise ValueError(f"eval: --precision {precision} autocasts float32 weights; this checkpoint's are "
                         f"{next(model.parameters()).dtype}; use --precision fp32")
    check_precision(precision, next(model.parameters()).device)
    train = ckpt.train or {}
    tokenizer = train.get("tokenizer", "bytes" if ckpt.config.vocab_size == 256 else None)
    if tokenizer != "bytes":
        raise ValueError(f"eval: {ckpt.path} was not trained on byte-level text (tokenizer {tokenizer!r}); "
                         f"`fastweights eval` scores byte-level checkpoints on a text file")
    if seq_len is None:
        seq_len = int(train.get("train_config", {}).get("seq_len", 128))
    if model.has_softmax and seq_len > model.config.max_seq_len:
        raise ValueError(f"eval: --seq-len {seq_len} is longer than the model's `max_seq_len`={model.config.max_seq_len}")
    ids, name = read_bytes(data, "--data")
    if len(ids) < 2:
        raise ValueError(f"eval: --data {name!r} has {len(ids)} byte(s); at least 2 are needed to score one prediction")
    t0 = time.perf_counter()
    # only the tokens scored are read from the (memory-mapped) file
    r = evaluate_tokens(model, ids[: tokens + 1] if tokens else ids, seq_len, batch_size, precision, tokens)
    seconds = time.perf_counter() - t0
    return {
        "checkpoint": ckpt.path, "data": name, "bytes": len(ids), "tokens": r["tokens"], "seq_len": seq_len,
        "precision": precision, "loss_nats": r["loss"], "bits_per_byte": r["loss"] / math.log(2),
        "perplexity": math.exp(r["loss"]), "accuracy": r["accuracy"], "seconds": round(seconds, 3),
        "tok_s": round(r["tokens"] / max(seconds, 1e-9), 1),
    }


def run(args) -> int:
    import torch

    threads = torch.get_num_threads()
    if args.threads < 0:
        raise ValueError(f"eval: `--threads` must be >= 0 (0: torch's choice), got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
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
