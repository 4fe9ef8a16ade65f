"""The UT / WY transform of a block of delta-rule writes (Yang et al. 2024, §3).

For a block of L tokens with incoming state h, the (gated) delta rule

    h_r = α_r (I − β_r k_r k_rᵀ) h_{r−1} + β_r k_r v_rᵀ

can be written as ``h_r = e^{b_r} h + Σ_{i≤r} e^{b_r − b_i} k_i u_iᵀ`` with pseudo-values

    u_r = β_r (v_r − e^{b_r} hᵀ k_r − Σ_{i<r} e^{b_r − b_i} (k_rᵀ k_i) u_i).

In matrix form ``(I + A) U = diag(β) (V − diag(e^b) K h)`` with the strictly lower
triangular ``A = tril(diag(β) (K Kᵀ ⊙ Γ), −1)``. So, with

    T = (I + A)⁻¹ diag(β)      (an L×L unit-triangular solve: forward substitution)
    W = T (K ⊙ e^b),  U = T V

the pseudo-values given any incoming state are ``U − W h``. T, W and U depend only
on the block's own keys, so they are computed for every block at once; only
``U − W h`` needs the state. Seed 001 ch. 7 computes the same rows one at a time
(its ``w_r``, ``u_r`` recursion); ``tests/test_golden_seeds.py`` checks its C = 2
numbers. Without decay (g = 0) every e^{·} factor is 1.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._chunk import decay_matrix


def ut_transform(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, b: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``W = T (K ⊙ e^b)`` and ``U = T V`` for blocks ``k [..., L, K]``, ``v [..., L, V]``.

    ``beta`` is ``[..., L]``; ``b`` (cumulative log decay, ``[..., L]``) may be None.
    """
    length = k.shape[-2]
    gamma = decay_matrix(b, length, k.device, k.dtype, diagonal=-1)  # strictly lower
    a = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * gamma
    eye = torch.eye(length, dtype=k.dtype, device=k.device)
    k_decayed = k if b is None else k * torch.exp(b).unsqueeze(-1)
    rhs = beta.unsqueeze(-1) * torch.cat([k_decayed, v], dim=-1)  # diag(β) [K e^b | V]
    wu = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    return wu[..., : k.shape[-1]], wu[..., k.shape[-1]:]


def ut_factors(
    k: torch.Tensor, beta: torch.Tensor, b: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces of the UT transform that the fast chunk path keeps: ``((I + A)⁻¹, S, Γ_strict)``.

    ``S = K Kᵀ ⊙ Γ_strict`` (strictly lower) so that ``A = diag(β) S``. The explicit
    inverse of the unit lower-triangular ``I + A`` costs one batched triangular
    solve; afterwards both the forward (``W, U = (I + A)⁻¹ diag(β) [K e^b | V]``)
    and the backward (``(I + A)⁻ᵀ dY``) are plain batched matmuls, which run
    several times faster than triangular solves on the CPU.
    """
    length = k.shape[-2]
    gamma = decay_matrix(b, length, k.device, k.dtype, diagonal=-1)  # strictly lower
    s = (k @ k.transpose(-1, -2)) * gamma
    eye = torch.eye(length, dtype=k.dtype, device=k.device)
    inverse = torch.linalg.solve_triangular(
        torch.addcmul(eye, beta.unsqueeze(-1), s), eye.expand_as(s), upper=False, unitriangular=True
    )
    return inverse, s, gamma
