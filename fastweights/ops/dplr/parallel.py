"""The DPLR delta rule, parallel form: one block of the UT transform with two write paths.

Inside a block of L tokens entering with state h (c_r = gk_1 + … + gk_r per key channel),
the state after token r is h_r = D_r h + Σ_{i≤r} diag(e^{c_r − c_i}) (k_i v_iᵀ + b_i u_iᵀ)
with the pseudo-values u_i = a_iᵀ h_{i−1} (README.md in this folder). Reading row i:

    (I − A_ab) U = (A ⊙ e^{c_{i−1}}) h + A_ak V,
    A_ab[i, j] = Σ_d a_i b_j e^{c_{i−1} − c_j},  A_ak[i, j] = Σ_d a_i k_j e^{c_{i−1} − c_j}   (j < i)

so with [W | U₀] = (I − A_ab)⁻¹ [A ⊙ e^{c − gk} | A_ak V], U = U₀ + W h, and

    O  = scale · (Q ⊙ e^c) h + A_qk V + A_qb U,     A_qk, A_qb: KDA's decayed scores (j ≤ i)
    h' = diag(e^{c_L}) h + (K ⊙ e^{c_L − c})ᵀ V + (B ⊙ e^{c_L − c})ᵀ U.

This is KDA's block shape with 2L pseudo-rows: u = [U₀; V], w = [−W; 0] (so U' = u − w h is
[U; V]), scores [A_qb | A_qk] and write keys [B ⊙ e^{c_L − c}; K ⊙ e^{c_L − c}], so KDA's parallel
and chunk drivers run it unchanged. The four decayed products use KDA's relative sub-block
factors (every exponential of a number <= 0) with a ⊙ e^{−gk} as the row factor of A_ab and
A_ak: one token's e^{−gk}, finite for gk >= −80 in fp32 (the front end checks it).

The slots of KDA's drivers ``(q, k, v, beta, gk)`` carry ``(q, k, v, ab, gk)``, ``ab [.., 2, K]``
the pair stacked.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..kda.parallel import BlockTerms, RelativeDecay, cumulative_decay, kda_parallel, sub_block
from .._spec import Form, OpSpec, Rule
from .fla import dplr_form
from .recurrent import dplr_step


def dplr_block_terms(q, k, v, ab, gk, scale: float, solve=None) -> BlockTerms:
    """The state-free terms of blocks ``q, k, gk [Bt, L, K]``, ``v [Bt, L, V]``, ``ab [Bt, L, 2, K]``
    in KDA's :class:`~..kda.parallel.BlockTerms` shape with 2L pseudo-rows (module docstring).
    ``solve`` is unused (the unit-triangular solve is autograd's, see ``chunk.py``); ``solver``
    keeps the block's inputs, from which the chunk form's backward recomputes these terms."""
    a, b = ab[..., 0, :], ab[..., 1, :]
    length, dk = q.shape[-2], q.shape[-1]
    c = cumulative_decay(gk)
    decay = RelativeDecay(c, sub_block(length), q.dtype)
    read, to_end = torch.exp(c.to(q.dtype)), torch.exp((c[:, -1:] - c).to(q.dtype))
    a_shift = a * torch.exp(-gk)  # a_i e^{c_{i−1} − c_j} = (a_i e^{−gk_i}) e^{c_i − c_j}
    a_ab = decay.products(a_shift, b, strict=True)
    a_ak = decay.products(a_shift, k, strict=True)
    scores = torch.cat([decay.products(q, b, strict=False), decay.products(q, k, strict=False)], dim=-1) * scale
    eye = torch.eye(length, dtype=q.dtype, device=q.device)
    rhs = torch.cat([a * torch.exp((c - gk.to(c.dtype)).to(q.dtype)), a_ak @ v], dim=-1)
    wu = torch.linalg.solve_triangular(eye - a_ab, rhs, upper=False, unitriangular=True)  # [W | U₀]
    rows = torch.cat([torch.cat([-wu[..., :dk], wu[..., dk:]], dim=-1), torch.cat([torch.zeros_like(k), v], dim=-1)],
                     dim=-2)
    k_write = torch.cat([b * to_end, k * to_end], dim=-2)
    return BlockTerms(decay, read, to_end, a_ab, scores, q * read * scale, k_write, read[:, -1], rows,
                      (q, k, v, ab, gk))


def dplr_parallel(q, k, v, beta, gk, h0, scale, chunk_size=None, *, a, b) -> Tuple[torch.Tensor, torch.Tensor]:
    """The DPLR delta rule as one block on head-first tensors ``[N, H, T, ·]`` (autograd)."""
    return kda_parallel(q, k, v, torch.stack([a, b], dim=-2), gk, h0, scale, terms=dplr_block_terms)


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_DPLR_DELTA_RULE = OpSpec("parallel_dplr_delta_rule", Rule.DELTA, Form.PARALLEL, torch=dplr_parallel, step=dplr_step)

parallel_dplr_delta_rule = dplr_form(PARALLEL_DPLR_DELTA_RULE, needs_floor=True, doc="""
    The DPLR delta rule as one T×T block (O(T²·K) work, O(T²) memory; module docstring).

    Equivalent to :func:`~fastweights.ops.recurrent_dplr_delta_rule`: same arguments and
    returns (``chunk_size`` is unused), with ``gk >= −80``. Differentiable by autograd.
""")
