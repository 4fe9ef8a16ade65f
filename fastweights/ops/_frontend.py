"""The one front end every linear/delta op goes through.

``run_op`` does, in order: check the inputs; cast to the compute dtype (fp32, or
fp64 for fp64 inputs); apply the feature map φ and the q/k normalization; unpack
``cu_seqlens`` into a right-padded batch whose padding tokens are no-ops
(k = v = 0, β = 0, g = 0: they neither write nor decay, so a padded sequence
ends in exactly the state of its last real token); move to the head-first
layout ``[N, H, T, D]`` that the solvers use; call the form's solver; and undo
all of that on the way out.

A solver ("core") has the signature
``core(q, k, v, beta, g, h0, scale) -> (o, h_T)`` on head-first compute-dtype tensors,
with ``beta``/``g``/``h0`` possibly ``None``; a chunk form's solver also takes the keyword
``chunk_size``. That keeps
each form's file down to its algorithm.

What the op is comes from its :class:`~._spec.OpSpec` (the dispatcher, ``_dispatch.run``,
hands it over with the backend it chose and the resolved ``chunk_size``): a chunk form
gets ``chunk_size`` capped at the sequence (:func:`~._checks.effective_chunk_size`), and parallel and chunk forms are
refused before they allocate score matrices that cannot fit (``check_score_memory``).
An empty sequence (T = 0) never reaches a solver: the output is empty and the final
state is a copy of ``initial_state`` (zeros without one), so the caller never gets
its own tensor back.

Mixed precision (``torch.autocast``). Autocast would run every matmul of a
solver in bf16/fp16, including the products with the fp32 state. The ops follow
their own rule instead (low precision in, fp32 compute and state, input dtype
out): the solver runs with autocast switched off (:func:`autocast_off`), on
inputs cast to fp32 explicitly, and the output comes back in the dtype autocast
gave the inputs. float64 inputs inside an autocast region are refused
(:func:`check_autocast`): autocast never lowers float64, so fp64 there means a
reference computation has leaked into a mixed-precision region.

torch.compile. Nothing here reads tensor values when ``max_seqlen`` is given
with ``cu_seqlens`` (:class:`Packing`), so a compiled op has no graph break.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from ..config import check_int
from ._checks import (NO_CHUNKS, check_inputs, check_score_memory, compute_dtype, effective_chunk_size,
                      finite_checks_on, resolve_scale, state_dtype, value_checks_on)
from ._backend import backward_can_follow
from .feature_maps import FeatureMap, FeatureMapLike, Identity, get_feature_map, normalize_qk
from ._spec import Form, OpSpec, Rule
from .precision import autocast_off, check_autocast, product_dtype
from .step import divide_by_normalizer, normalizer_column
import fastweights.ops.cpu as cpu_kernels  # the module (tests set its bf16_unit); not `from . import`, which names the package


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(seq [T], pos [T])``: the sequence of each of ``total`` packed tokens and its position
    in that sequence. A search per token, not ``repeat_interleave`` of the lengths: the
    output shape is T, known without reading the offsets (no graph break when compiled)."""
    cu = cu_seqlens.long()
    tokens = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)
    return seq, tokens - cu[seq]


class Packing(NamedTuple):
    """How N sequences packed along T (``cu_seqlens``) map to a right-padded ``[N, T_max]`` batch.

    Fields: ``index [N, T_max]`` the packed position of each padded slot (clamped
    inside T for the padding), ``valid [N, T_max]`` which slots are real tokens,
    ``seq [T]``/``pos [T]`` each packed token's sequence and position in it.
    """

    index: torch.Tensor
    valid: torch.Tensor
    seq: torch.Tensor
    pos: torch.Tensor

    @staticmethod
    def build(cu_seqlens: torch.Tensor, total: int, max_seqlen: Optional[int] = None,
              cu_seqlens_cpu: Optional[torch.Tensor] = None) -> "Packing":
        """Index tables for ``total`` packed tokens; ``T_max`` = ``max_seqlen`` when given.

        Without ``max_seqlen`` the longest length is read from ``cu_seqlens_cpu`` (no
        device sync) or ``cu_seqlens``; under ``torch.compile`` that read is a graph
        break, which passing ``max_seqlen`` avoids.
        """
        cu = cu_seqlens.long()
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        if max_seqlen is None:
            host = cu if cu_seqlens_cpu is None else cu_seqlens_cpu.long()
            max_seqlen = int((host[1:] - host[:-1]).max())
        pos = torch.arange(max_seqlen, device=cu.device)
        valid = pos[None, :] < lengths[:, None]
        index = (starts[:, None] + pos[None, :]).clamp(max=total - 1)
        return Packing(index, valid, *packed_positions(cu, total))

    def pad(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``[1, T, ...]`` packed -> ``[N, T_max, ...]``, zeros in the padding."""
        if x is None:
            return None
        padded = x[0][self.index]
        mask = self.valid.reshape(self.valid.shape + (1,) * (padded.dim() - 2))
        return torch.where(mask, padded, torch.zeros((), dtype=x.dtype, device=x.device))

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pad`: ``[N, T_max, ...]`` -> ``[1, T, ...]`` (a gather: static shapes)."""
        return x[self.seq, self.pos].unsqueeze(0)


def check_op_args(
    op: str,
    q,
    k,
    v,
    *,
    beta=None,
    g=None,
    initial_state=None,
    cu_seqlens=None,
    chunk_size=NO_CHUNKS,
    scale=None,
    feature_map: FeatureMapLike = None,
    qk_norm: Optional[str] = None,
    normalize: bool = False,
    requires_beta: bool = False,
    requires_g: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens_cpu=None,
    max_seqlen=None,
    seq_len=None,
    gk=None,
    gv=None,
    gk_name: str = "gk",
    finite_qkv: bool = True,
    decay_by_solver: bool = False,
) -> FeatureMap:
    """Every check a linear/delta op makes on its arguments; returns the resolved feature map.
    ``chunk_size`` is checked in a chunk form only (the others leave it at ``NO_CHUNKS``).

    Shared by :func:`run_op` and the Triton front end, so both refuse the same
    inputs with the same messages. ``finite_qkv=False``: the solver checks q, k, v for NaN/Inf
    itself (:attr:`~._spec.OpSpec.fused_finite_check`); ``decay_by_solver=True``: the solver checks
    ``gk`` (finite, <= 0) itself (:attr:`~._spec.OpSpec.fused_decay_check`).
    """
    if requires_beta and beta is None:
        raise TypeError(f"{op}: `beta` is required (a [B, T, H] tensor of write strengths)")
    if requires_g and g is None:
        raise TypeError(f"{op}: `g` is required (a [B, T, H] tensor of log decays)")
    if qk_norm not in (None, "l2", "sum"):
        raise ValueError(f"{op}: unknown `qk_norm` {qk_norm!r}; expected None, 'l2' or 'sum'")
    phi = get_feature_map(feature_map, op)
    key_dim = phi.output_dim(q.shape[-1]) if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    value_dim = v.shape[-1] + int(normalize) if isinstance(v, torch.Tensor) and v.dim() == 4 else None
    check_inputs(
        op, q, k, v, beta=beta, g=g, initial_state=initial_state, state_key_dim=key_dim,
        state_value_dim=value_dim, cu_seqlens=cu_seqlens, chunk_size=chunk_size, scale=scale,
        allow_neg_eigval=allow_neg_eigval, cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen, seq_len=seq_len,
        gk=gk, gv=gv, gk_name=gk_name, finite_qkv=finite_qkv, decay_by_solver=decay_by_solver,
    )
    check_autocast(op, q.device, **{"q": q, "k": k, "v": v, "beta": beta, "g": g, gk_name: gk if gk is not None else g,
                                    "gv": gv})
    return phi


def run_op(
    spec: OpSpec,
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: Optional[torch.Tensor] = None,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    feature_map: FeatureMapLike = None,
    qk_norm: Optional[str] = None,
    normalize: bool = False,
    eps: float = 1e-6,
    requires_beta: bool = False,
    requires_g: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
    cp_group=None,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    gk_name: str = "gk",
    extra: Optional[dict] = None,
    return_intermediate_states: bool = False,
    state_block_size: Optional[int] = None,
    state_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
):
    """Check, cast, normalize, unpack; call the solver; undo (module docstring). Returns ``(o, h_T or None)``,
    or ``(o, h_T or None, states)`` when intermediate states are asked for.

    ``spec`` is the op (:class:`~._spec.OpSpec`), ``backend`` the dispatcher's choice (``"torch"``:
    ``spec.torch``, ``"cpu"``: ``spec.cpu``), ``chunk_size`` already resolved for a chunk form
    (:func:`~._chunk.resolve_chunk_size`, in the dispatcher) and None for the others.

    Per-channel decays (the KDA ops): ``gk [B, T, H, K]`` goes to the core in ``g``'s slot
    (``g`` must then be None) and ``gv [B, T, H, V]``, when given, as the keyword ``gv``.
    ``extra``: further per-token tensors ``[B, T, H, ·]`` of a rule (GDN-2's gates ``b``, ``w``),
    checked by the caller; cast, unpacked and moved head-first like ``gv``, and passed to the
    core as keywords of the same names (not with context parallelism).

    Serving (``docs/serving.md``): ``return_intermediate_states`` / ``state_block_size`` return
    the states at chunk or block boundaries (:func:`intermediate_positions`), and
    ``state_indices`` (with ``has_initial_state``) reads the initial states from the pool
    ``initial_state [S, H, K, V]`` and writes the final ones back into it
    (:mod:`fastweights.ops.state_pool`).
    """
    op = spec.name
    every, entry = intermediate_every(op, chunk_size, return_intermediate_states, state_block_size, cp_group,
                                      chunked=spec.form is Form.CHUNK)
    pool = None
    if state_indices is not None or has_initial_state is not None:
        from .state_pool import check_state_indices, gather_states

        if state_indices is None:
            raise ValueError(f"{op}: `has_initial_state` needs `state_indices` (the pool's slot of each sequence)")
        if cp_group is not None:
            raise ValueError(f"{op}: `state_indices` does not run with `cp_group` (context parallelism)")
        n_seq = (len(cu_seqlens) - 1 if cu_seqlens is not None
                 else (q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else -1))
        check_state_indices(op, initial_state, state_indices, n_seq, has_initial_state)
        pool = initial_state
        initial_state = gather_states(pool, state_indices, has_initial_state)
        want_final = output_final_state
        output_final_state = True
    result = _run_op(
        spec, backend, q, k, v, beta=beta, g=g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        feature_map=feature_map, qk_norm=qk_norm, normalize=normalize, eps=eps, requires_beta=requires_beta,
        requires_g=requires_g, allow_neg_eigval=allow_neg_eigval, cu_seqlens_cpu=cu_seqlens_cpu,
        max_seqlen=max_seqlen, cp_group=cp_group, gk=gk, gv=gv, gk_name=gk_name, extra=extra, every=every, entry=entry,
    )
    if pool is not None:
        from .state_pool import scatter_states

        o, h_t, *states = result
        with torch.no_grad():  # the pool is a cache: written in place, outside autograd
            scatter_states(pool, state_indices, h_t.detach())
        result = (o, h_t if want_final else None, *states)
    return result if every is not None else result[:2]


def intermediate_every(op: str, chunk_size: Optional[int], return_intermediate_states: bool,
                       state_block_size: Optional[int], cp_group=None, *, chunked: bool) -> Tuple[Optional[int], bool]:
    """``(every, entry)`` for the intermediate states asked for: none ``(None, False)``; fla's
    per-chunk entry states ``(C, True)``; the states after every ``m`` tokens ``(m, False)``.
    In a chunk form (``chunked``) ``m`` must be a positive multiple of the chunk size (chunks then
    never straddle a block)."""
    if state_block_size is not None and return_intermediate_states:
        raise ValueError(f"{op}: give `return_intermediate_states=True` (the state entering every chunk) or "
                         f"`state_block_size` (the state after every block of tokens), not both")
    if not return_intermediate_states and state_block_size is None:
        return None, False
    if cp_group is not None:
        raise ValueError(f"{op}: intermediate states are not returned with `cp_group` (context parallelism)")
    if return_intermediate_states:
        if not chunked:
            raise ValueError(f"{op}: `return_intermediate_states` (the state entering every chunk) is an option of "
                             f"the chunk form; this form has no chunks: use `state_block_size` (the state after every "
                             f"block of tokens)")
        return int(chunk_size), True
    check_int(op, "state_block_size", state_block_size)
    if chunked and state_block_size % chunk_size:
        raise ValueError(f"{op}: `state_block_size` must be a multiple of the chunk size {chunk_size} (a block "
                         f"boundary must be a chunk boundary), got {state_block_size}")
    return state_block_size, False


def intermediate_positions(lengths: torch.Tensor, every: int, entry: bool) -> torch.Tensor:
    """How many intermediate states each sequence of ``lengths [N]`` gets: ``ceil(T/C)`` entry
    states (after 0, C, 2C, ... tokens) or ``floor(T/m)`` block states (after m, 2m, ... tokens)."""
    return (lengths + every - 1) // every if entry else lengths // every


def _run_op(spec, backend, q, k, v, *, beta, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
            feature_map, qk_norm, normalize, eps, requires_beta, requires_g, allow_neg_eigval, cu_seqlens_cpu,
            max_seqlen, cp_group, gk, gv, gk_name, extra, every, entry):
    """:func:`run_op` after the serving options are resolved; returns ``(o, h_T or None[, states])``."""
    op = spec.name
    core = spec.cpu if backend == "cpu" else spec.torch
    # The finite check of q, k, v left to the solver, which makes it as the compiled kernel
    # gathers the rows (one pass over the inputs fewer): only where the solver sees them as given,
    # and not while compiling (there the check is an assert the compiler keeps and fuses).
    fused_finite = (spec.fused_finite_check and finite_checks_on() and backend == "cpu" and cp_group is None
                    and every is None and not torch.compiler.is_compiling()
                    and feature_map is None
                    and qk_norm is None and not normalize and isinstance(q, torch.Tensor) and q.device.type == "cpu")
    # The same for a per-channel log decay's checks (finite, <= 0), made where the kernel reads the
    # decays: gk reaches the solver as given (only cast to the compute dtype, so only when it has
    # that dtype already: a cast could turn a tiny positive decay into 0 or a huge one into Inf),
    # once per call (not block by block for intermediate states).
    fused_decay = (spec.fused_decay_check and (finite_checks_on() or value_checks_on()) and backend == "cpu"
                   and cp_group is None and every is None and not torch.compiler.is_compiling()
                   and isinstance(gk, torch.Tensor) and isinstance(q, torch.Tensor) and q.device.type == "cpu"
                   and gk.dtype == compute_dtype(q.dtype))

    def check(seq_len=None):
        return check_op_args(
            op, q, k, v, beta=beta, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens,
            chunk_size=chunk_size if spec.form is Form.CHUNK else NO_CHUNKS, scale=scale, feature_map=feature_map, qk_norm=qk_norm, normalize=normalize,
            requires_beta=requires_beta, requires_g=requires_g, allow_neg_eigval=allow_neg_eigval,
            cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen, seq_len=seq_len, gk=gk, gv=gv, gk_name=gk_name,
            finite_qkv=not fused_finite, decay_by_solver=fused_decay,
        )

    segments = None
    if extra and cp_group is not None:
        raise ValueError(f"{op}: `cp_group` (context parallelism) is not supported by this op")
    if cp_group is None:
        phi = check()
    else:  # context parallelism: every rank passes the checks or every rank raises (context_parallel.py)
        from .context_parallel import checked_segments

        phi, segments = checked_segments(
            op, cp_group, check, q, k, v, beta=beta, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size, output_final_state=output_final_state,
            normalize=normalize,
        )
    out_dtype = q.dtype
    dt = compute_dtype(out_dtype)
    if q.shape[1] == 0:  # T = 0: nothing to solve (and the solvers index the last token)
        B, _, H, _ = q.shape
        if initial_state is not None:
            h_t = initial_state.clone()
        else:
            h_t = q.new_zeros(B, H, phi.output_dim(q.shape[-1]), v.shape[-1] + int(normalize), dtype=state_dtype(out_dtype))
        o = v.new_empty(v.shape, dtype=out_dtype)
        if every is not None:
            n_seq = B if cu_seqlens is None else len(cu_seqlens) - 1
            return o, (h_t if output_final_state else None), h_t.new_empty((1 if cu_seqlens is not None else n_seq, 0)
                                                                             + tuple(h_t.shape[1:]))
        return o, (h_t if output_final_state else None)
    scale = resolve_scale(scale, q.shape[-1])
    # The memory check asks the OS (os.sysconf), which torch.compile cannot trace: it runs in eager mode.
    check_memory = not torch.compiler.is_compiling()

    def head_first(t):
        return None if t is None else t.transpose(1, 2)  # [N, T, H, ...] -> [N, H, T, ...]

    def solve(q, k, v, beta, g, h0, cu_seqlens, max_seqlen, cu_seqlens_cpu=None, gv=None, extra=None):
        """The form's solver on packed compute-dtype ``[B, T, H, ·]`` tensors -> ``(o [B, T, H, V], h_T)``
        (and the intermediate states asked for, ``[B, NT, H, K, V]``, packed per sequence with ``cu_seqlens``)."""
        packing = None
        extra = dict(extra or {})
        if cu_seqlens is not None:
            packing = Packing.build(cu_seqlens, q.shape[1], max_seqlen, cu_seqlens_cpu)
            q, k, v, beta, g, gv = (packing.pad(t) for t in (q, k, v, beta, g, gv))
            extra = {name: packing.pad(t) for name, t in extra.items()}
        if every is None:
            o, h_t = solve_padded(q, k, v, beta, g, h0, gv, extra)
        else:
            o, h_t, states = solve_blocks(q, k, v, beta, g, h0, gv, extra)
        if packing is not None:
            o = packing.unpad(o)
        if every is None:
            return o, h_t
        if cu_seqlens is not None:  # sequence i keeps its first count_i states: [1, Σ count_i, H, K, V]
            host = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).long().cpu()
            count = intermediate_positions(host[1:] - host[:-1], every, entry)
            keep = torch.arange(states.shape[1])[None, :] < count[:, None]
            states = states[keep.to(states.device)].unsqueeze(0)
        return o, h_t, states

    def solve_blocks(q, k, v, beta, g, h0, gv, extra):
        """:func:`solve_padded` block by block along T (blocks of ``every`` tokens, chunk-aligned), the
        state carried from block to block; keeps only the states asked for (the entry state of every
        block, or the state after every full block): ``(o, h_T, states [N, NT, H, K, V])``."""
        t_len, outs, kept = q.shape[1], [], []
        h = h0
        for s in range(0, t_len, every):
            e = min(s + every, t_len)
            if entry:
                kept.append(h if h is not None else v.new_zeros(  # q, v: after φ and any normalizer column
                    q.shape[0], q.shape[2], q.shape[-1], v.shape[-1], dtype=state_dtype(out_dtype)))
            qs, ks, vs, bs, gs, gvs = (None if t is None else t[:, s:e] for t in (q, k, v, beta, g, gv))
            o_b, h = solve_padded(qs, ks, vs, bs, gs, h, gvs, {name: t[:, s:e] for name, t in extra.items()})
            outs.append(o_b)
            if not entry and e - s == every:
                kept.append(h)
        n, heads = q.shape[0], q.shape[2]
        states = (torch.stack(kept, dim=1) if kept else
                  h.new_empty((n, 0, heads) + tuple(h.shape[2:])))
        return torch.cat(outs, dim=1), h, states

    def solve_padded(q, k, v, beta, g, h0, gv, extra):
        """The form's solver on padded compute-dtype ``[N, T, H, ·]`` tensors -> ``(o [N, T, H, V], h_T)``."""
        n, t_len, heads = q.shape[0], q.shape[1], q.shape[2]
        chunked = {}
        if spec.form is Form.CHUNK:
            size = effective_chunk_size(chunk_size, t_len)
            chunked = {"chunk_size": size}
            if check_memory:
                check_score_memory(op, n, heads, -(-t_len // size) * size, size, dt, q.device,
                                   f"the [C, C] chunk matrices at T={t_len}, C={size}")
        elif spec.form is Form.PARALLEL and check_memory:
            check_score_memory(op, n, heads, t_len, t_len, dt, q.device, f"the [T, T] score matrices at T={t_len}")
        o, h_t = core(head_first(q), head_first(k), head_first(v), head_first(beta), head_first(g), h0, scale, **chunked,
                      **({} if gv is None else {"gv": head_first(gv)}),
                      **{name: head_first(t) for name, t in extra.items()},
                      **({} if low is None else {"low": low}),
                      **({"check_finite": op} if fused_finite else {}),
                      **({"check_decay": op, "decay_name": gk_name} if fused_decay else {}))
        return o.transpose(1, 2), h_t  # [N, T, H, V]

    # bf16 operands for the products (fastweights.ops.precision): only for cores that take
    # them, in inference, outside context parallelism; q, k, v then stay bf16 unless a
    # feature map or q/k norm must run in fp32
    low = None
    if segments is None and spec.low_products and not backward_can_follow(q, k, v, beta, g, gk, gv, initial_state):
        low = product_dtype(out_dtype)
    # a chunk form on the CPU takes the mode as leave: not where bf16 products do not pay (no bf16
    # unit: they would run slower than fp32 and less accurately; fastweights.ops.cpu.bf16_unit)
    if low is not None and spec.form is Form.CHUNK and q.device.type == "cpu" and not cpu_kernels.bf16_unit():
        low = None
    keep_low = low is not None and isinstance(phi, Identity) and qk_norm is None
    # plain bf16 q, k, v in inference, for a solver that widens them itself (the compiled CPU
    # kernel, in its gather): no separate pass casting them to fp32 first
    raw_bf16 = (low is None and segments is None and not normalize and spec.reads_bf16_inputs
                and q.device.type == "cpu" and isinstance(phi, Identity) and qk_norm is None
                and q.dtype == k.dtype == v.dtype == torch.bfloat16
                and not backward_can_follow(q, k, v, beta, g, gk, gv, initial_state))
    keep_low = keep_low or raw_bf16

    def cast(t):
        return t if keep_low else t.to(dt)

    with autocast_off(q.device):  # fp32 compute and state, whatever autocast would do (module docstring)
        # the solver has no double backward: the compiled q/k norm may serve it (the compiled CPU backend only)
        single = spec.single_backward and backend == "cpu"
        q = normalize_qk(phi(cast(q)), qk_norm, op, compiled=single)
        k = normalize_qk(phi(cast(k)), qk_norm, op, compiled=single)
        v = v if (low is not None or raw_bf16) and not normalize else v.to(dt)
        if normalize:
            # The normalizer z_t = α_t z_{t-1} + φ(k_t) is the state written with value 1:
            # carry it as one extra value column, so h = [S | z] is a single [K, V+1] state.
            v = normalizer_column(v)
        beta = None if beta is None else beta.to(dt)
        g = g if gk is None else gk  # a per-channel key decay takes the per-head one's place
        g = None if g is None else g.to(dt)
        gv = None if gv is None else gv.to(dt)
        extra = {name: t.to(dt) for name, t in (extra or {}).items()}
        states = ()
        if segments is None:
            o, h_t, *states = solve(q, k, v, beta, g, initial_state, cu_seqlens, max_seqlen, cu_seqlens_cpu, gv=gv,
                                    extra=extra)
        else:
            from .context_parallel import run_context_parallel

            o, h_t = run_context_parallel(solve, segments, cp_group, q, k, v, beta, g, initial_state, output_final_state,
                                          scale, sum_rule=spec.rule is Rule.SUM)
        if normalize:
            o = divide_by_normalizer(o, eps)
        return (o.to(out_dtype), (h_t if output_final_state else None), *states)
