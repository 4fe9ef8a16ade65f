"""Greedy speculative decoding: propose k tokens, verify them with one forward, keep the agreeing prefix.

Proposals come from a lookup in the text so far (*prompt lookup*: the tokens that
followed the most recent earlier occurrence of the last n-gram; Saxena 2023, "Prompt
Lookup Decoding") or from a smaller *draft* model decoding greedily (Leviathan, Kalman &
Matias 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318). The model reads the
last token and the k proposals as one verify window (:mod:`fastweights.models.window`),
its greedy choice after each is compared with the next proposal, and the cache is rolled
back past the first disagreement. Every kept token is the model's own greedy choice, so
the output is greedy decoding's (up to the rounding of the window's forms against
one-token steps, which can only matter at an exact tie of two logits).

Glossary: ``k`` proposals per round; ``accepted`` proposals that matched; acceptance
rate = accepted / proposed; a *round* is one verify forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ..config import check_int

__all__ = ["SpeculativeStats", "speculative_generate", "lookup_proposals"]


@dataclass
class SpeculativeStats:
    """Counts of one speculative decode: ``rounds`` verify forwards, ``steps`` plain one-token
    steps (no proposal found), ``proposed`` and ``accepted`` tokens."""

    rounds: int = 0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """accepted / proposed (0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0


def lookup_proposals(tokens: List[int], k: int, max_ngram: int = 3) -> List[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last n-gram of
    ``tokens`` (n from ``max_ngram`` down to 1); ``[]`` when no n-gram recurs."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the most recent match first
            if tokens[start: start + n] == tail:
                return tokens[start + n: start + n + k]
    return []


def _check(model, prompt_ids: torch.Tensor, prompt_lookup, draft) -> None:
    if prompt_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding: one prompt at a time (batch size 1), got batch size {prompt_ids.shape[0]}")
    if (prompt_lookup is None) == (draft is None):
        raise ValueError("speculative decoding: give exactly one of `prompt_lookup` (k) and `draft` (a model)")
    check_int("speculative decoding", "prompt_lookup", prompt_lookup, none_ok=True,
              what="an int >= 1 (tokens proposed per round)")
    if draft is not None:
        if not isinstance(draft, type(model)):  # an LM (the model's class; no import of lm.py here)
            raise TypeError(f"speculative decoding: `draft` must be an LM, got {type(draft).__name__}")
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"speculative decoding: the `draft` model's vocab_size ({draft.config.vocab_size}) must equal the "
                f"model's ({model.config.vocab_size}): it proposes the model's tokens"
            )


@torch.no_grad()
def speculative_generate(
    model, prompt_ids: torch.Tensor, max_new_tokens: int, *, prompt_lookup: Optional[int] = None,
    draft=None, draft_tokens: int = 4, max_ngram: int = 3,
):
    """Greedy decoding of ``max_new_tokens`` tokens after ``prompt_ids [1, T]``, verified in windows.

    Args:
        model: the :class:`~fastweights.models.LM` whose greedy output this is.
        prompt_lookup: k, propose up to k tokens per round by prompt lookup.
        draft: a smaller LM (same vocabulary) that proposes ``draft_tokens`` tokens per round.
        max_ngram: the longest n-gram prompt lookup matches.

    Returns:
        ``(ids [1, T + max_new_tokens], cache, SpeculativeStats)``; the cache has read every
        token but the last (as :meth:`LM.generate`'s) and is committed.
    """
    _check(model, prompt_ids, prompt_lookup, draft)
    k = prompt_lookup if draft is None else draft_tokens
    check_int("speculative decoding", "draft_tokens", k, what="an int >= 1")
    stats = SpeculativeStats()
    tokens = prompt_ids[0].tolist()
    logits, cache = model(prompt_ids)
    last = int(logits[0, -1].argmax())
    out = [last]
    draft_cache = None
    if draft is not None and prompt_ids.shape[1] > 0:
        _, draft_cache = draft(prompt_ids)  # the draft has read every token but `last`
    while len(out) < max_new_tokens:
        room = max_new_tokens - len(out) - 1  # a round adds its accepted proposals and one token of the model's
        proposals, draft_states = [], None
        if room > 0 and draft is None:
            proposals = lookup_proposals(tokens + out, min(k, room), max_ngram)
        elif room > 0:
            proposals, draft_states = _draft(draft, draft_cache, last, min(k, room))
        step = torch.tensor([[last] + proposals], device=prompt_ids.device)
        if not proposals:  # a plain greedy step
            logits, cache = model(step, cache)
            if draft is not None:
                draft_cache = draft(step, draft_cache)[1]
            last = int(logits[0, -1].argmax())
            out.append(last)
            stats.steps += 1
            continue
        logits, cache = model(step, cache)  # a verify window of 1 + k tokens
        choice = logits[0].argmax(-1).tolist()  # the model's greedy token after each
        n = 0
        while n < len(proposals) and proposals[n] == choice[n]:
            n += 1
        cache.rollback(len(proposals) - n)  # keep `last` and the n accepted proposals
        out.extend(proposals[:n] + [choice[n]])
        stats.rounds, stats.proposed, stats.accepted = stats.rounds + 1, stats.proposed + len(proposals), stats.accepted + n
        if draft is not None:  # the draft's cache after reading `last` and the accepted proposals
            draft_cache = draft_states[n] if n < len(draft_states) else draft(step[:, -1:], draft_states[-1])[1]
        last = choice[n]
    cache.commit()
    out = out[:max_new_tokens]  # (only max_new_tokens = 0 leaves a token to drop)
    ids = torch.cat([prompt_ids, torch.tensor([out], dtype=prompt_ids.dtype, device=prompt_ids.device)], dim=1)
    return ids, cache, stats


def _draft(draft, cache, last: int, k: int):
    """``k`` greedy draft tokens after ``last``, and the draft's cache after reading ``last`` and
    each of the first k − 1 of them (``states[i]``: ``last`` and i proposals read). Caches are
    values: an earlier one stays valid after the later steps."""
    device = next(draft.parameters()).device
    proposals, states, token = [], [], last
    for _ in range(k):
        logits, cache = draft(torch.tensor([[token]], device=device), cache)
        states.append(cache)
        token = int(logits[0, -1].argmax())
        proposals.append(token)
    return proposals, states
