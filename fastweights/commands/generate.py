"""``fastweights generate``: continue a prompt with a trained model (constant memory for fast-weight mixers).

The prompt is encoded as the checkpoint was trained: UTF-8 bytes for text, or the
recall task's words (``"c 3 a 7 c 1 ? c"``). The prompt is prefilled once with the
chunk ops, then tokens are decoded one by one from the recurrent state.

Example::

    fastweights generate runs/text --prompt "The " --max-new-tokens 200 --temperature 0.8
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample a continuation of a prompt from a checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its latest checkpoint)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..training.checkpoint import load_model, tokenizer_of

    model, ckpt = load_model(args.checkpoint)
    encode, decode = tokenizer_of(ckpt)
    ids = encode(args.prompt)
    if not ids:
        raise ValueError("generate: `--prompt` is empty; give at least one token")
    prompt = torch.tensor(ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(args.seed)
    out, cache = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                generator=generator, return_cache=True)
    if (ckpt.train or {}).get("tokenizer") == "recall":  # words: show where the answer starts
        print(decode(out[: len(ids)]) + " -> " + decode(out[len(ids):]))
    else:
        print(decode(out))
    print(f"[{len(ids)} prompt + {args.max_new_tokens} new tokens; cache {cache.nbytes:,} bytes]")
    return 0
