"""The one-token step of the (gated) delta rule, for generation.

Decoding runs the recurrence one token at a time; at that size the cost is
reading and writing the state ``[B, H, K, V]`` (fp32), so the fast step touches
it exactly once: :func:`delta_rule_step` runs a fused Triton kernel on CUDA
tensors (read the state block, decay, delta write, read-out, write it back, in
place). :func:`delta_rule_step_ref` is the batched PyTorch step with the same
signature and the same in-place semantics, equal to one step of
``recurrent_delta_rule`` / ``recurrent_gated_delta_rule``::

    h ← α h            (α = e^g; gated rule only)
    u = β (v − hᵀ k)   (what the memory gets wrong at k)
    h ← h + k uᵀ
    o = scale · hᵀ q   (read after the write)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import BACKENDS, HAS_TRITON, MAX_HEAD_DIM, TRITON_DTYPES, interpreting

__all__ = ["delta_rule_step", "delta_rule_step_ref"]


def _check(q, k, v, beta, state, g) -> None:
    op = "delta_rule_step"
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("state", state), ("g", g)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"{op}: `q` and `k` must both have shape [B, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    b, h, dk = q.shape
    if v.dim() != 3 or v.shape[:2] != (b, h):
        raise ValueError(f"{op}: `v` must have shape [B, H, V] = [{b}, {h}, V], got {tuple(v.shape)}")
    for name, t in (("beta", beta), ("g", g)):
        if t is not None and t.shape != (b, h):
            raise ValueError(f"{op}: `{name}` must have shape [B, H] = [{b}, {h}], got {tuple(t.shape)}")
    if state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError(f"{op}: `state` must have shape [B, H, K, V] = [{b}, {h}, {dk}, {v.shape[-1]}], got {tuple(state.shape)}")
    if state.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: `state` must be float32 (or float64), got {state.dtype}")


def delta_rule_step_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    g: Optional[torch.Tensor] = None, scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One batched PyTorch step; updates ``state`` in place and returns ``(o [B, H, V], state)``.

    Args: q, k ``[B, H, K]``; v ``[B, H, V]``; beta (and g for the gated rule)
    ``[B, H]``; state ``[B, H, K, V]`` fp32 (fp64 allowed); scale None = K^-0.5.
    ``o`` has v's dtype; arithmetic is in the state's dtype.
    """
    _check(q, k, v, beta, state, g)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dt = state.dtype
    k_t = k.to(dt).unsqueeze(-2)  # [B, H, 1, K]
    if g is not None:
        state.mul_(torch.exp(g.to(dt))[..., None, None])
    u = (v.to(dt) - (k_t @ state).squeeze(-2)) * beta.to(dt).unsqueeze(-1)  # [B, H, V]
    state.add_(k_t.transpose(-1, -2) @ u.unsqueeze(-2))
    o = (q.to(dt).unsqueeze(-2) @ state).squeeze(-2) * scale
    return o.to(v.dtype), state


def step_grid(batch: int, heads: int, value_dim: int, bv: int) -> Tuple[int, int]:
    """Grid of the step kernel: (batch, head) on axis 0, which CUDA allows up to 2³¹ − 1
    (axes 1 and 2 stop at 65,535, which B·H passes at batch 4,096 with 16 heads)."""
    return batch * heads, -(-value_dim // bv)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    g: Optional[torch.Tensor] = None, scale: Optional[float] = None, backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decode step, fused on the GPU; same arguments and result as :func:`delta_rule_step_ref`.

    ``backend``: ``"auto"`` (the Triton kernel for CUDA tensors when Triton
    imports, else the PyTorch step), ``"torch"`` or ``"triton"``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"delta_rule_step: unknown `backend` {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    _check(q, k, v, beta, state, g)
    dk, dv = q.shape[-1], v.shape[-1]
    fits = q.dtype in TRITON_DTYPES and state.dtype == torch.float32 and max(dk, dv) <= MAX_HEAD_DIM
    if backend == "auto":
        backend = "triton" if HAS_TRITON and q.is_cuda and fits else "torch"
    if backend == "torch":
        return delta_rule_step_ref(q, k, v, beta, state, g, scale)
    if not HAS_TRITON:
        raise ImportError("delta_rule_step: backend='triton' needs the triton package: pip install 'fastweights[triton]'")
    if not q.is_cuda and not interpreting():
        raise ValueError(f"delta_rule_step: backend='triton' needs CUDA tensors, got `q` on {q.device}")
    if not fits:
        raise ValueError(
            f"delta_rule_step: backend='triton' needs fp32/bf16/fp16 inputs, an fp32 state and K, V <= "
            f"{MAX_HEAD_DIM}; got {q.dtype}, state {state.dtype}, K={dk}, V={dv}"
        )
    if not state.is_contiguous():
        raise ValueError("delta_rule_step: backend='triton' updates `state` in place and needs it contiguous")
    import triton

    from ._decode_kernel import delta_step

    scale = dk ** -0.5 if scale is None else float(scale)
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    o = torch.empty_like(v)
    bk = max(16, triton.next_power_of_2(dk))
    bv = min(32, max(16, triton.next_power_of_2(dv)))
    batch, heads = q.shape[:2]
    delta_step[step_grid(batch, heads, dv, bv)](
        q, k, v, beta, g if g is not None else beta, state, o, scale, dk, dv, BK=bk, BV=bv, GATED=g is not None,
    )
    return o, state
