"""The one front end of every GDN-2 form: fla 0.6.0's ``chunk_gdn2`` call form and options.

=============================  =================================================================
fla argument                   what we do
=============================  =================================================================
``g`` [B, T, HV, K]            the per-key-channel log decay (<= 0); ``None``: no decay
``b`` [B, T, HV, K]            the per-key-channel erase gate, in [0, 2] (fla: "typically [0, 2]";
                               with unit keys, I − k (b ⊙ k)ᵀ then has eigenvalues in [−1, 1])
``w`` [B, T, HV, V]            the per-value-channel write gate, in [0, 1]
``use_gate_in_kernel``,        as in ``chunk_kda`` (:func:`~fastweights.ops.kda_gate`):
``A_log``, ``dt_bias``,        g = −exp(A_log)·softplus(g + dt_bias), or with ``lower_bound``
``lower_bound``                lower_bound·sigmoid(exp(A_log)·(g + dt_bias))
``use_qk_l2norm_in_kernel``    ``qk_norm="l2"``
``state_v_first``              states in and out are [N, HV, V, K]
``safe_gate``,                 accepted and ignored: hints about how fla's kernels run
``disable_recompute``,
``cu_seqlens_cpu``             a host copy of ``cu_seqlens``
``chunk_size``                 any positive int (fla's kernel requires 64)
``return_intermediate_states``  the state entering every chunk, ``[B, NT, HV, K, V]`` (fla's layout), a third return
``cp_context``                 refused (context parallelism)
grouped value heads            v [B, T, HV, V], HV a multiple of H (as fla's recurrent kernel)
=============================  =================================================================
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

from .._checks import _check_finite, _check_range, _check_tensor, _shape, state_dtype
from .._dispatch import run
from .._fla_compat import resolve_decay
from .._spec import OpSpec
from ..kda.fla import kda_inputs

__all__ = ["run_gdn2", "check_gates"]


def check_gates(op: str, q, v, b, w) -> None:
    """``b [B, T, HV, K]`` in [0, 2] and ``w [B, T, HV, V]`` in [0, 1], on ``v``'s device and in
    its dtype family (floating point); nothing is checked when ``q``/``v`` are malformed (the op's
    own checks name that problem first)."""
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4):
        return
    lead = tuple(v.shape[:3])
    for name, t, width, layout, high, why in (
        ("b", b, q.shape[-1], "[B, T, HV, K]", 2.0, "the erase gate"),
        ("w", w, v.shape[-1], "[B, T, HV, V]", 1.0, "the write gate"),
    ):
        if t is None:
            raise TypeError(f"{op}: `{name}` is required ({why}, a {layout} tensor)")
        _check_tensor(op, name, t, t.dim() if isinstance(t, torch.Tensor) else 4, layout)
        if tuple(t.shape) != lead + (width,):
            want = ", ".join(str(d) for d in lead + (width,))
            raise ValueError(f"{op}: `{name}` ({why}) must have shape {layout} = [{want}], got {_shape(t)}")
        if t.device != v.device:
            raise ValueError(f"{op}: `{name}` is on {t.device}, expected the device of `v` ({v.device})")
        _check_finite(op, name, t)
        _check_range(op, t, 0.0, high, f"`{name}` ({why}) must lie in [0, {high:g}]")


def run_gdn2(
    spec: OpSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    w: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    *,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    qk_norm: Optional[str] = None,
    max_seqlen: Optional[int] = None,
    backend: str = "auto",
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The body of every GDN-2 form (:func:`gdn2_form`): fla's options (KDA's, :func:`~..kda.fla.kda_inputs`,
    with ``b``/``w`` for β), the gates' checks, then the dispatcher (:func:`~fastweights.ops._dispatch.run`)
    with the form's spec, whose solver receives ``b`` and ``w`` head-first as keywords. ``backend`` as in
    ``chunk_kda``: ``"auto"``, ``"torch"`` (the PyTorch code), or ``"cpu"`` (the chunk form only: KDA's
    compiled kernels with GDN-2's erase keys)."""
    op = spec.name

    q, k, _, g, _, initial_state, cu_seqlens, _ = kda_inputs(
        op, q, k, v, g, None, initial_state, cu_seqlens, gv_supported=False, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=kwargs,
    )
    check_gates(op, q, v, b, w)
    if isinstance(v, torch.Tensor) and v.dim() == 4 and isinstance(q, torch.Tensor) and q.dim() == 4:
        g = resolve_decay(g, v.shape[:3] + (q.shape[-1],), state_dtype(q.dtype), q.device)
    return run(
        spec, q, k, v, backend=backend, gk=g, gk_name="g", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        max_seqlen=max_seqlen, chunk_size=chunk_size, qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm,
        extra=dict(b=b, w=w), return_intermediate_states=return_intermediate_states,
    )


#: The signature every GDN-2 form has: :func:`run_gdn2`'s, after its first parameter.
FORM_SIGNATURE = inspect.signature(run_gdn2).replace(parameters=list(inspect.signature(run_gdn2).parameters.values())[1:])
