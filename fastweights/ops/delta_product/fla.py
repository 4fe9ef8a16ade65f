"""The one front end of every (Gated) DeltaProduct form, in fla 0.6.0's call form.

fla's layout: ``q [B, T, H, K]`` and ``g [B, T, H]`` per token, ``k [B, T·n_h, H, K]``,
``v [B, T·n_h, H, V]`` and ``beta [B, T·n_h, H]`` per Householder sub-step (token t's
sub-step j at t·n_h + j). The sub-steps are folded into each token here
(``[B, T, H, n_h, ·]``, a view), so that packing, chunking and the sequential loop count
tokens, and only a chunk's own sub-steps are ever laid out as a longer sequence.

=============================  =================================================================
fla argument                   what we do
=============================  =================================================================
``num_householder``            n_h >= 1 (an int); ``n_h = 1`` is the (gated) delta rule
``g`` [B, T, H]                one log decay per token (<= 0), applied before its first
                               sub-step; ``None``: no decay (DeltaProduct)
``beta`` [B, T·n_h, H]         in [0, 1]; [0, 2] with ``allow_neg_eigval=True`` (negative
                               eigenvalues, Grazzi et al. 2025); ``None``: β = 1
``use_qk_l2norm_in_kernel``    q and every sub-step's k normalized, fla's x·rsqrt(Σx² + 1e-6)
``cu_seqlens``                 token offsets [N + 1] (sub-step offsets are n_h× these)
``cu_seqlens_cpu``             a host copy of ``cu_seqlens``
``chunk_size``                 tokens per chunk (ours; each chunk solves C·n_h sub-steps)
``cp_context``                 refused (context parallelism)
=============================  =================================================================
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

from ...config import check_int
from .._checks import _check_tensor, _shape, check_beta_range, state_dtype
from .._dispatch import run
from .._fla_compat import fla_inputs
from .._spec import OpSpec
from ..feature_maps import normalize_qk

__all__ = ["run_delta_product"]


def _fold(op: str, name: str, t, q: torch.Tensor, n_h: int, width: Optional[int], layout: str) -> torch.Tensor:
    """``[B, T·n_h, H(, D)]`` -> the per-token view ``[B, T, H, n_h(, D)]``, after checking the shape."""
    rank = 3 if width is None else 4
    _check_tensor(op, name, t, rank, layout)
    B, T, H = q.shape[:3]
    want = (B, T * n_h, H) + (() if width is None else (t.shape[-1] if width < 0 else width,))
    if tuple(t.shape) != want:
        raise ValueError(f"{op}: `{name}` must have shape {layout} = [{', '.join(map(str, want))}] "
                         f"(num_householder={n_h} sub-steps per token of `q` {_shape(q)}), got {_shape(t)}")
    if t.device != q.device:
        raise ValueError(f"{op}: `{name}` is on {t.device}, expected the device of `q` ({q.device})")
    t = t.unflatten(1, (T, n_h))
    return t.transpose(2, 3)


def run_delta_product(
    spec: OpSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    num_householder: int = 1,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    *,
    allow_neg_eigval: bool = False,
    chunk_size: Optional[int] = None,
    qk_norm: Optional[str] = None,
    max_seqlen: Optional[int] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The body of every (Gated) DeltaProduct form (:func:`delta_product_form`), module docstring.

    The sub-steps' keys, values and β reach the form's solver ``core`` folded per token, as the
    keywords ``ks [N, H, T, n_h, K]``, ``vs [N, H, T, n_h, V]``, ``betas [N, H, T, n_h]``; the
    front end's own ``k``/``v`` are the last sub-step's (what its checks and packing see).
    """
    op = spec.name
    n_h = num_householder
    check_int(op, "num_householder", n_h, what="an int >= 1 (Householder sub-steps per token)")
    if qk_norm not in (None, "l2", "sum"):
        raise ValueError(f"{op}: unknown `qk_norm` {qk_norm!r}; expected None, 'l2' or 'sum'")
    qk_norm = "l2" if use_qk_l2norm_in_kernel else qk_norm
    no_decay = g is None
    q, _, beta, g, initial_state, cu_seqlens = fla_inputs(  # β = 1 for None comes out [B, T·n_h, H], like v
        op, q, q, v, beta, g, initial_state, cu_seqlens, gated=True, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=kwargs,
    )
    _check_tensor(op, "q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    ks = _fold(op, "k", k, q, n_h, K, "[B, T·n_h, H, K]")
    vs = _fold(op, "v", v, q, n_h, -1, "[B, T·n_h, H, V]")
    for name, t in (("k", ks), ("v", vs)):
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: `{name}` must have the dtype of `q` ({q.dtype}), got {t.dtype}")
    if no_decay:
        g = torch.zeros(B, T, H, dtype=state_dtype(q.dtype), device=q.device)
    betas = _fold(op, "beta", beta, q, n_h, None, "[B, T·n_h, H]")
    check_beta_range(op, betas, allow_neg_eigval)
    k_last = ks[..., -1, :]  # what run_op checks and normalizes; the solvers read ks
    if qk_norm is not None:  # run_op normalizes q (in the compute dtype); the sub-steps' keys here
        ks = normalize_qk(ks.to(state_dtype(q.dtype)), qk_norm, op)
    return run(
        spec, q, k_last, vs[..., -1, :], g=g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        max_seqlen=max_seqlen, chunk_size=chunk_size, qk_norm=qk_norm, extra=dict(ks=ks, vs=vs, betas=betas),
    )


#: The signature every DeltaProduct form has: :func:`run_delta_product`'s, after its first parameter.
FORM_SIGNATURE = inspect.signature(run_delta_product).replace(
    parameters=list(inspect.signature(run_delta_product).parameters.values())[1:])
