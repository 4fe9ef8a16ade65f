"""fla's call forms of Kimi Delta Attention: the options of ``chunk_kda`` / ``fused_recurrent_kda``
(fla 0.6.0), turned into our plain inputs (the alias ``fused_recurrent_kda`` is in ``recurrent.py``).

:func:`kda_inputs` is the one place every KDA form (and ``fused_recurrent_gated_delta_rule``
with ``gk``/``gv``) goes through before :func:`~fastweights.ops._frontend.run_op`:

=============================  =================================================================
fla argument                   what we do
=============================  =================================================================
``g`` [B, T, HV, K]            the per-key-channel log decay (``gk=`` is accepted as its name;
                               both at once is refused: one gate, one name)
``gv`` [B, T, HV, V]           per-value-channel log decay, h ← h·diag(exp(gv)): the recurrent
                               form only (the others refuse it; README.md in this folder: why)
``use_gate_in_kernel``,        g = −exp(A_log)·softplus(g + dt_bias), ``A_log`` [HV], ``dt_bias``
``A_log``, ``dt_bias``         [HV·K] (or [HV, K]); with ``lower_bound``:
``lower_bound``                g = lower_bound·sigmoid(exp(A_log)·(g + dt_bias)) (``A_log=None``:
                               lower_bound·sigmoid(g + dt_bias)), fla's two formulas
``use_beta_sigmoid_in_kernel``  β = sigmoid(beta), ×2 with ``allow_neg_eigval``
``use_qk_l2norm_in_kernel``    ``qk_norm="l2"`` (fla's x·rsqrt(Σx² + 1e-6))
``state_v_first``              states in and out are [N, HV, V, K] (transposed at the boundary)
``safe_gate``,                 accepted and ignored: hints about how fla's kernels run (bounded
``disable_recompute``,         gates, saved activations, CUDA-graph capture), not about what
``use_graph``,                 they compute
``max_num_seqs``
``return_intermediate_states``  the states entering every chunk as a third return (fla's layout;
                               fp32 here), ``state_block_size``, ``state_indices`` and
                               ``has_initial_state`` as in ``chunk_delta_rule`` (docs/serving.md)
``cp_context``                 refused (context parallelism)
grouped value heads            v [B, T, HV, V], HV a multiple of H, as in fla
=============================  =================================================================
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .._checks import state_dtype
from .._dispatch import run
from .._fla_compat import fla_inputs, resolve_decay
from .._spec import OpSpec

__all__ = ["kda_inputs", "kda_gate", "run_kda"]


def _param(op: str, name: str, t, shapes, want: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{op}: `{name}` must be a floating-point tensor of shape {want}, got {what}")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{op}: `{name}` must have shape {want}, got {list(t.shape)}")
    return t


def kda_gate(
    g: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None, op: str = "kda_gate",
) -> torch.Tensor:
    """KDA's log decay from the raw gate input ``g [B, T, HV, K]`` (fla's ``use_gate_in_kernel``).

    ``−exp(A_log)·softplus(g + dt_bias)`` (Kimi Linear's gate; ``A_log [HV]``, ``dt_bias [HV·K]``
    or ``[HV, K]``), or with ``lower_bound`` (< 0) ``lower_bound·sigmoid(exp(A_log)·(g + dt_bias))``,
    bounded in (lower_bound, 0). Computed in fp32 (fp64 for fp64 ``g``).
    """
    hv, dk = g.shape[-2:]
    dt = state_dtype(g.dtype)
    x = g.to(dt)
    if dt_bias is not None:
        x = x + _param(op, "dt_bias", dt_bias, {(hv * dk,), (hv, dk)}, f"[HV·K] = [{hv * dk}]").to(dt).view(hv, dk)
    a = None if A_log is None else _param(op, "A_log", A_log, {(hv,)}, f"[HV] = [{hv}]").to(dt).view(hv, 1)
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not lower_bound < 0:
            raise ValueError(f"{op}: `lower_bound` must be a negative number (a log decay), got {lower_bound!r}")
        return lower_bound * torch.sigmoid(x if a is None else torch.exp(a) * x)
    if a is None:
        raise ValueError(f"{op}: `use_gate_in_kernel=True` needs `A_log` [HV]=[{hv}] (or a `lower_bound`)")
    return -torch.exp(a) * F.softplus(x)


_REFUSED_KDA: dict = {}
_IGNORED_KDA = ("safe_gate", "disable_recompute", "use_graph", "max_num_seqs")


def kda_inputs(
    op: str, q, k, v, g, beta, initial_state, cu_seqlens, *,
    gk=None, gv=None, gv_supported: bool, use_gate_in_kernel: bool = False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
    cu_seqlens_cpu=None, kwargs: Optional[dict] = None,
):
    """fla's KDA options -> ``(q, k, beta, gk, gv, initial_state, cu_seqlens, gk_name)`` (module docstring).

    ``g`` and ``gk`` name the same per-key-channel gate (``gk_name`` says which one the
    caller used, for error messages). ``gv_supported`` is False for the parallel and
    chunk forms, which refuse ``gv``.
    """
    kwargs = dict(kwargs or {})
    for name, why in _REFUSED_KDA.items():
        if kwargs.pop(name, False):
            raise ValueError(f"{op}: `{name}`=True is not supported: {why}")
    for name in _IGNORED_KDA:
        kwargs.pop(name, None)
    if g is not None and gk is not None:
        raise ValueError(
            f"{op}: got both `g` and `gk`; give one per-key-channel log decay [B, T, HV, K] (fla's KDA calls it "
            f"`g`). To combine a per-head decay g [B, T, HV] with gk, pass gk + g[..., None]"
        )
    gk_name = "g" if g is not None else "gk"
    gate = g if g is not None else gk
    if gv is not None and not gv_supported:
        raise ValueError(
            f"{op}: `gv` (a per-value-channel decay) is supported by the recurrent form only "
            f"(recurrent_kda, fused_recurrent_kda, fused_recurrent_gated_delta_rule): with a value-side decay "
            f"every value column has its own UT system, V triangular solves per chunk instead of one"
        )
    q, k, beta, _, initial_state, cu_seqlens = fla_inputs(
        op, q, k, v, beta, None, initial_state, cu_seqlens, gated=True,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        cu_seqlens_cpu=cu_seqlens_cpu, kwargs=kwargs, per_head_decay=False,
    )
    if use_gate_in_kernel:
        if not isinstance(gate, torch.Tensor) or gate.dim() != 4:
            raise ValueError(f"{op}: `use_gate_in_kernel=True` needs `{gk_name}`, the raw gate input [B, T, HV, K]")
        gate = kda_gate(gate, A_log, dt_bias, lower_bound, op)
    return q, k, beta, gate, gv, initial_state, cu_seqlens, gk_name


def run_kda(
    spec: OpSpec, gv_supported: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    *,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    qk_norm: Optional[str] = None,
    max_seqlen: Optional[int] = None,
    backend: str = "auto",
    state_block_size: Optional[int] = None,
    state_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[Optional[torch.Tensor], ...]:
    """The body of every KDA form (:func:`kda_form`): fla's options (:func:`kda_inputs`), then the
    dispatcher (:func:`~fastweights.ops._dispatch.run`) with the form's spec. After ``spec`` and
    ``gv_supported``, the arguments of the forms: fla 0.6.0's ``chunk_kda`` in its positional
    order, then ours by keyword (``chunk_size``: None is :func:`~fastweights.ops.default_chunk_size`'s
    choice, as for every chunk op; ``backend`` as in ``chunk_delta_rule``). ``safe_gate`` and
    ``disable_recompute`` are fla's kernel hints (ignored); ``state_v_first`` is handled by
    :func:`~.._forms.accepts_state_v_first`."""
    op = spec.name
    q, k, beta, gk, gv, initial_state, cu_seqlens, gk_name = kda_inputs(
        op, q, k, v, g, beta, initial_state, cu_seqlens, gk=gk, gv=gv, gv_supported=gv_supported,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        cu_seqlens_cpu=cu_seqlens_cpu, kwargs=kwargs,
    )
    if isinstance(v, torch.Tensor) and v.dim() == 4 and isinstance(q, torch.Tensor) and q.dim() == 4:
        gk_name = "gk" if gk is None else gk_name
        gk = resolve_decay(gk, v.shape[:3] + (q.shape[-1],), state_dtype(q.dtype), q.device)
    return run(
        spec, q, k, v, backend=backend, beta=beta, gk=gk, gv=gv, gk_name=gk_name, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        max_seqlen=max_seqlen, chunk_size=chunk_size, qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm,
        requires_beta=True, allow_neg_eigval=allow_neg_eigval,
            return_intermediate_states=return_intermediate_states, state_block_size=state_block_size,
            state_indices=state_indices, has_initial_state=has_initial_state,
    )


#: The signature every KDA form has: :func:`run_kda`'s, after its first two parameters.
FORM_SIGNATURE = inspect.signature(run_kda).replace(parameters=list(inspect.signature(run_kda).parameters.values())[2:])
