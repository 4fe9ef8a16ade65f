"""Evaluation: next-token loss and accuracy on held-out data, of a model in memory or a checkpoint file."""

from __future__ import annotations

import math
import time
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..config import check_int
from ..models import LM
from ..tasks import IGNORE, ByteText
from ..tasks.adapters import step_generator
from .config import TrainConfig
from .precision import autocast

__all__ = ["evaluate", "evaluate_global", "evaluate_file", "evaluate_tokens", "split_accuracy", "token_losses"]


def token_losses(model: LM, inputs: torch.Tensor, targets: torch.Tensor, precision: str = "fp32", cp_group=None):
    """(sum of token cross-entropies, logits) over targets that are not ``IGNORE``; the forward
    pass runs under ``precision``'s autocast, the loss in fp32 (or the logits' wider dtype).
    ``cp_group``: the context-parallel group whose ranks hold the rows' other token slices."""
    with autocast(precision, inputs.device):
        logits, _ = model(inputs, return_cache=False, **({} if cp_group is None else {"cp_group": cp_group}))
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss_sum, logits


def _score(model, inputs, targets, precision, totals) -> None:
    s, logits = token_losses(model, inputs, targets, precision)
    keep = targets != IGNORE
    totals[0] += float(s)
    totals[1] += int(((logits.argmax(-1) == targets) & keep).sum())
    totals[2] += int(keep.sum())


@torch.no_grad()
def evaluate_tokens(
    model: LM, tokens: torch.Tensor, seq_len: int, batch_size: int, precision: str = "fp32", max_tokens: int = 0,
    share: Tuple[int, int] = (0, 1),
) -> Dict[str, float]:
    """Next-token loss over a token stream, every token scored once.

    ``tokens [N]`` is cut into consecutive windows of ``seq_len + 1`` tokens that overlap by
    one (window i reads tokens ``[i·L, (i+1)·L)`` and predicts ``[i·L + 1, (i+1)·L]``), so
    each of the ``N − 1`` predicted tokens is scored exactly once, with the context of its
    own window; the last window may be shorter. ``max_tokens`` > 0 scores only the first
    that many predictions. ``tokens`` may be a memory-mapped ``uint8`` file
    (:func:`~fastweights.tasks.text.read_bytes`): each batch of windows is converted to
    int64 on its own, so memory does not grow with the stream.

    ``share=(rank, world)``: a collective of ``world`` processes; this one scores every
    world-th batch of windows (from its ``rank``-th) and the sums are all-reduced, so every rank
    returns the figures of the whole stream.

    Returns ``{"loss": mean nats per token, "accuracy", "tokens": how many were scored}``.
    """
    n = len(tokens) - 1 if not max_tokens else min(len(tokens) - 1, max_tokens)
    if n < 1:
        raise ValueError(f"evaluate_tokens: the data has {len(tokens)} token(s); at least 2 are needed to score one prediction")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    full = n // seq_len
    totals = [0.0, 0, 0]

    def window(a: int, b: int) -> torch.Tensor:  # tokens [a, b) as int64 on the model's device: a copy of b - a
        return tokens[a:b].to(device=device, dtype=torch.long)

    for j, i in enumerate(range(0, full, batch_size)):
        if j % share[1] != share[0]:
            continue
        rows = min(batch_size, full - i)
        a, b = i * seq_len, (i + rows) * seq_len
        _score(model, window(a, b).view(rows, seq_len), window(a + 1, b + 1).view(rows, seq_len), precision, totals)
    if n > full * seq_len and -(-full // batch_size) % share[1] == share[0]:  # the last, shorter window
        a = full * seq_len
        _score(model, window(a, n)[None], window(a + 1, n + 1)[None], precision, totals)
    model.train(was_training)
    totals = _sum_over_ranks(totals, share)
    return {"loss": totals[0] / totals[2], "accuracy": totals[1] / totals[2], "tokens": totals[2]}


def _sum_over_ranks(totals, share: Tuple[int, int]):
    """``[loss sum, hits, tokens]`` summed over the ``share[1]`` ranks (as they are for one rank)."""
    if share[1] == 1:
        return totals
    from .distributed import all_reduce_

    t = torch.tensor([float(totals[0]), float(totals[1]), float(totals[2])], dtype=torch.float64)
    all_reduce_([t])
    return [float(t[0]), int(t[1]), int(t[2])]


@torch.no_grad()
def evaluate(model: LM, task, config: TrainConfig, batches: Optional[int] = None,
             share: Tuple[int, int] = (0, 1)) -> Dict[str, float]:
    """Loss and next-token accuracy on held-out data (the same data at every call).

    Text: the first ``eval_tokens`` tokens of the held-out text, every one scored once
    (:func:`evaluate_tokens`), also as bits per byte. Recall: ``eval_batches`` batches.
    ``share=(rank, world)``: a collective; each rank scores its share of the batches and every
    rank returns the figures of them all (see :func:`evaluate_global`).
    """
    if isinstance(task, ByteText):
        r = evaluate_tokens(model, task.val, config.seq_len, config.batch_size, config.precision, config.eval_tokens,
                            share=share)
        return {"eval_loss": r["loss"], "eval_accuracy": r["accuracy"], "eval_bpb": r["loss"] / math.log(2),
                "eval_tokens": r["tokens"]}
    was_training = model.training
    model.eval()
    totals = [0.0, 0, 0]
    for i in range(batches or config.eval_batches):
        if i % share[1] != share[0]:
            continue
        inputs, targets = task.sample(config.batch_size, step_generator(config.seed, i, stream=1), split="val")
        _score(model, inputs, targets, config.precision, totals)
    model.train(was_training)
    totals = _sum_over_ranks(totals, share)
    return {"eval_loss": totals[0] / max(totals[2], 1), "eval_accuracy": totals[1] / max(totals[2], 1)}


def evaluate_global(model: LM, task, config: TrainConfig, rank: int = 0, world: int = 1,
                    fsdp: bool = False) -> Dict[str, float]:
    """:func:`evaluate` in a job of ``world`` processes (a collective): every rank returns the same
    figures, those of the whole held-out set, so what rank 0 prints and records is the global one.

    Data (and context) parallel: each rank scores every world-th batch of the held-out windows,
    whole sequences, and the sums of losses, hits and tokens are all-reduced. FSDP: a sharded
    model's every forward needs every rank, so all ranks score all the windows, and rank 0's
    figures are shared (all ranks hold the same model, so they agree up to rounding)."""
    if world == 1:
        return evaluate(model, task, config)
    if not fsdp:
        return evaluate(model, task, config, share=(rank, world))
    from .distributed import all_reduce_

    result = evaluate(model, task, config)
    keys = sorted(result)
    values = torch.tensor([float(result[k]) if rank == 0 else 0.0 for k in keys], dtype=torch.float64)
    all_reduce_([values])  # rank 0's figures on every rank
    return {k: (int(v) if isinstance(result[k], int) else float(v)) for k, v in zip(keys, values.tolist())}


def split_accuracy(model: LM, data, batches: int, seed: int):
    """Recall accuracy over fresh sequences of ``data`` (a :class:`~fastweights.tasks.adapters.RecallData`):
    ``({"all", "overwritten", "once"}: accuracy, how many queries)``; "overwritten" are the keys
    written more than once, "once" the others."""
    from ..tasks import recall_accuracy

    totals = {"all": [0, 0], "overwritten": [0, 0], "once": [0, 0]}
    with torch.no_grad():
        for i in range(batches):
            b = data.task.sample(64, step_generator(seed, i, stream=2))
            logits, _ = model(b.inputs, return_cache=False)
            for name, mask in (("all", None), ("overwritten", b.overwritten), ("once", ~b.overwritten)):
                c, n = recall_accuracy(logits, b.targets, mask)
                totals[name][0] += c
                totals[name][1] += n
    return {k: c / max(n, 1) for k, (c, n) in totals.items()}, totals["all"][1]


def evaluate_file(checkpoint: str, data: str, *, tokens: int = 0, seq_len=None, batch_size: int = 16,
                  precision: str = "fp32") -> dict:
    """Score a byte-level checkpoint on a text file: the numbers ``fastweights eval`` prints, as a dict.

    Every token of the file after the first is predicted once, in consecutive windows of
    ``seq_len`` tokens (default: the checkpoint's training ``seq_len``), with the context of
    its own window (:func:`evaluate_tokens`). Keys: ``checkpoint``, ``data``, ``bytes``,
    ``tokens`` (scored), ``seq_len``, ``precision``, ``loss_nats`` (mean next-token
    cross-entropy), ``bits_per_byte`` (``loss_nats / ln 2``: one token is one byte),
    ``perplexity`` (``exp(loss_nats)``), ``accuracy``, ``seconds``, ``tok_s``.
    """
    from ..tasks.text import read_bytes
    from ..io.checkpoint import load_model
    from .precision import check_precision

    for name, value, low in (("--tokens", tokens, 0), ("--batch-size", batch_size, 1), ("--seq-len", seq_len, 1)):
        check_int("eval", name, value, minimum=low, none_ok=True, what=f"an int >= {low}")
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
    r = evaluate_tokens(model, ids, seq_len, batch_size, precision, tokens)  # reads only the windows it scores
    seconds = time.perf_counter() - t0
    return {
        "checkpoint": ckpt.path, "data": name, "bytes": len(ids), "tokens": r["tokens"], "seq_len": seq_len,
        "precision": precision, "loss_nats": r["loss"], "bits_per_byte": r["loss"] / math.log(2),
        "perplexity": math.exp(r["loss"]), "accuracy": r["accuracy"], "seconds": round(seconds, 3),
        "tok_s": round(r["tokens"] / max(seconds, 1e-9), 1),
    }
