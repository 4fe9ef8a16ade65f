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
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the text to continue (UTF-8)")
    source.add_argument("--prompt-file", metavar="FILE",
                        help="read the prompt from FILE: its raw bytes for a byte-level model (any bytes, not only "
                             "UTF-8), UTF-8 text for the recall task's words")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-lookup", type=int, default=None, metavar="K",
                   help="greedy speculative decoding: propose up to K tokens per round by prompt lookup "
                        "(same tokens as greedy, fewer forwards when the text repeats itself); needs --temperature 0")
    p.add_argument("--draft", default=None, metavar="CKPT",
                   help="greedy speculative decoding with a smaller draft model (a checkpoint or run folder of the "
                        "same vocabulary) proposing 4 tokens per round; needs --temperature 0")
    p.set_defaults(func=run)


def prompt_ids(args, encode, tokenizer: str) -> list:
    """The prompt's token ids, from ``--prompt`` (text) or ``--prompt-file`` (bytes).

    A command-line argument that is not UTF-8 reaches Python with its bad bytes as lone surrogates
    (``'\\udcc3'``), which no text tokenizer can encode: that is refused in one line pointing at
    ``--prompt-file``, which hands a byte-level model the file's bytes exactly."""
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(f"generate: `--prompt-file` {args.prompt_file!r} cannot be read: {e.strerror or e}") from None
        if tokenizer == "bytes":
            return list(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"generate: `--prompt-file` {args.prompt_file!r} is not UTF-8 text (byte 0x{data[e.start]:02x} "
                             f"at offset {e.start}); this model's tokenizer ({tokenizer}) reads words, not raw bytes") from None
        return encode(text)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = args.prompt[e.start]
        shown = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character {bad!r}"
        raise ValueError(f"generate: `--prompt` is not valid UTF-8 ({shown} at position {e.start}); to pass raw bytes, "
                         f"write them to a file and use `--prompt-file FILE`") from None
    return encode(args.prompt)


def run(args) -> int:
    import torch

    from ..io.checkpoint import load_model
    from ..training.train_state import tokenizer_of

    if args.prompt_lookup is not None and args.draft is not None:
        raise ValueError("generate: give `--prompt-lookup` or `--draft`, not both")
    if args.prompt_lookup is not None and args.prompt_lookup < 1:
        raise ValueError(f"generate: `--prompt-lookup` must be an int >= 1 (tokens proposed per round), got {args.prompt_lookup}")
    speculative = args.prompt_lookup is not None or args.draft is not None
    if speculative and args.temperature != 0:
        raise ValueError(f"generate: `--prompt-lookup`/`--draft` decode greedily; pass `--temperature 0`, got {args.temperature}")
    model, ckpt = load_model(args.checkpoint)
    draft = None
    if args.draft is not None:
        draft, _ = load_model(args.draft)
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"generate: the `--draft` model's vocab_size {draft.config.vocab_size} differs from the "
                             f"model's {model.config.vocab_size}; it must propose the same tokens")
    encode, decode = tokenizer_of(ckpt)
    ids = prompt_ids(args, encode, (ckpt.train or {}).get("tokenizer", "bytes"))
    if not ids:
        flag = "--prompt-file" if args.prompt_file is not None else "--prompt"
        raise ValueError(f"generate: `{flag}` is empty; give at least one token")
    prompt = torch.tensor(ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(args.seed)
    out, cache = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                generator=generator, return_cache=True, prompt_lookup=args.prompt_lookup, draft=draft)
    if (ckpt.train or {}).get("tokenizer") == "recall":  # words: show where the answer starts
        print(decode(out[: len(ids)]) + " -> " + decode(out[len(ids):]))
    else:
        print(decode(out))
    print(f"[{len(ids)} prompt + {args.max_new_tokens} new tokens; cache {cache.nbytes:,} bytes]")
    return 0
