"""The one-token step of the (gated) delta rule on CUDA: a fused Triton kernel.

Decoding runs the recurrence one token at a time; at that size the cost is
reading and writing the state ``[B, H, K, V]`` (fp32), so the fast step touches
it exactly once (read the state block, decay, delta write, read-out, write it back,
in place). The public :func:`fastweights.ops.delta_rule_step` /
:func:`~fastweights.ops.gated_delta_rule_step` launch it on CUDA tensors; their
PyTorch path (the recurrent forms' own step) is its twin and reference::

    h ← α h            (α = e^g; gated rule only)
    u = β (v − hᵀ k)   (what the memory gets wrong at k)
    h ← h + k uᵀ
    o = scale · hᵀ q   (read after the write)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


__all__ = ["fused_delta_rule_step", "step_grid"]


def step_grid(batch: int, heads: int, value_dim: int, bv: int) -> Tuple[int, int]:
    """Grid of the step kernel: (batch, head) on axis 0, which CUDA allows up to 2³¹ − 1
    (axes 1 and 2 stop at 65,535, which B·H passes at batch 4,096 with 16 heads)."""
    return batch * heads, -(-value_dim // bv)


def fused_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: Optional[torch.Tensor],
    state: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Launch the fused step kernel: updates the contiguous fp32 ``state [B, H, K, V]`` in place and
    returns ``o [B, H, V]`` (v's dtype). Unchecked: :func:`fastweights.ops.delta_rule_step` and
    :func:`~fastweights.ops.gated_delta_rule_step` check the arguments and choose this path."""
    import triton

    from ._decode_kernel import delta_step

    dk, dv = q.shape[-1], v.shape[-1]
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    o = torch.empty_like(v)
    bk = max(16, triton.next_power_of_2(dk))
    bv = min(32, max(16, triton.next_power_of_2(dv)))
    batch, heads = q.shape[:2]
    delta_step[step_grid(batch, heads, dv, bv)](
        q, k, v, beta, g if g is not None else beta, state, o, float(scale), dk, dv, BK=bk, BV=bv, GATED=g is not None,
    )
    return o
