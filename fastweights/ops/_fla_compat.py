"""flash-linear-attention (fla 0.6.0) call forms: every fla argument we accept, alias or refuse.

Code written for fla, and ``transformers`` models that call fla's gated ops, should
run on :mod:`fastweights.ops` unchanged. This module is the one place that turns
fla's options into our plain ``(q, k, v, beta, g, initial_state)`` arguments: the delta
and gated ops' public functions (``ops/<rule>/api.py``) call :func:`run_fla`, which maps them
(:func:`fla_inputs`) and hands the op to the dispatcher; the other families' fla modules call
:func:`fla_inputs` in their own mapping.

Accepted (same meaning as in fla):

==============================  ============================================================
argument                        what we do
==============================  ============================================================
``use_qk_l2norm_in_kernel``     ``qk_norm="l2"``: ``x · rsqrt(Σx² + 1e-6)``, fla's formula
``use_beta_sigmoid_in_kernel``  β = sigmoid(beta) (gated ops)
``allow_neg_eigval``            with the sigmoid, β = 2·sigmoid(beta) ∈ (0, 2); without it
                                β is taken as given and may lie in [0, 2] (fla raises a
                                ``ValueError`` there; ours is the wider contract)
``use_gate_in_kernel``,         g = −exp(A_log) · softplus(g + dt_bias), computed in fp32
``A_log``, ``dt_bias``          (fp64 for fp64 inputs); ``A_log``/``dt_bias`` are ``[HV]``;
                                without ``use_gate_in_kernel`` they are ignored, as in fla
grouped value heads             ``v [B, T, HV, V]`` with HV a multiple of H: q/k head i
                                serves value heads i·HV/H … (i+1)·HV/H − 1 (gated and
                                delta ops; fla has it on the gated ones)
``beta=None``                   β = 1 (fla's ``fused_recurrent_*`` default)
``g=None`` (gated ops)          no decay, g = 0 (fla's ``fused_recurrent_*`` default)
bf16/fp16 ``initial_state``     cast to the state dtype (fp32, fp64 for fp64 inputs)
``state_v_first`` (gated ops)   the states in and out are ``[N, HV, V, K]`` (transposed at
                                the boundary; fla's GatedDeltaNet layer passes True);
                                ``transpose_state_layout``, its deprecated name, too
``cu_seqlens_cpu``              a host copy of ``cu_seqlens``; used when ``cu_seqlens`` is None
``chunk_indices``               ignored (fla's precomputed chunk table; we derive our own)
``**kwargs``                    names in :data:`PASS_THROUGH` are ignored silently; any other
                                name is refused with a ``TypeError`` ("did you mean
                                `cu_seqlens`?" when it is close to an argument of the op)
==============================  ============================================================

Per-channel decays: ``fused_recurrent_gated_delta_rule(..., gk=, gv=)`` runs
:func:`~fastweights.ops.recurrent_kda` (Kimi Delta Attention; fla's KDA options are in
:mod:`fastweights.ops.kda.fla`); the other ops refuse ``gk``/``gv``.

Refused with a ``ValueError`` naming the argument (they would change the result
and we have no equivalent): ``gk``/``gv`` outside the KDA ops, ``state_v_first``
/ ``transpose_state_layout`` = True on the (ungated) delta rule, ``reverse=True``,
``head_first=True``, ``cp_context`` (context parallelism).

Aliases with fla's exact signatures (positional order included), in ``_fla_aliases.py``
(which imports the ops; this module is imported by them):
``fused_recurrent_delta_rule``, ``fused_recurrent_gated_delta_rule`` (aliases of the
recurrent forms), ``fused_recurrent_linear_attn`` (recurrent form) and
``fused_chunk_linear_attn`` (chunk form).

Where fla's defaults differ from ours (docs: README, "fla compatibility"):

=====================================  =====================  ======================
what                                   fla 0.6.0              fastweights
=====================================  =====================  ======================
``normalize`` of ``chunk_linear_attn``  True                   False (the alias
                                                               ``fused_chunk_linear_attn``
                                                               keeps fla's True)
normalizer ε of linear attention       1e-10                  1e-6 (``eps``; the aliases
                                                               pass 1e-10)
normalized linear-attention state      tuple ``(S, z)``,      one ``[N, H, K, V + 1]``
                                       z ``[N, 1, H, K]``     tensor (aliases: fla's tuple)
``chunk_size`` of the gated chunk op    16, 32 or 64           any positive int
q/k feature map, ``qk_norm``           none                   ``feature_map``, ``qk_norm``
=====================================  =====================  ======================
"""

from __future__ import annotations

import difflib
import inspect
import sys
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from ._checks import state_dtype
from ._dispatch import run
from ._spec import OpSpec

__all__ = ["PASS_THROUGH", "fla_inputs", "run_fla"]

# Keyword arguments that callers (transformers' models, fla's layers) pass through the
# ops and that cannot change an op's result: ignored without a word.
PASS_THROUGH = frozenset({
    # transformers' per-call model kwargs (TransformersKwargs and friends)
    "use_cache", "output_attentions", "output_hidden_states", "output_router_logits", "return_dict",
    "position_ids", "cache_position", "past_key_values", "position_embeddings", "logits_to_keep",
    "num_items_in_batch", "cu_seq_lens_k", "max_length_q", "max_length_k",
    # fla's hints about how to run, not what to compute
    "chunk_indices",
})

# fla arguments that select a computation we do not have: refused while "on".
_REFUSED = {
    "gk": "this op takes a per-head log decay `g` [B, T, H]; per-key-channel decays are Kimi Delta Attention: "
          "use recurrent_kda / chunk_kda (or fused_recurrent_gated_delta_rule(..., gk=...))",
    "gv": "this op takes a per-head log decay `g` [B, T, H]; a per-value-channel decay is accepted by "
          "recurrent_kda and fused_recurrent_gated_delta_rule(..., gv=...) only",
    "state_v_first": "the delta rule's state is stored [N, H, K, V] (keys first); the gated ops accept it",
    "transpose_state_layout": "the delta rule's state is stored [N, H, K, V] (keys first); the gated ops accept it",
    "reverse": "reverse-time scans are not supported",
    "head_first": "inputs are always [B, T, H, D] (fla removed head_first too)",
    "cp_context": "context parallelism is not supported",
}

# Names accepted as before (ignored, with one warning) while their real argument is being added.
_PENDING = frozenset({"cp_group"})
_warned: set = set()


def _known_arguments(op: str) -> list:
    """The keyword arguments of the public op named ``op`` (for "did you mean")."""
    ops = sys.modules.get(__name__.rsplit(".", 1)[0])  # fastweights.ops: imported by now (it called us)
    public = getattr(ops, op, None) or (lambda: None)
    fn = inspect.unwrap(public)
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    # an op wrapped by accepts_state_v_first takes fla's state-layout flags too
    return names + ["state_v_first", "transpose_state_layout"] * (fn is not public)


def resolve_cu_seqlens(op: str, cu_seqlens, cu_seqlens_cpu, device):
    """The one owner of ``cu_seqlens``: itself, or the device copy of fla's host copy ``cu_seqlens_cpu``
    when only that is given."""
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        if not isinstance(cu_seqlens_cpu, torch.Tensor):
            raise TypeError(f"{op}: `cu_seqlens_cpu` must be a LongTensor [N+1], got {type(cu_seqlens_cpu).__name__}")
        cu_seqlens = cu_seqlens_cpu.to(device)
    return cu_seqlens


def resolve_decay(g, shape, dtype, device):
    """The one owner of a log decay's ``None`` (fla's default for ``g``/``gk``): no decay, zeros of ``shape``."""
    if g is None:
        g = torch.zeros(shape, dtype=dtype, device=device)
    return g


def unknown_keyword(op: str, name: str, known) -> TypeError:
    """The TypeError for an unknown keyword argument, with the closest known name when one is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return TypeError(f"{op}() got an unexpected keyword argument `{name}`{hint} (accepted: the op's arguments, "
                     f"and the pass-through names in fastweights.ops._fla_compat.PASS_THROUGH)")


def refuse_or_ignore(op: str, kwargs: dict) -> None:
    """Refuse the fla options we cannot honour and unknown names; ignore pass-through names."""
    for name, value in kwargs.items():
        if name in _REFUSED:
            if value is not None and value is not False:
                shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
                raise ValueError(f"{op}: `{name}`={shown} is not supported: {_REFUSED[name]}")
        elif name in _PENDING:
            if (op, name) not in _warned:
                _warned.add((op, name))
                warnings.warn(f"{op}: ignoring `{name}` (not an option of this op yet)", UserWarning, stacklevel=4)
        elif name not in PASS_THROUGH:
            raise unknown_keyword(op, name, _known_arguments(op))


def _head_param(op: str, name: str, t, heads: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{op}: `{name}` must be a floating-point tensor of shape [HV]=[{heads}], got {what}")
    if tuple(t.shape) != (heads,):
        raise ValueError(f"{op}: `{name}` must have shape [HV] = [{heads}], got {list(t.shape)}")
    return t


def fla_inputs(
    op: str,
    q, k, v, beta, g, initial_state, cu_seqlens,
    *,
    gated: bool,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    kwargs: Optional[dict] = None,
    per_head_decay: bool = True,
):
    """Translate fla's options into plain op inputs; see the module docstring.

    ``per_head_decay=False`` (KDA, whose decay is per key channel and resolved by its own front
    end): a gated op's ``g`` is passed through as given, no zeros made for a ``None``.

    Returns ``(q, k, beta, g, initial_state, cu_seqlens)``. q and k come back with
    HV heads when v has more heads than q (grouped value heads);
    β and g come back in the compute dtype when computed here. Shapes are checked
    by the op's own validation afterwards, except the ones only this step knows.
    """
    refuse_or_ignore(op, kwargs or {})
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4):
        return q, k, beta, g, initial_state, cu_seqlens  # the op's validation names the problem
    dt = state_dtype(q.dtype)

    cu_seqlens = resolve_cu_seqlens(op, cu_seqlens, cu_seqlens_cpu, q.device)

    h, hv = q.shape[2], v.shape[2]
    if hv != h and isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[2] == h:
        if hv % h:
            raise ValueError(
                f"{op}: `v` has {hv} heads, which is not a multiple of the {h} heads of `q`/`k` "
                f"(grouped value heads need HV = r·H); got v {list(v.shape)}, q {list(q.shape)}"
            )
        q, k = q.repeat_interleave(hv // h, dim=2), k.repeat_interleave(hv // h, dim=2)

    if gated:
        if use_beta_sigmoid_in_kernel and isinstance(beta, torch.Tensor):
            beta = torch.sigmoid(beta.to(dt)) * (2.0 if allow_neg_eigval else 1.0)

        if use_gate_in_kernel:
            if g is None:
                raise ValueError(f"{op}: `use_gate_in_kernel=True` needs `g`, the raw gate input [B, T, HV]")
            if A_log is None:
                raise ValueError(f"{op}: `use_gate_in_kernel=True` needs `A_log` [HV]=[{v.shape[2]}]")
            a = _head_param(op, "A_log", A_log, v.shape[2]).to(dt)
            x = g.to(dt)
            if dt_bias is not None:
                x = x + _head_param(op, "dt_bias", dt_bias, v.shape[2]).to(dt)
            g = -torch.exp(a) * F.softplus(x)
        elif per_head_decay:
            g = resolve_decay(g, v.shape[:3], dt, v.device)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=dt, device=v.device)

    if (isinstance(initial_state, torch.Tensor) and initial_state.dtype in (torch.float16, torch.bfloat16)
            and dt != initial_state.dtype):
        initial_state = initial_state.to(dt)
    return q, k, beta, g, initial_state, cu_seqlens


def run_fla(
    spec: OpSpec, q, k, v, beta, g, initial_state, cu_seqlens, *,
    gated: bool,
    qk_norm: Optional[str] = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    extra: Optional[dict] = None,
    **options,
):
    """The body of the delta rule's and the gated delta rule's public ops: fla's options to plain
    inputs (:func:`fla_inputs`; ``extra`` is the op's ``**extra``), then the dispatcher
    (:func:`~fastweights.ops._dispatch.run`) with ``spec``, β required (and g for the gated ops) and
    ``options`` (``chunk_size``, ``backend``, ``feature_map``, the serving options, ...) as they are."""
    q, k, beta, g, initial_state, cu_seqlens = fla_inputs(
        spec.name, q, k, v, beta, g, initial_state, cu_seqlens, gated=gated,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=extra,
    )
    return run(spec, q, k, v, beta=beta, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens,
               cu_seqlens_cpu=cu_seqlens_cpu, qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm,
               requires_beta=True, requires_g=gated, allow_neg_eigval=allow_neg_eigval, **options)
