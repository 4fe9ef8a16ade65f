"""The one front end of every DPLR (diagonal-plus-low-rank) delta-rule form, in fla 0.6.0's call form.

=============================  =================================================================
fla argument                   what we do
=============================  =================================================================
``a``, ``b`` [B, T, H, K]      the low-rank pair of the transition diag(e^gk) + b aᵀ (any real
                               values; RWKV-7's layer gives a = −κ̂, b = κ̂ ⊙ its learning rate)
``gk`` [B, T, H, K]            the per-key-channel log decay (<= 0); the parallel and chunk forms
                               take e^{−gk} of one token, so they need gk >= −80 (fp32's range)
``scale``                      ``None``: K^−0.5 (``chunk_rwkv7``'s default is 1.0, as fla's)
``cu_seqlens``,                packed sequences (B = 1); a host copy of ``cu_seqlens``
``cu_seqlens_cpu``
``chunk_size``                 any positive int (fla: 16 or 64); ``None``: ``default_chunk_size``'s choice
``safe_gate``,                 accepted and ignored: hints about how fla's kernels run
``disable_recompute``,
``lower_bound``
``reverse``                    refused (reverse-time scans)
``cp_context``                 refused (context parallelism)
=============================  =================================================================
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

from .._checks import _check_finite, _check_tensor, _shape
from .._dispatch import run
from .._fla_compat import refuse_or_ignore, resolve_cu_seqlens, resolve_decay
from .._spec import OpSpec

__all__ = ["run_dplr"]

#: The parallel and chunk forms take e^{−gk} of single tokens: below this it overflows fp32.
GK_FLOOR = -80.0


def _check_pair(op: str, q, a, b) -> None:
    if not (isinstance(q, torch.Tensor) and q.dim() == 4):
        return  # the op's own checks name that problem
    for name, t in (("a", a), ("b", b)):
        if t is None:
            raise TypeError(f"{op}: `{name}` is required (a [B, T, H, K] tensor of the transition's low-rank pair)")
        _check_tensor(op, name, t, t.dim() if isinstance(t, torch.Tensor) else 4, "[B, T, H, K]")
        if t.shape != q.shape:
            raise ValueError(f"{op}: `{name}` must have the shape of `q` {_shape(q)} ([B, T, H, K]), got {_shape(t)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: `{name}` must have the dtype of `q` ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{op}: `{name}` is on {t.device}, expected the device of `q` ({q.device})")
        _check_finite(op, name, t)


def run_dplr(
    spec: OpSpec, needs_floor: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    gk: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    safe_gate: bool = False,
    chunk_size: Optional[int] = None,
    disable_recompute: bool = False,
    *,
    lower_bound: Optional[float] = None,
    max_seqlen: Optional[int] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The body of every DPLR form (:func:`dplr_form`): fla's options (module docstring), the
    pair's checks, then the dispatcher (:func:`~fastweights.ops._dispatch.run`) with the form's spec,
    whose solver receives ``a`` and ``b`` head-first as keywords and gk in g's slot."""
    from .._checks import _check_range

    op = spec.name

    refuse_or_ignore(op, kwargs)
    if isinstance(q, torch.Tensor):
        cu_seqlens = resolve_cu_seqlens(op, cu_seqlens, cu_seqlens_cpu, q.device)
    _check_pair(op, q, a, b)
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        gk = resolve_decay(gk, q.shape, q.dtype, q.device)
    if needs_floor and isinstance(gk, torch.Tensor) and gk.is_floating_point():
        _check_range(op, gk, GK_FLOOR, float("inf"), f"`gk` must be >= {GK_FLOOR:g} in this form (one token's "
                     f"e^(-gk) is taken, module docstring); the recurrent form has no floor")
    return run(
        spec, q, k, v, gk=gk, gk_name="gk", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        max_seqlen=max_seqlen, chunk_size=chunk_size, extra=dict(a=a, b=b),
    )


#: The signature every DPLR form has: :func:`run_dplr`'s, after its first two parameters.
FORM_SIGNATURE = inspect.signature(run_dplr).replace(parameters=list(inspect.signature(run_dplr).parameters.values())[2:])
