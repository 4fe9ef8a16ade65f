"""Verify windows: a cache that can roll back the last tokens it read (speculative decoding).

Speculative decoding proposes k tokens (a draft model, or a lookup in the prompt), checks
all k with one forward of the model, and keeps the accepted prefix. A softmax layer
forgets rejected tokens by cutting KV rows; a fast-weight memory has folded them into
its state ``h``. So a forward that may be rolled back keeps, per layer, what it needs to
rebuild the state after any prefix of its tokens: a **window**.

What a window keeps (per layer, per forward: a *segment*)
---------------------------------------------------------
- the layer's state before the forward (a reference to the previous cache's tensors,
  not a copy), and
- for a forward of T > 1 tokens, the T tokens' inputs to the memory after projection
  (k, v and the logits of β and of the decay g) and to the short convolution
  (:class:`~fastweights.layers.common.WindowInputs`); a one-token step keeps nothing more.

Rolling back to the first a tokens of a segment replays them: the memory of a window of
exactly those a tokens, from the kept state and inputs (:meth:`FastWeightMixer.replay`);
the convolution's state and a softmax layer's KV rows are copies/cuts, not arithmetic.

Why inputs and not per-token states: per layer and token the inputs take
``2·H·K + H (+ H) + 3·H·K`` numbers (k, v, the logits of β (and of the decay), the
convolution's q/k/v inputs: about 5·d_model), a state takes ``H·K·V`` (d_model²/H). At
d_model = 1024, 16 heads of 64, fp32 and k = 8, a DeltaNet layer's window holds 463,360
bytes (the 299,008-byte state before it + 164,352) against 2,396,160 with per-token
states, and the forward need not materialise a state per token (the chunk form never
does). The price is the replay on rollback: one memory pass over the accepted tokens
(not the projections, not the MLP). docs/speculative.md has the table.

Exactness: "the same forms"
---------------------------
A window's forward pads its T tokens to ``P = window_width · ceil(T / window_width)``
rows (16 by default) and every matmul, convolution and memory op runs on P rows. MKL's
matmuls round a row differently with the number of rows (measured: a [1, a, 64] input
differs from the first a rows of a [1, 9, 64] one by 1 ulp), so without the padding the
first a tokens of a k-token forward and an a-token forward would not agree bitwise,
and neither could the caches built from them. With it, every token's arithmetic is the
same whatever the window's length (the pads come last and are never read by a real
token), and a rolled-back cache is bitwise the cache of a window of the accepted tokens
only (tests/models/test_rollback.py). The memory runs the chunk form over the P rows
when ``P >= chunk_from`` (pads get β = 0 and α = 1: no-ops), else the recurrent form
over the real rows; the replay of a accepted tokens uses the form and width a window of
a tokens uses. Linear attention and KDA always take the recurrent form in a window (a
pad cannot be neutral: φ(k) > 0; KDA's per-channel decay passes through a linear map).

When a window is committed
--------------------------
By :meth:`LMCache.commit`, or when the cache is read by the next forward (the forward
commits it in place, then reads it), unless the cache is *recording*
(``cache.recording = True``, which transformers' ``activate_past_recording`` sets for
assisted generation): then each forward adds a segment and a rollback may reach back
across several forwards, until ``commit`` (transformers' ``crop`` rolls back, then
commits). A committed cache holds only the states: its size is that of a cache that
never had a window. Rolling back a committed cache is an error (except a softmax-only
cache without a convolution, whose KV rows can always be cut).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional


from ..layers import AttentionState, FastWeightState
from ..layers.common import WindowInputs
from ..layers.softmax_attention import drop_kv_rows
from ..ops import KVCache

__all__ = ["WINDOW_WIDTH", "CHUNK_FROM", "Segment", "padded_width", "rolled_back", "window_nbytes", "cuttable", "drop_kv_rows"]

#: A window's tokens are padded to a multiple of this many rows: windows of up to 16 tokens
#: all run the same shapes, which makes rollback bitwise (module docstring).
WINDOW_WIDTH = 16

#: The padded width from which a window's memory runs the chunk form instead of the recurrent
#: form. Measured on this 2-core CPU (DeltaNet LM d_model 256, 4 layers, 4 heads, fp32, one
#: thread, process time; ``python -m benchmarks.run speculative --part crossover``, BENCHMARKS.md): the chunk
#: form over a window overtakes the recurrent form at k = 48 tokens (0.88× its time; 0.75× at
#: 64; 1.1-2.2× slower below 32). Either form reads k tokens faster than k one-token steps
#: from k = 4 on (0.95×; 0.24× at 16).
CHUNK_FROM = 48


def padded_width(tokens: int, width: int) -> int:
    """P: ``tokens`` rounded up to a multiple of ``width``."""
    return width * -(-tokens // width)


@dataclass
class Segment:
    """One forward's part of a window.

    Fields:
        before: every layer's state before the forward (references, not copies).
        tokens: how many of its tokens are still in the cache.
        keeps: per layer, the :class:`~fastweights.layers.common.WindowInputs` of those tokens,
            or ``None`` for a one-token decoding step (its rollback is ``before``).
        model: the LM that made it (its layers replay a prefix).
        width, chunk_from: the model's window settings when it was made.
    """

    before: list
    tokens: int
    keeps: Optional[List[WindowInputs]]
    model: object
    width: int = WINDOW_WIDTH
    chunk_from: int = CHUNK_FROM

    def truncated(self, tokens: int) -> "Segment":
        keeps = None if self.keeps is None else [_head(keep, tokens) for keep in self.keeps]
        return replace(self, tokens=tokens, keeps=keeps)


def _head(keep: WindowInputs, tokens: int) -> WindowInputs:
    return WindowInputs(*(None if t is None else t[:, :tokens] for t in (keep.k, keep.v, keep.extra, keep.conv)))


def rolled_back(states: list, window: List[Segment], n: int):
    """``(states, window)`` of a cache without its last ``n`` tokens (n at most the window's
    tokens; checked by the caller). Nothing is modified: the caller swaps both in at once."""
    window = list(window)
    while n > 0:
        seg = window[-1]
        if n >= seg.tokens:  # the whole forward goes: its layers' states before it
            states, n = seg.before, n - seg.tokens
            window.pop()
            continue
        accepted = seg.tokens - n
        P = padded_width(accepted, seg.width)
        new = []
        for block, before, after, keep in zip(seg.model.blocks, seg.before, states, seg.keeps):
            mixer = block.mixer
            if isinstance(after, FastWeightState):
                new.append(mixer.replay(before, keep, accepted, P, seg.chunk_from))
            else:
                new.append(mixer.replay(before, after, keep, n))
        states = new
        window[-1] = seg.truncated(accepted)
        n = 0
    return states, window


def window_nbytes(window: List[Segment]) -> int:
    """Bytes a window holds on top of the cache's states: the fast-weight states before each
    segment and every kept input (a softmax layer's earlier KV rows are views of the same
    buffer as its current ones, so they add nothing; its convolution state is counted)."""
    total = 0
    for seg in window:
        for state in seg.before:
            if isinstance(state, FastWeightState):
                total += state.nbytes
            elif isinstance(state, AttentionState):
                total += state.conv.numel() * state.conv.element_size()
        total += sum(keep.nbytes for keep in seg.keeps or ())
    return total


def cuttable(states: list) -> bool:
    """Whether every layer is a softmax layer without a convolution (its KV rows can be cut anytime)."""
    return all(isinstance(s, KVCache) for s in states)
