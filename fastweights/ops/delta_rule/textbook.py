"""The delta rule's chunk form as the textbook writes it: the benchmark's baseline.

Same algorithm as ``chunk.py`` (docs/design.md, "The chunk form"), written the way a
first implementation reads off the paper (Yang et al. 2024, §3):

1. the UT transform by row-by-row forward substitution, one row of every chunk at
   a time (C Python steps), exactly the paper's ``w_r``/``u_r`` recursion;
2. a per-chunk loop of matmuls, ``U' = U − W h; O = Q h + P U'; h ← h + Kᵀ U'``
   (:func:`~fastweights.ops._chunk.chunk_scan`, four matmuls per chunk);
3. autograd for the backward, which keeps the graph of both loops.

It is correct (tested against the recurrence in float64) and kept importable so
``benchmarks/chunk_speed.py`` can time the fast path against it side by side.
Use :func:`~fastweights.ops.chunk_delta_rule` for real work.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._chunk import block_terms, chunk_scan, decay_matrix, from_chunks, to_chunks
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule


def forward_substitution_ut(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, b: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``W, U`` of ``wy.ut_transform``, one row at a time (Yang et al. 2024).

    Row r: ``[w_r | u_r] = β_r ([k_r e^{b_r} | v_r] − Σ_{i<r} (k_r·k_i) Γ[r, i] [w_i | u_i])``.
    """
    length = k.shape[-2]
    s = (k @ k.transpose(-1, -2)) * decay_matrix(b, length, k.device, k.dtype, diagonal=-1)
    k_b = k if b is None else k * torch.exp(b).unsqueeze(-1)
    rhs = torch.cat([k_b, v], dim=-1)
    rows = []
    for r in range(length):
        x = rhs[..., r, :]
        if r:
            earlier = torch.stack(rows, dim=-2)  # [..., r, K + V]
            x = x - (s[..., r : r + 1, :r] @ earlier).squeeze(-2)
        rows.append(beta[..., r, None] * x)
    wu = torch.stack(rows, dim=-2)
    return wu[..., : k.shape[-1]], wu[..., k.shape[-1]:]


def textbook_delta_rule_chunk(q, k, v, beta, g, h0, scale, chunk_size) -> Tuple[torch.Tensor, torch.Tensor]:
    """Textbook chunkwise (gated) delta rule on head-first tensors ``[N, H, T, D]``; ``(o, h_T)``."""
    t_len = q.shape[2]
    qc, kc, vc, bc, gc = (to_chunks(x, chunk_size) for x in (q, k, v, beta, g))
    q_decayed, k_decayed, intra, chunk_decay, b = block_terms(qc, kc, gc, scale)
    w, u = forward_substitution_ut(kc, vc, bc, b)
    o, h = chunk_scan(q_decayed, k_decayed, u, w, intra, chunk_decay, h0, scale)
    return from_chunks(o, t_len), h


#: The op, declared once (``fastweights/ops/_spec.py``).
TEXTBOOK_CHUNK_DELTA_RULE = OpSpec("textbook_chunk_delta_rule", Rule.DELTA, Form.CHUNK, torch=textbook_delta_rule_chunk)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.delta_rule.api", "textbook_chunk_delta_rule")
