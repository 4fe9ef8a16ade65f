"""One token of each rule: write ``(k, v)`` into the state, then read it with ``q``.

These are the recurrent forms' step, public: ``recurrent_delta_rule``,
``recurrent_gated_delta_rule`` and ``recurrent_linear_attn`` run exactly the same
arithmetic token by token (the PyTorch path below is the function they loop over), so
the reference of each step is its recurrent form, which the test suite checks it against.
The layers and the LM decode through these functions.

Shapes (N rows, H heads; no time axis)::

    q, k   [N, H, K]      v   [N, H, V]      beta, g   [N, H]      state   [N, H, K, V]

The state is fp32 (fp64 for a float64 computation); the inputs are cast to its dtype and
the read ``o [N, H, V]`` comes back in ``v``'s dtype. Per head, with α = exp(g)::

    delta rule         h ← h + β k (v − hᵀk)ᵀ            o = scale · hᵀq
    gated delta rule   h ← α h, then the delta write     o = scale · hᵀq
    linear attention   h ← α h + k vᵀ                    o = scale · hᵀq
    KDA                h ← diag(α) h, then the delta write (gk [N, H, K]: one decay per key channel)

``k`` and ``q`` are used as given: apply the feature map φ and any q/k normalization
first, as the layers do (the full ops take ``feature_map`` / ``qk_norm`` and do it
themselves). The input ``state`` is not modified unless ``inplace=True``.

On CUDA the (gated) delta step runs a fused Triton kernel that reads and writes the state
once (``backend="auto"`` picks it when Triton is installed, the inputs are fp32/bf16/fp16,
the state is fp32 and K, V <= 256). On the CPU (``backend="auto"`` or ``"cpu"``) with a
contiguous state and no gradient to record the compiled kernel ``fastweights/ops/cpu/decode_step.cpp`` runs the same algebra, reading
the state from memory once and writing it once (``FASTWEIGHTS_CPU_KERNELS=0`` or
``fastweights.ops.cpu.set_enabled(False)`` turns it off; a failed build falls back); under
``torch.compile`` the graph calls it as the custom op ``fastweights::delta_step_out`` (or
``delta_step_inplace``), the same kernel as eager. Elsewhere, and always with
``backend="torch"``, it is the PyTorch step.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._checks import resolve_scale
from .cpu import kernels_for
from ._backend import BACKENDS, HAS_TRITON, MAX_HEAD_DIM, TRITON_DTYPES, interpreting

__all__ = ["delta_rule_step", "gated_delta_rule_step", "linear_attn_step", "kda_step"]


def delta_update(q, k, v, beta, g, h, scale, inplace: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (gated) delta rule's token, unchecked, on tensors already in the state's dtype:
    ``q, k [..., K]``, ``v [..., V]``, ``beta [...]``, ``g [...]`` or None, ``h [..., K, V]``
    -> ``(o [..., V], h')``; ``h'`` is a new tensor, or ``h`` itself updated with ``inplace``
    (``h`` contiguous). The recurrent forms loop over it.

    A step is bound by memory traffic over the state, so it passes over h as few times as
    it can: one batched product reads both hᵀk and hᵀq, and the read of the new state is
    assembled from them, ``h'ᵀq = α hᵀq + (kᵀq) u`` with ``u = β (v − α hᵀk)``; then one
    pass writes ``h' = α h + k uᵀ`` (two passes with a gate: scale, then add).
    """
    shape, (dk, dv) = h.shape, h.shape[-2:]
    h = h.view(-1, dk, dv) if inplace else h.reshape(-1, dk, dv)
    k, q = k.reshape(-1, 1, dk), q.reshape(-1, 1, dk)
    reads = torch.bmm(torch.cat([k, q], dim=1), h)  # [NH, 2, V]: hᵀk and hᵀq, one pass over h
    if g is not None:
        alpha = torch.exp(g).reshape(-1, 1, 1)
        reads.mul_(alpha)  # the reads of the decayed state α h
        h = h.mul_(alpha) if inplace else h * alpha
    u = (v.reshape(-1, 1, dv) - reads[:, :1]).mul_(beta.reshape(-1, 1, 1))  # β (v − (α h)ᵀk)
    if inplace or g is not None:  # h is ours to update (the state itself, or the decayed copy)
        h = h.addcmul_(k.transpose(1, 2), u)
    else:
        h = torch.addcmul(h, k.transpose(1, 2), u)  # h + k uᵀ (broadcast: faster than a bmm of inner size 1)
    o = torch.addcmul(reads[:, 1:], (q * k).sum(-1, keepdim=True), u).mul_(scale)  # scale · h'ᵀq
    return o.view(shape[:-2] + (dv,)), h.view(shape)


def sum_update(q, k, v, g, h, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """Linear attention's (the sum rule's) token, unchecked: ``q, k [..., K]``, ``v [..., V]``,
    ``g [...]`` or None, ``h [..., K, V]`` -> ``(o [..., V], h')`` (before any normalizer division)."""
    shape, (dk, dv) = h.shape, h.shape[-2:]
    h = h.reshape(-1, dk, dv)
    if g is not None:
        h = h * torch.exp(g).reshape(-1, 1, 1)
    h = torch.addcmul(h, k.reshape(-1, dk, 1), v.reshape(-1, 1, dv))  # write φ(k) vᵀ
    o = torch.bmm(q.reshape(-1, 1, dk), h).mul_(scale)  # read hᵀ φ(q)
    return o.view(shape[:-2] + (dv,)), h.view(shape)


def _check(op: str, q, k, v, state, value_dim: Optional[int] = None, **per_head) -> None:
    """Types and shapes (cheap: no tensor values are read)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state), *per_head.items()):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"{op}: `q` and `k` must both have shape [N, H, K], got {list(q.shape)} and {list(k.shape)}")
    n, h, dk = q.shape
    if v.dim() != 3 or tuple(v.shape[:2]) != (n, h):
        raise ValueError(f"{op}: `v` must have shape [N, H, V] = [{n}, {h}, V], got {list(v.shape)}")
    for name, t in per_head.items():
        if t is not None and tuple(t.shape) != (n, h):
            raise ValueError(f"{op}: `{name}` must have shape [N, H] = [{n}, {h}], got {list(t.shape)}")
    dv = v.shape[-1] if value_dim is None else value_dim
    if tuple(state.shape) != (n, h, dk, dv):
        raise ValueError(f"{op}: `state` must have shape [N, H, K, V] = [{n}, {h}, {dk}, {dv}], got {list(state.shape)}")
    if state.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: `state` must be float32 (float64 for a float64 computation), got {state.dtype}")


def _native_step(q, k, v, beta, g, state, scale, inplace):
    """The step by the compiled CPU kernel (``fastweights/ops/cpu/decode_step.cpp``: the algebra of
    :func:`delta_update`, the state read from memory once and written once, one head per task),
    or None where it does not apply: not the CPU, a non-contiguous state, a gradient to record,
    or the kernels off or unbuilt."""
    if not state.is_contiguous() or state.numel() == 0:
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, beta, g, state)):
        return None
    mod = kernels_for(state)  # (the kernel casts the inputs to the state's dtype itself)
    if mod is None:
        return None
    return tuple(mod.delta_step(q, k, v, beta, g, state, float(scale), bool(inplace)))


def _check_pool(op, q, v, state, state_indices, has_initial_state, value_dim=None) -> None:
    """The pool form's checks (``state [S, H, K, V]``, ``state_indices [N]``), before anything is written."""
    from .state_pool import check_state_indices

    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"{op}: `q` must have shape [N, H, K], got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    check_state_indices(op, state, state_indices, q.shape[0], has_initial_state, pool_name="state")
    n, h, dk = q.shape
    dv = v.shape[-1] if value_dim is None else value_dim
    if tuple(state.shape[1:]) != (h, dk, dv):
        raise ValueError(f"{op}: the pool `state` must have shape [S, H, K, V] = [S, {h}, {dk}, {dv}], "
                         f"got {list(state.shape)}")


def _pool_step(op, step, q, state, state_indices, has_initial_state):
    """Run ``step(h0) -> (o, h')`` on the sessions' states gathered from the pool and write h' back
    to their slots (the pool form wherever the compiled kernel does not run); returns ``(o, pool)``."""
    from .state_pool import gather_states, scatter_states

    o, h = step(gather_states(state, state_indices, has_initial_state))
    with torch.no_grad():
        scatter_states(state, state_indices, h)
    return o, state


def _delta_step(op, q, k, v, beta, g, state, scale, inplace, backend, state_indices=None, has_initial_state=None):
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown `backend` {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    if state_indices is not None or has_initial_state is not None:
        if state_indices is None:
            raise ValueError(f"{op}: `has_initial_state` needs `state_indices` (the pool's slot of each row)")
        _check_pool(op, q, v, state, state_indices, has_initial_state)
        mod = None
        if state.is_contiguous() and not (torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (q, k, v, beta, g, state))) and backend in ("auto", "cpu"):
            mod = kernels_for(state)
        if mod is not None and not state_indices.is_cuda:  # in place at the slots: no gathered copy
            rows = torch.empty((q.shape[0],) + tuple(state.shape[1:]), dtype=state.dtype, device="meta")
            _check(op, q, k, v, rows, beta=beta, g=g)  # the other inputs' shapes, against N rows of the pool
            fresh = None if has_initial_state is None else has_initial_state.cpu()
            o = mod.delta_step_pool(q, k, v, beta, g, state, state_indices.long(), fresh, float(resolve_scale(scale, q.shape[-1])))
            return o, state
        return _pool_step(op, lambda h0: _delta_step(op, q, k, v, beta, g, h0, scale, True, backend),
                          q, state, state_indices, has_initial_state)
    _check(op, q, k, v, state, beta=beta, g=g)
    dk, dv = q.shape[-1], v.shape[-1]
    scale = resolve_scale(scale, dk)
    fits = q.dtype in TRITON_DTYPES and state.dtype == torch.float32 and max(dk, dv) <= MAX_HEAD_DIM
    if backend == "auto":
        backend = "triton" if HAS_TRITON and q.is_cuda and fits else ("cpu" if state.device.type == "cpu" else "torch")
    if backend == "cpu" and state.device.type != "cpu":
        raise ValueError(f"{op}: backend='cpu' runs the compiled CPU kernel on CPU tensors, got `state` on {state.device}; "
                         f"use backend='auto' or 'torch'")
    if backend == "triton":
        if not HAS_TRITON:
            raise ImportError(f"{op}: backend='triton' needs the triton package: pip install 'fastweights[triton]'")
        if not q.is_cuda and not interpreting():
            raise ValueError(f"{op}: backend='triton' needs CUDA tensors, got `q` on {q.device}")
        if not fits:
            raise ValueError(f"{op}: backend='triton' needs fp32/bf16/fp16 inputs, an fp32 state and K, V <= "
                             f"{MAX_HEAD_DIM}; got {q.dtype}, state {state.dtype}, K={dk}, V={dv}")
        from .triton.decode import fused_delta_rule_step

        if not inplace or not state.is_contiguous():
            state = state.clone(memory_format=torch.contiguous_format)
        o = fused_delta_rule_step(q, k, v, beta, g, state, scale)
        return o, state
    dt = state.dtype
    native = _native_step(q, k, v, beta, g, state, scale, inplace) if backend == "cpu" else None  # "torch": PyTorch only
    if native is not None:
        return native
    direct = inplace and state.is_contiguous()  # update the state where it lies: no copy back
    o, h = delta_update(q.to(dt), k.to(dt), v.to(dt), beta.to(dt), None if g is None else g.to(dt), state, scale,
                        inplace=direct)
    if inplace:
        if not direct:
            state.copy_(h)
        h = state  # the caller's tensor itself
    return o.to(v.dtype), h


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    scale: Optional[float] = None, *, inplace: bool = False, backend: str = "auto",
    state_indices: Optional[torch.Tensor] = None, has_initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the delta rule (DeltaNet): ``h ← h + β k (v − hᵀk)ᵀ``, then ``o = scale · hᵀq``.

    Args:
        q, k: ``[N, H, K]`` (k unit length for a stable rule: normalize it first).
        v: ``[N, H, V]``.
        beta: ``[N, H]`` write strengths, in (0, 1) (or (0, 2) with negative eigenvalues allowed).
        state: ``[N, H, K, V]``, fp32 (fp64 for a float64 computation).
        scale: read scale; ``None`` means ``K ** -0.5``.
        inplace: write the new state into ``state`` (and return it) instead of a new tensor.
        backend: ``"auto"``, ``"torch"`` (PyTorch only), ``"cpu"`` (the compiled CPU kernel) or
            ``"triton"`` (the fused kernel; see the module docstring).
        state_indices: ``[N]`` int32/int64 or None. Given, ``state`` is a pool ``[S, H, K, V]`` and row n
            reads and writes slot ``state_indices[n]`` in place (-1: start from zeros, write nothing);
            ``has_initial_state [N]`` bool marks fresh sessions (start from zeros, write the slot).
            :mod:`fastweights.ops.state_pool`; on the CPU the compiled kernel works at the slots.

    Returns:
        ``(o [N, H, V] in v's dtype, state [N, H, K, V])``; equal to one token of
        :func:`~fastweights.ops.recurrent_delta_rule` from ``state``. With ``state_indices``:
        ``(o, pool)``, the pool updated.
    """
    return _delta_step("delta_rule_step", q, k, v, beta, None, state, scale, inplace, backend,
                       state_indices, has_initial_state)


def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, state: torch.Tensor,
    scale: Optional[float] = None, *, inplace: bool = False, backend: str = "auto",
    state_indices: Optional[torch.Tensor] = None, has_initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule: ``h ← exp(g) h``, the delta write, then ``o = scale · hᵀq``.

    Arguments as :func:`delta_rule_step` (the pool form, ``state_indices``, included), plus ``g [N, H]``,
    the log decay (<= 0).
    Equal to one token of :func:`~fastweights.ops.recurrent_gated_delta_rule` from ``state``.
    """
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"gated_delta_rule_step: `g` must be a torch.Tensor of shape [N, H], got {type(g).__name__}")
    return _delta_step("gated_delta_rule_step", q, k, v, beta, g, state, scale, inplace, backend,
                       state_indices, has_initial_state)


def linear_attn_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, *, normalize: bool = False, eps: float = 1e-6, inplace: bool = False,
    state_indices: Optional[torch.Tensor] = None, has_initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of linear attention (the sum rule): ``h ← exp(g) h + k vᵀ``, then ``o = scale · hᵀq``.

    Args:
        q, k: ``[N, H, K]``, already through the feature map φ (and any q/k normalization).
        v: ``[N, H, V]``.
        state: ``[N, H, K, V]``, or ``[N, H, K, V + 1]`` with ``normalize`` (the last column
            holds the normalizer z = Σ φ(k)), fp32 (fp64 for a float64 computation).
        g: ``[N, H]`` log decay, or ``None`` for none.
        scale: read scale; ``None`` means ``K ** -0.5`` (with ``normalize`` it cancels).
        normalize: divide the read by ``scale · φ(q)ᵀ z + eps``.
        eps: added to the normalizer.
        inplace: write the new state into ``state`` instead of a new tensor.
        state_indices, has_initial_state: the pool form, as in :func:`delta_rule_step` (here
            the states are gathered from the pool and written back).

    Returns:
        ``(o [N, H, V] in v's dtype, state)``; equal to one token of
        :func:`~fastweights.ops.recurrent_linear_attn` (same ``normalize``, ``eps``) from ``state``.
    """
    op = "linear_attn_step"
    if state_indices is not None or has_initial_state is not None:
        if state_indices is None:
            raise ValueError(f"{op}: `has_initial_state` needs `state_indices` (the pool's slot of each row)")
        _check_pool(op, q, v, state, state_indices, has_initial_state,
                    value_dim=v.shape[-1] + int(bool(normalize)) if isinstance(v, torch.Tensor) else None)
        return _pool_step(op, lambda h0: linear_attn_step(q, k, v, h0, g, scale, normalize=normalize, eps=eps),
                          q, state, state_indices, has_initial_state)
    _check(op, q, k, v, state, value_dim=v.shape[-1] + int(bool(normalize)) if isinstance(v, torch.Tensor) else None, g=g)
    dt = state.dtype
    v_in = v.to(dt)
    if normalize:
        v_in = normalizer_column(v_in)
    o, h = sum_update(q.to(dt), k.to(dt), v_in, None if g is None else g.to(dt), state, resolve_scale(scale, q.shape[-1]))
    if normalize:
        o = divide_by_normalizer(o, eps)
    if inplace:
        state.copy_(h)
        h = state
    return o.to(v.dtype), h


# -- Kimi Delta Attention (per-channel decay, fastweights/ops/kda/) ------------------------------


def _native_kda_step(q, k, v, beta, gk, h, scale):
    """:func:`kda_step` by the compiled CPU kernel (``fastweights/ops/cpu/chunk_kda.cpp``: the state
    read once and written once, one head per task), or None where it does not apply: not the CPU,
    a non-contiguous or empty state, a gradient to record, or the kernels off or unbuilt."""
    if not h.is_contiguous() or h.numel() == 0:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, beta, gk, h)):
        return None
    mod = kernels_for(h)  # (the kernel casts the inputs to the state's dtype itself)
    if mod is None or any(t.device.type != "cpu" for t in (q, k, v, beta, gk)):
        return None
    dk, dv = h.shape[-2:]
    o, h_new = mod.kda_step(q, k, v, beta, gk, h.view(-1, dk, dv), float(scale))
    return o.view(h.shape[:-2] + (dv,)).to(v.dtype), h_new.view(h.shape)


def kda_step(q, k, v, beta, gk, h, scale, gv=None, *, state_indices: Optional[torch.Tensor] = None,
             has_initial_state: Optional[torch.Tensor] = None, backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of KDA: ``q, k, gk [..., K]``, ``v [..., V]``, ``beta [...]``, state
    ``h [..., K, V]`` (``gv [..., V]`` optional) -> ``(o [..., V], h')``.

    A layer's decoding step calls it on tensors it has already checked, in the compute
    dtype. On the CPU, with no gradient to record and no ``gv``, the compiled step runs it
    (:mod:`fastweights.ops.cpu`; ``backend`` ``"auto"`` or ``"cpu"``); otherwise, with
    ``backend="torch"`` and in ``kda_recurrence`` (the reference), :func:`kda_update`.

    The pool form (the serving engines' call, as :func:`~fastweights.ops.delta_rule_step`'s):
    ``h [S, H, K, V]`` a pool of states, ``q [N, H, K]``, ``state_indices [N]`` the slot each row
    reads and writes in place (−1: a fresh zero state, not written back), ``has_initial_state
    [N]`` bool (False: start from zeros, still write the slot); returns ``(o, the pool)``. Bad
    slots are a ``ValueError`` naming ``state_indices``, with the pool untouched.
    """
    if backend not in BACKENDS or backend == "triton":
        raise ValueError(f"kda_step: `backend`={backend!r} is not one this step runs; expected 'auto', 'torch' or 'cpu'")
    if state_indices is not None or has_initial_state is not None:
        if state_indices is None:
            raise ValueError("kda_step: `has_initial_state` needs `state_indices` (the pool's slot of each row)")
        _check_pool("kda_step", q, v, h, state_indices, has_initial_state)
        return _pool_step("kda_step", lambda h0: kda_step(q, k, v, beta, gk, h0, scale, gv, backend=backend), q, h,
                          state_indices, has_initial_state)
    if gv is None and backend != "torch":
        native = _native_kda_step(q, k, v, beta, gk, h, scale)
        if native is not None:
            return native
    return kda_update(q, k, v, beta, gk, h, scale, gv)


def kda_decay(h: torch.Tensor, gk: torch.Tensor, gv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """KDA's per-channel decay of the state ``h [..., K, V]``: ``diag(e^{gk}) h`` (and ``h diag(e^{gv})``),
    as ``[-1, K, V]``."""
    dk, dv = h.shape[-2:]
    h = h.reshape(-1, dk, dv) * torch.exp(gk).reshape(-1, dk, 1)  # diag(α) h
    if gv is not None:
        h = h * torch.exp(gv).reshape(-1, 1, dv)
    return h


def kda_update(q, k, v, beta, gk, h, scale, gv=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`kda_step` in PyTorch (same arguments and returns): the reference's step."""
    shape, (dk, dv) = h.shape, h.shape[-2:]
    h = kda_decay(h, gk, gv)
    k = k.reshape(-1, 1, dk)
    u = (v.reshape(-1, 1, dv) - torch.bmm(k, h)).mul_(beta.reshape(-1, 1, 1))  # β (v − h'ᵀk)
    h = torch.addcmul(h, k.transpose(1, 2), u)
    o = torch.bmm(q.reshape(-1, 1, dk), h).mul_(scale)
    return o.view(shape[:-2] + (dv,)), h.view(shape)


def scan_tokens(step, h: torch.Tensor, scale: float, *per_token: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The loop of every recurrent form: ``o_t, h = step(x_1[:, :, t], ..., x_n[:, :, t], h, scale)`` for
    each token t of the head-first ``per_token`` tensors ``[N, H, T, ·]`` (a None stays None), from the
    state ``h [N, H, K, V]``; returns ``(o [N, H, T, V], h_T)``. The third tensor is v (T = 0: o is
    its zeros with the state's V)."""
    outputs = []
    for t in range(per_token[0].shape[2]):
        o_t, h = step(*(None if x is None else x[:, :, t] for x in per_token), h, scale)
        outputs.append(o_t)
    v = per_token[2]
    return (torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape[:3] + h.shape[-1:])), h


def normalizer_column(v: torch.Tensor) -> torch.Tensor:
    """``v [..., V]`` -> ``[..., V + 1]`` with a last column of ones: the normalizer
    z_t = α_t z_{t−1} + φ(k_t) is the state written with value 1, carried as h's last column."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def divide_by_normalizer(o: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``o [..., V + 1]`` (a read of [S | z]) -> ``o / (scale·φ(q)ᵀ z + eps)``, ``[..., V]``."""
    return o[..., :-1] / (o[..., -1:] + eps)
