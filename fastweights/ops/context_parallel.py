"""Context parallelism: one long sequence split over the ranks of a process group.

Each rank of ``cp_group`` holds one contiguous slice of T, in rank order: rank r
holds tokens ``[r·L, (r+1)·L)`` of every row (L, the local length, is the same on
every rank). With ``cu_seqlens`` the offsets are the *global* ones, the same tensor
on every rank, and a packed sequence may cross any number of rank boundaries.
``docs/context_parallel.md`` derives everything below; in short:

Forward. For every rule, a slice maps the state entering it to the state leaving
it by an affine map ``h_out = A h_in + b`` (per sequence and head). For the delta
rules A is the K×K product of the slice's transitions ``α_t (I − β_t k_t k_tᵀ)``
and b the state the slice writes from zero; for linear attention A is the scalar
``exp(Σ g)`` (1 without decay) and b the decayed sum ``Σ_t e^{b_L − b_t} φ(k_t) v_tᵀ``
(the normalizer z rides along as b's last column). The outputs are affine in
h_in too: ``O = O⁰ + R h_in`` with R the slice's "read" map ([L, K] per head).

1. every rank runs the chunk op on its slice from h_in = 0; for the delta rules
   with K extra value columns that start from the identity, so one pass yields
   ``[O⁰ | R]`` and ``[b | A]`` (:func:`run_context_parallel`); for linear attention
   R = scale·e^{b_t}·φ(q_t) and A = e^{Σg} are written down directly;
2. one all-gather of every rank's ``(A, b)`` (the summary of its last segment);
3. a prefix combine ``E_s = A_s E_{s−1} + b_s`` gives the state entering the slice;
4. ``O = O⁰ + R E``, and the state leaving is ``A E + b``.

Backward (the adjoint, :class:`_Exchange`): with G_r = Rᵀ dO (the cotangent of the
state entering rank r), one all-gather of the G's, and the reverse combine
``μ_s = G_{s+1} + A_{s+1}ᵀ μ_{s+1}`` gives μ_r, the cotangent of the state leaving
rank r; then ``db = μ_r``, ``dA = μ_r E_{r−1}ᵀ`` flow into the slice's own chunk
backward. Every rank's inputs get their full gradient; no rank redoes another's work.

Communication per op call and rank: the summaries, ``rows·H·K·(K + V)`` numbers for
the delta rules (``rows·H·(K·V + 1)`` for decayed linear attention, ``rows·H·K·V``
without decay; rows = B, or 1 with ``cu_seqlens``), and the same without A back in
the backward -- independent of T. :func:`summary_bytes` is the formula,
:func:`count_communication` counts what is actually sent.

Conventions:

- ``initial_state[i]`` is read by the rank holding sequence i's first token; its
  gradient lands there (zeros on the other ranks: the gradients of a replicated
  input are per-rank shares whose sum over ``cp_group`` is the total, as for
  parameters under data parallelism).
- ``output_final_state=True`` returns the final states on *every* rank (one extra
  all-reduce of ``[N, H, K, V]``); each rank's cotangent of its copy counts, summed.
- Every rank must call the op, and every rank must backpropagate through it
  (collectives run inside the backward), like any collective under autograd.
- Before any of that, one small all-gather of the arguments' fingerprints
  (:func:`agree`) makes every rank refuse bad input with the same error, instead
  of one rank raising while the others wait in a collective.

The same module serves the model side: :func:`exchange_halo` (the short
convolution's W − 1 inputs from the previous rank), :func:`gather_sequence` (a
differentiable all-gather along T, for softmax attention's keys and values),
:func:`global_positions` and :func:`local_slice`.
"""

from __future__ import annotations

import bisect
import contextlib
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

try:
    import torch.distributed as dist

    _HAVE_DIST = dist.is_available()
except ImportError:  # a torch build without distributed support
    dist = None
    _HAVE_DIST = False

__all__ = [
    "CommunicationLog", "count_communication", "summary_bytes", "kv_gather_bytes", "check_cp_group", "agree",
    "Segments", "local_segments", "local_slice", "global_positions", "exchange_halo", "gather_sequence",
    "softmax_attn_context_parallel", "run_context_parallel", "checked_segments", "agree_on_slice",
    "conv_states_from_halo", "gdn2_context_parallel", "gated_delta_product_context_parallel",
]


# --------------------------------------------------------------------------------------
# Communication, counted
# --------------------------------------------------------------------------------------


@dataclass
class CommunicationLog:
    """What this rank handed to collectives inside a :func:`count_communication` block.

    ``records`` holds one ``(kind, what, payload_bytes, world)`` per collective:
    ``payload_bytes`` is the size of this rank's own contribution (an all-gather's
    input, an all-reduce's tensor). :attr:`sent_bytes` sums them.
    """

    records: List[Tuple[str, str, int, int]] = field(default_factory=list)

    @property
    def sent_bytes(self) -> int:
        return sum(r[2] for r in self.records)

    def bytes_of(self, what: str) -> int:
        """Payload bytes of the collectives labelled ``what`` (e.g. ``"summaries"``)."""
        return sum(r[2] for r in self.records if r[1] == what)


_LOGS: List[CommunicationLog] = []


@contextlib.contextmanager
def count_communication() -> Iterator[CommunicationLog]:
    """Count the bytes this rank contributes to the collectives run inside the block.

    Labels: ``"fingerprint"`` (the argument check), ``"summaries"`` (forward),
    ``"summary_grads"`` (backward), ``"final_states"`` / ``"final_state_grads"``,
    ``"halo"`` / ``"halo_grads"`` (short convolution), ``"kv"`` / ``"kv_grads"``
    (softmax attention)::

        with count_communication() as log:
            o, _ = chunk_delta_rule(q, k, v, beta, cp_group=group)
        log.bytes_of("summaries") == summary_bytes("delta_rule", 1, H, K, V, q.dtype)
    """
    log = CommunicationLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(kind: str, what: str, tensor: torch.Tensor, world: int) -> None:
    for log in _LOGS:
        log.records.append((kind, what, tensor.numel() * tensor.element_size(), world))


def _all_gather(x: torch.Tensor, group, what: str) -> torch.Tensor:
    """``x [...]`` from every rank -> ``[R, ...]`` (rank order)."""
    x = x.contiguous()
    world = dist.get_world_size(group)
    _record("all_gather", what, x, world)
    out = x.new_empty(world * x.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.reshape(-1), group=group)
    return out.view((world,) + tuple(x.shape))


def _all_reduce(x: torch.Tensor, group, what: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks (a new tensor)."""
    x = x.clone(memory_format=torch.contiguous_format)
    _record("all_reduce", what, x, dist.get_world_size(group))
    dist.all_reduce(x, group=group)
    return x


def _reduce_scatter(x: torch.Tensor, group, what: str) -> torch.Tensor:
    """``x [R·n, ...]`` summed over the ranks; this rank's n rows."""
    x = x.contiguous()
    world = dist.get_world_size(group)
    _record("reduce_scatter", what, x, world)
    out = x.new_empty(x.numel() // world)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x.reshape(-1), group=group)
    return out.view((x.shape[0] // world,) + tuple(x.shape[1:]))


def summary_bytes(rule: str, rows: int, heads: int, key_dim: int, value_dim: int,
                  dtype: torch.dtype = torch.float32, gated: bool = True) -> int:
    """Bytes one rank contributes to the forward all-gather of one op call.

    ``rule``: ``"delta_rule"``/``"gated_delta_rule"`` (A is K×K: ``rows·H·K·(K + V)``
    numbers) or ``"linear_attn"`` (A is a scalar per head, sent only with a decay:
    ``rows·H·(K·V + gated)``). ``rows`` is B, or 1 with ``cu_seqlens``; ``value_dim``
    counts the normalizer column (V + 1) when linear attention normalizes; ``dtype`` is
    the state's (fp32, fp64 for fp64 inputs). The backward sends ``rows·H·K·V`` numbers.
    """
    item = torch.finfo(dtype).bits // 8
    if rule in ("delta_rule", "gated_delta_rule"):
        per_head = key_dim * (key_dim + value_dim)
    elif rule == "linear_attn":
        per_head = key_dim * value_dim + int(gated)
    else:
        raise ValueError(f"summary_bytes: unknown `rule` {rule!r}; expected 'delta_rule', 'gated_delta_rule' or 'linear_attn'")
    return rows * heads * per_head * item


def kv_gather_bytes(batch: int, local_len: int, heads: int, key_dim: int, value_dim: int,
                    dtype: torch.dtype = torch.float32) -> int:
    """Bytes one rank contributes when keys and values are all-gathered instead: its
    ``B·L·H·(K + V)`` slice (every rank then receives (R − 1) times that)."""
    return batch * local_len * heads * (key_dim + value_dim) * (torch.finfo(dtype).bits // 8)


# --------------------------------------------------------------------------------------
# Checks that every rank passes or fails together
# --------------------------------------------------------------------------------------


def check_cp_group(owner: str, cp_group) -> Tuple[int, int]:
    """``(rank, world)`` of ``cp_group``; a TypeError naming it when it is not a ProcessGroup."""
    if not _HAVE_DIST or not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(
            f"{owner}: `cp_group` must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD, "
            f"or one made by torch.distributed.new_group) or None, got {type(cp_group).__name__}"
        )
    return dist.get_rank(cp_group), dist.get_world_size(cp_group)


def _comm_device(group, like: Optional[torch.Tensor]) -> torch.device:
    """Where a collective's tensors must live: CUDA for nccl, the CPU for gloo."""
    if dist.get_backend(group) == "nccl":
        return like.device if isinstance(like, torch.Tensor) and like.is_cuda else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: Argument names a refusal may name, so that the other ranks can name it too.
_ARGUMENTS = (
    "q", "k", "v", "beta", "g", "scale", "initial_state", "output_final_state", "cu_seqlens", "cu_seqlens_cpu",
    "max_seqlen", "chunk_size", "feature_map", "qk_norm", "normalize", "backend", "x", "state", "attention_mask",
    "input_ids", "cache", "return_cache", "cp_group",
)


def _named_argument(error: BaseException) -> int:
    match = re.search(r"`([A-Za-z_]+)`", str(error))
    name = match.group(1) if match else ""
    return _ARGUMENTS.index(name) if name in _ARGUMENTS else -1


@dataclass
class Fingerprint:
    """One number every rank must agree on: ``argument`` is named in the error, ``what`` describes it."""

    argument: str
    what: str
    value: int
    hint: str = ""


def cu_fingerprint(cu_host: Optional[Sequence[int]]) -> int:
    """A hash of the offsets (0 for None) that differs for different offsets with near certainty."""
    if cu_host is None:
        return 0
    h, prime = 1469598103934665603, (1 << 61) - 1
    for i, c in enumerate(cu_host):
        h = (h * 1099511628211 + (int(c) + 1) * (2 * i + 3)) % prime
    return h


def agree(owner: str, group, first: Sequence[Fingerprint], error: Optional[BaseException],
          then: Sequence[Fingerprint] = (), like: Optional[torch.Tensor] = None) -> None:
    """One small all-gather, then every rank raises the same error or none does.

    ``first`` are checked before the ranks' own input errors (a difference there can
    cause those: a wrong local length makes the offsets look wrong), ``then`` after.
    ``error`` is this rank's own refusal of its inputs, if any: that rank re-raises it,
    the others raise a ValueError naming the argument and the rank. A value of -1 in
    ``first`` means "unknown on this rank" (its input was malformed) and skips that check.
    """
    fields = list(first) + list(then)
    row = [1 if error is not None else 0, -1 if error is None else _named_argument(error)] + [f.value for f in fields]
    local = torch.tensor(row, dtype=torch.int64, device=_comm_device(group, like))
    table = _all_gather(local, group, "fingerprint").cpu().tolist()
    world = len(table)

    def compare(i: int, f: Fingerprint, skip_unknown: bool) -> None:
        values = [table[r][2 + i] for r in range(world)]
        if skip_unknown and -1 in values:
            return
        if len(set(values)) > 1:
            raise ValueError(
                f"{owner}: `{f.argument}` differs across the {world} ranks of `cp_group`: {f.what} is "
                f"{values} on ranks 0..{world - 1}; {f.hint or 'pass the same on every rank'}"
            )

    for i, f in enumerate(first):
        compare(i, f, skip_unknown=True)
    failed = [r for r in range(world) if table[r][0]]
    if failed:
        if error is not None:
            raise error
        r = failed[0]
        index = table[r][1]
        name = f"`{_ARGUMENTS[index]}`" if index >= 0 else "its arguments"
        raise ValueError(
            f"{owner}: rank {r} of `cp_group` refused {name} (its error says why); every rank stops "
            f"so that none waits for the others"
        )
    for i, f in enumerate(then):
        compare(len(first) + i, f, skip_unknown=False)


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def dtype_code(t) -> int:
    return _DTYPES.index(t.dtype) if isinstance(t, torch.Tensor) and t.dtype in _DTYPES else -1


def _shape_of(t, index: int) -> int:
    return int(t.shape[index]) if isinstance(t, torch.Tensor) and t.dim() > abs(index) - (index < 0) else -1


def local_length_fingerprint(name: str, t) -> Fingerprint:
    """The local length (dimension 1 of ``t``) that every rank must share."""
    return Fingerprint(
        name, "the local length T (dimension 1)", _shape_of(t, 1),
        "context parallelism splits T into one contiguous slice of the same length per rank: "
        "pad the global length to a multiple of the group size and split it evenly",
    )


def offsets_fingerprint(cu_host: Optional[Sequence[int]]) -> Fingerprint:
    return Fingerprint(
        "cu_seqlens", "a hash of the offsets (0: None)", cu_fingerprint(cu_host),
        "pass the same global offsets on every rank (they index the whole sequence, not the rank's slice)",
    )


def host_offsets(cu_seqlens, cu_seqlens_cpu=None) -> Optional[List[int]]:
    """The offsets as a list of ints (from the CPU copy when given), or None; [] for malformed ones."""
    src = cu_seqlens_cpu if isinstance(cu_seqlens_cpu, torch.Tensor) else cu_seqlens
    if src is None:
        return None
    if not isinstance(src, torch.Tensor) or src.dim() != 1 or src.is_floating_point():
        return []
    return [int(c) for c in src.tolist()]


# --------------------------------------------------------------------------------------
# Which tokens of which sequences a rank holds
# --------------------------------------------------------------------------------------


@dataclass
class Segments:
    """How rank ``rank``'s slice ``[start, start + length)`` cuts the packed sequences.

    ``ids`` are the global indices of the sequences the slice touches, ``offsets`` the
    local offsets of their pieces (``[len(ids) + 1]``, from 0 to ``length``).
    ``continues_in``: the first piece belongs to a sequence that started on an earlier
    rank; ``continues_out``: the last piece's sequence goes on after the slice.
    ``carries[s]`` says, for every rank s, whether the last piece of rank s continues
    a sequence from rank s − 1 (then rank s's summary composes with the one before).
    ``ends[i]`` is True where sequence ``ids[i]`` ends inside this slice.
    """

    rank: int
    world: int
    start: int
    length: int
    ids: List[int]
    offsets: List[int]
    continues_in: bool
    continues_out: bool
    carries: List[bool]
    ends: List[bool]
    sequence_starts: List[int]  # global start of each sequence in ``ids``
    packed: bool  # offsets were given (else B whole rows)
    n_sequences: int  # N: B, or the number of packed sequences


def local_segments(cu_host: Optional[Sequence[int]], batch: int, length: int, rank: int, world: int) -> Segments:
    """The :class:`Segments` of rank ``rank`` for global offsets ``cu_host`` (None: B whole rows)."""
    start, stop = rank * length, (rank + 1) * length
    if cu_host is None:  # every row is one sequence crossing every boundary
        return Segments(rank, world, start, length, list(range(batch)), [0, length], rank > 0, rank < world - 1,
                        [s > 0 for s in range(world)], [rank == world - 1] * batch, [0] * batch, False, batch)
    cu = list(cu_host)

    def sequence_of(token: int) -> int:  # the sequence holding global token ``token``
        return min(bisect.bisect_right(cu, token), len(cu) - 1) - 1

    if length == 0:
        return Segments(rank, world, start, 0, [], [0], False, False, [False] * world, [], [], True, len(cu) - 1)
    first, last = sequence_of(start), sequence_of(stop - 1)
    ids = list(range(first, last + 1))
    offsets = [0] + [cu[i + 1] - start for i in ids[:-1]] + [length]
    carries = [cu[sequence_of((s + 1) * length - 1)] < s * length for s in range(world)]
    ends = [cu[i + 1] <= stop for i in ids]
    return Segments(rank, world, start, length, ids, offsets, cu[first] < start, cu[last + 1] > stop, carries, ends,
                    [cu[i] for i in ids], True, len(cu) - 1)


def local_slice(x: torch.Tensor, cp_group, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (``x.shape[dim]`` must divide evenly)."""
    rank, world = check_cp_group("local_slice", cp_group)
    total = x.shape[dim]
    if total % world:
        raise ValueError(f"local_slice: `x` has {total} entries along dim {dim}, not a multiple of the {world} ranks of `cp_group`")
    n = total // world
    return x.narrow(dim, rank * n, n)


def global_positions(batch: int, length: int, cu_seqlens: Optional[torch.Tensor], cp_group,
                     device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sequence index, position within its sequence)`` ``[B, L]`` of this rank's tokens,
    counted in the whole sequence (what :func:`~fastweights.layers.common.sequence_positions`
    gives for the global tokens of the slice)."""
    rank, _ = check_cp_group("global_positions", cp_group)
    tokens = rank * length + torch.arange(length, device=device)
    if cu_seqlens is None:
        return (torch.arange(batch, device=device)[:, None].expand(batch, length), tokens[None].expand(batch, length))
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    seq = torch.searchsorted(cu[1:], tokens, right=True)
    return seq[None], (tokens - cu[seq])[None]


def checked_segments(
    op: str, cp_group, check: Callable[[Optional[int]], object], q, k, v, *, beta, g, initial_state, cu_seqlens,
    cu_seqlens_cpu, chunk_size, output_final_state: bool, normalize: bool,
):
    """The checks of a context-parallel op call, passed or failed by every rank together.

    ``check(seq_len)`` is the op's own argument check with ``cu_seqlens`` ending at the
    global length ``seq_len`` (R·L); its error, if any, is shared through :func:`agree`.
    Any local length L works: a slice (or a piece of it) whose length is not a multiple of
    ``chunk_size`` ends in a partial chunk, which the chunk form pads with no-op tokens (zero
    keys, β = 0, g = 0: the state passes through unchanged), as it does without ``cp_group``.
    Returns ``(check's result, Segments)``.
    """
    rank, world = check_cp_group(op, cp_group)
    length = _shape_of(q, 1)
    cu_host, result, error = None, None, None
    try:
        cu_host = host_offsets(cu_seqlens, cu_seqlens_cpu)
        result = check(None if length < 0 else world * length)
    except (TypeError, ValueError) as e:
        error = e
    size = chunk_size if isinstance(chunk_size, int) and not isinstance(chunk_size, bool) else -1
    then = [
        Fingerprint("chunk_size", "chunk_size", size),
        Fingerprint("q", "the batch size B", _shape_of(q, 0)),
        Fingerprint("q", "the number of heads H", _shape_of(q, 2)),
        Fingerprint("q", "the key size K", _shape_of(q, 3)),
        Fingerprint("v", "the value size V", _shape_of(v, 3)),
        Fingerprint("q", "the dtype (0 float64, 1 float32, 2 bfloat16, 3 float16)", dtype_code(q)),
        Fingerprint("beta", "whether it is given (1) or None (0)", int(beta is not None)),
        Fingerprint("g", "whether it is given (1) or None (0)", int(g is not None)),
        Fingerprint("initial_state", "whether it is given (1) or None (0)", int(initial_state is not None)),
        Fingerprint("output_final_state", "its value", int(bool(output_final_state))),
        Fingerprint("normalize", "its value", int(bool(normalize))),
    ]
    agree(op, cp_group, [local_length_fingerprint("q", q), offsets_fingerprint(cu_host)], error, then, like=q)
    return result, local_segments(cu_host, q.shape[0], length, rank, world)


# --------------------------------------------------------------------------------------
# The ops' exchange
# --------------------------------------------------------------------------------------


def _apply(a: Optional[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """``A h`` for a K×K transition ``[n, H, K, K]``, a scalar ``[n, H]`` or None (the identity)."""
    if a is None:
        return h
    if a.dim() == 2:
        return a[..., None, None] * h
    return a @ h


def _apply_t(a: Optional[torch.Tensor], mu: torch.Tensor) -> torch.Tensor:
    """``Aᵀ μ``, the adjoint of :func:`_apply`."""
    if a is None or a.dim() == 2:
        return _apply(a, mu)
    return a.transpose(-1, -2) @ mu


def _transition_grad(a: Optional[torch.Tensor], mu: torch.Tensor, h: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient of ``⟨μ, A h⟩`` with respect to A."""
    if a is None:
        return None
    if a.dim() == 2:
        return (mu * h).sum((-1, -2))
    return mu @ h.transpose(-1, -2)


@dataclass
class _ExchangePlan:
    group: object
    segments: Segments
    head: int  # tokens of the head piece (continuing from the previous rank); 0: none
    head_final: Optional[torch.Tensor]  # global ids of the head rows whose sequence ends here (finals only)
    state_shape: Tuple[int, ...]  # [rows, H, K, V] of a summary's b


class _Exchange(torch.autograd.Function):
    """The only cross-rank step of a context-parallel op, forward and backward.

    Inputs: ``o [B, L, H, V]`` (the slice's outputs from h_in = 0), ``read [B, L0, H, K]``
    (R of the head piece, or None), the head's summary ``(head_a, head_b)``, the
    published summary ``(pub_a, pub_b)`` of the slice's last piece, and ``finals``
    (``[N, H, K, V]`` with the final states of the sequences ending in the slice's
    other pieces, zeros elsewhere; None without ``output_final_state``).
    Outputs: ``O⁰ + R E`` and the final states of every sequence (on every rank).
    """

    @staticmethod
    def forward(ctx, o, read, head_a, head_b, pub_a, pub_b, finals, plan: _ExchangePlan):
        seg, group = plan.segments, plan.group
        parts = [pub_b.flatten(2)] + ([] if pub_a is None else [pub_a.flatten(2) if pub_a.dim() > 2 else pub_a[..., None]])
        payload = torch.cat(parts, dim=-1)  # [rows, H, K·V (+ K·K or 1)]
        gathered = _all_gather(payload, group, "summaries")
        kv = pub_b[0, 0].numel()
        b_all = gathered[..., :kv].reshape((seg.world,) + plan.state_shape)
        a_all = None
        if pub_a is not None:
            a_all = gathered[..., kv:]
            a_all = a_all[..., 0] if pub_a.dim() == 2 else a_all.reshape((seg.world,) + tuple(pub_a.shape))
        entering = pub_b.new_zeros(plan.state_shape)  # E_{r−1}, the state entering this slice
        for s in range(seg.rank):
            carried = _apply(None if a_all is None else a_all[s], entering) if seg.carries[s] else 0
            entering = carried + b_all[s]
        out = o.clone()
        if read is not None:
            out[:, : plan.head] += torch.einsum("bthk,bhkv->bthv", read, entering)
        final = None
        if finals is not None:
            final = finals.clone()
            if plan.head_final is not None:
                final.index_add_(0, plan.head_final, _apply(head_a, entering) + head_b)
            final = _all_reduce(final, group, "final_states")
        ctx.plan = plan
        ctx.save_for_backward(read, head_a, entering, a_all)
        ctx.has = (pub_a is not None, finals is not None)
        ctx.finals_shape = None if finals is None else finals.shape
        return out, (final if final is not None else o.new_empty(0))

    @staticmethod
    def backward(ctx, d_out, d_final):
        plan = ctx.plan
        seg, group = plan.segments, plan.group
        read, head_a, entering, a_all = ctx.saved_tensors
        has_pub_a, has_finals = ctx.has
        grad_entering = torch.zeros_like(entering)  # G_r, the cotangent of E_{r−1} on this rank
        d_read = d_head_a = d_head_b = d_finals = None
        if has_finals:  # every rank's copy of the final states: their cotangents add up
            d_final = entering.new_zeros(ctx.finals_shape) if d_final is None else d_final
            d_finals = _all_reduce(d_final, group, "final_state_grads")
            if plan.head_final is not None:
                d_head_final = d_finals[plan.head_final]
                d_head_b = d_head_final
                d_head_a = _transition_grad(head_a, d_head_final, entering)
                grad_entering = grad_entering + _apply_t(head_a, d_head_final)
        if read is not None and d_out is not None:
            d_head = d_out[:, : plan.head]
            grad_entering = grad_entering + torch.einsum("bthk,bthv->bhkv", read, d_head)
            d_read = torch.einsum("bthv,bhkv->bthk", d_head, entering)
        grads = _all_gather(grad_entering, group, "summary_grads")
        mu = torch.zeros_like(entering)  # μ_{R−1} = 0: the last rank's summary reaches no one
        for s in range(seg.world - 2, seg.rank - 1, -1):
            carried = _apply_t(None if a_all is None else a_all[s + 1], mu) if seg.carries[s + 1] else 0
            mu = grads[s + 1] + carried
        d_pub_b = mu
        d_pub_a = None
        if has_pub_a:
            d_pub_a = _transition_grad(a_all[seg.rank], mu, entering)
            if not seg.carries[seg.rank]:
                d_pub_a = torch.zeros_like(d_pub_a)
        return d_out, d_read, d_head_a, d_head_b, d_pub_a, d_pub_b, d_finals, None


Solve = Callable[..., Tuple[torch.Tensor, torch.Tensor]]


def run_context_parallel(
    solve: Solve, segments: Segments, group, q, k, v, beta, g, initial_state, output_final_state: bool,
    scale: float, sum_rule: bool,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A chunk op on this rank's slice, given the slice's :class:`Segments` (after the checks).

    ``solve(q, k, v, beta, g, h0, cu_seqlens, max_seqlen) -> (o, h_T)`` is the op's own
    single-process path on packed ``[B, T, H, ·]`` compute-dtype tensors (after the
    feature map; ``v`` with the normalizer column when linear attention normalizes).
    ``sum_rule``: linear attention (a scalar transition) rather than a delta rule.
    Returns ``(o [B, L, H, V], final states [N, H, K, V] on every rank, or None)``.
    """
    seg = segments
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    rows = 1 if seg.packed else batch  # rows of a summary: the one piece at the slice's end, or every row
    head = seg.offsets[1] if seg.continues_in else 0
    outputs = []
    transition = "matrix" if not sum_rule else ("scalar" if g is not None else "none")
    head_a = head_b = read = None
    if head:
        qh, kh, vh, bh, gh = (None if t is None else t[:, :head] for t in (q, k, v, beta, g))
        if sum_rule:  # R = scale·e^{b_t}·φ(q_t), A = e^{b_L}: no extra columns needed
            o_h, head_b = solve(qh, kh, vh, bh, gh, None, None, None)
            cum = None if gh is None else gh.cumsum(1)  # [rows, L0, H]
            read = scale * qh if cum is None else scale * qh * torch.exp(cum)[..., None]
            head_a = None if cum is None else torch.exp(cum[:, -1])  # [rows, H]
        else:  # K extra value columns from the identity: the same pass gives [O⁰ | R] and [b | A]
            eye = torch.eye(key_dim, dtype=v.dtype, device=v.device).expand(rows, heads, key_dim, key_dim)
            h0 = torch.cat([v.new_zeros(rows, heads, key_dim, value_dim), eye], dim=-1)
            v_aug = torch.cat([vh, vh.new_zeros(vh.shape[:-1] + (key_dim,))], dim=-1)
            o_aug, final_aug = solve(qh, kh, v_aug, bh, gh, h0, None, None)
            o_h, read = o_aug[..., :value_dim], o_aug[..., value_dim:]
            head_b, head_a = final_aug[..., :value_dim], final_aug[..., value_dim:]
        outputs.append(o_h)
    rest_final = None
    if head < length:
        rest_ids = seg.ids[1:] if head else seg.ids
        if seg.packed:
            cu = torch.tensor([o - head for o in seg.offsets[(1 if head else 0):]], dtype=torch.long, device=q.device)
            h0 = None if initial_state is None else initial_state[torch.tensor(rest_ids, device=q.device)]
            max_len = max(b - a for a, b in zip(seg.offsets[:-1], seg.offsets[1:]))
            o_r, rest_final = solve(*(None if t is None else t[:, head:] for t in (q, k, v, beta, g)), h0, cu, max_len)
        else:
            o_r, rest_final = solve(q, k, v, beta, g, initial_state, None, None)
        outputs.append(o_r)
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    state_shape = (rows, heads, key_dim, value_dim)
    if head and head == length:  # one piece, continuing from the previous rank: publish (A, b)
        pub_a, pub_b = head_a, head_b
    else:  # the last piece starts here: its state leaving is known, so A = 0
        pub_b = rest_final[-rows:]
        pub_a = None
        if transition == "matrix":
            pub_a = pub_b.new_zeros(rows, heads, key_dim, key_dim)
        elif transition == "scalar":
            pub_a = pub_b.new_zeros(rows, heads)
    finals = head_final = None
    if output_final_state:
        n_seq = seg.n_sequences
        finals = o.new_zeros(n_seq, heads, key_dim, value_dim)
        if rest_final is not None:
            rest_ids = seg.ids[1:] if head else seg.ids
            rest_ends = seg.ends[1:] if head else seg.ends
            keep = [i for i, e in enumerate(rest_ends) if e]
            if keep:
                idx = torch.tensor([rest_ids[i] for i in keep], device=q.device)
                finals = finals.index_copy(0, idx, rest_final[torch.tensor(keep, device=q.device)])
        if head and seg.ends[0]:
            head_final = torch.tensor(seg.ids[:rows], device=q.device)
    plan = _ExchangePlan(group, seg, head, head_final, state_shape)
    o, final = _Exchange.apply(o, read, head_a, head_b, pub_a, pub_b, finals, plan)
    return o, (final if output_final_state else None)


# --------------------------------------------------------------------------------------
# The model side: the short convolution's halo, softmax attention's keys and values
# --------------------------------------------------------------------------------------


def agree_on_slice(owner: str, cp_group, name: str, x, cu_seqlens=None, check: Optional[Callable[[], None]] = None) -> Tuple[int, int]:
    """A layer's or model's checks under ``cp_group``, passed or failed by every rank together.

    ``x`` (argument ``name``) is the rank's slice ``[B, L, ...]``: every rank must hold the
    same B and L and the same global ``cu_seqlens``, which must end at R·L; ``check()`` runs
    the caller's own checks (its error is shared as in :func:`agree`). Returns ``(rank, world)``.
    """
    rank, world = check_cp_group(owner, cp_group)
    from ._checks import check_cu_seqlens

    cu_host, error = None, None
    try:
        cu_host = host_offsets(cu_seqlens)
        if check is not None:
            check()
        if cu_seqlens is not None:
            check_cu_seqlens(owner, cu_seqlens, x.shape[0], world * x.shape[1], x.device)
    except (TypeError, ValueError) as e:
        error = e
    then = [Fingerprint(name, "the batch size B", _shape_of(x, 0)), Fingerprint(name, "the last size", _shape_of(x, -1))]
    agree(owner, cp_group, [local_length_fingerprint(name, x), offsets_fingerprint(cu_host)], error, then, like=x)
    return rank, world


class _Halo(torch.autograd.Function):
    """``tail [B, m, C]`` of every rank (its last m = min(L, width) inputs) -> ``[B, width, C]``,
    the ``width`` inputs before this rank's slice, zeros before the first rank's. With
    L >= width that is the previous rank's tail; a shorter slice's window reaches back over
    several ranks, whose tails are then their whole slices, end to end. Each position's
    gradient goes back to the rank that holds it."""

    @staticmethod
    def forward(ctx, tail, group, width):
        rank = dist.get_rank(group)
        ctx.group, ctx.rank, ctx.world, ctx.width, ctx.m = group, rank, dist.get_world_size(group), width, tail.shape[1]
        gathered = _all_gather(tail, group, "halo")  # [R, B, m, C]
        before = gathered[:rank].permute(1, 0, 2, 3).flatten(1, 2)  # [B, rank·m, C]: every earlier rank's tail, in order
        if before.shape[1] < width:  # the window starts before the first token
            before = F.pad(before, (0, 0, width - before.shape[1], 0))
        return before[:, before.shape[1] - width :].clone()

    @staticmethod
    def backward(ctx, grad):
        gathered = _all_gather(grad.contiguous(), ctx.group, "halo_grads")  # [R, B, width, C]
        m, width = ctx.m, ctx.width
        d_tail = grad.new_zeros(grad.shape[0], m, grad.shape[2])
        for r in range(ctx.rank + 1, ctx.world):  # the later ranks whose window may cover this rank's tail
            start = width - (r - ctx.rank) * m  # the row of rank r's window that holds this tail's first row
            if start + m <= 0:  # out of reach of rank r's window, and of every later rank's
                break
            lo = max(start, 0)
            d_tail[:, lo - start :] += gathered[r][:, lo : start + m]
        return d_tail, None, None


def exchange_halo(tail: torch.Tensor, cp_group, width: Optional[int] = None) -> torch.Tensor:
    """The ``width`` inputs before this rank's slice (``[B, width, C]``; a short convolution's
    W − 1), zeros before the first rank's. ``tail`` is the rank's last ``min(L, width)`` inputs
    (``[B, m, C]``, the same m on every rank); ``width`` defaults to m. Differentiable: each
    input's gradient returns to the rank that holds it."""
    width = tail.shape[1] if width is None else int(width)
    return _Halo.apply(tail.contiguous(), cp_group, width)


def conv_states_from_halo(halo: torch.Tensor, segments: Segments) -> torch.Tensor:
    """The incoming convolution state ``[n, W − 1, C]`` of each local piece of packed sequences.

    The first piece continues the previous rank's sequence: its state is the halo, with
    the rows before that sequence's start zeroed (they belong to earlier sequences);
    every other piece starts a sequence here, from zeros.
    """
    width = halo.shape[1]
    positions = segments.start - width + torch.arange(width, device=halo.device)
    first = segments.sequence_starts[0] if segments.ids else segments.start
    own = (positions >= first).to(halo.dtype)[:, None]  # all zero unless the first piece continues in
    first_state = halo[0] * own
    rest = halo.new_zeros(max(len(segments.ids) - 1, 0), width, halo.shape[2])
    return torch.cat([first_state[None], rest], dim=0)


class _GatherSequence(torch.autograd.Function):
    """``x [B, L, ...]`` of every rank -> ``[B, R·L, ...]``; backward: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.group, ctx.what = group, what
        gathered = _all_gather(x, group, what)  # [R, B, L, ...]
        return gathered.movedim(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        per_rank = grad.unflatten(1, (world, grad.shape[1] // world)).movedim(1, 0).contiguous()  # [R, B, L, ...]
        summed = _reduce_scatter(per_rank.flatten(0, 1), ctx.group, ctx.what + "_grads")  # this rank's [B, L, ...]
        return summed, None, None


def gather_sequence(x: torch.Tensor, cp_group, what: str = "kv") -> torch.Tensor:
    """All of T: ``x [B, L, ...]`` of every rank -> ``[B, R·L, ...]``, differentiable (each rank's
    slice gets the sum of every rank's gradient for it)."""
    return _GatherSequence.apply(x.contiguous(), cp_group, what)


def softmax_attn_context_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, cu_seqlens: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal softmax attention of this rank's queries over the keys and values of all ranks.

    ``q, k [B, L, H, K]``, ``v [B, L, H, V]``: the rank's slice (``cu_seqlens``: the global
    offsets; a query sees only its own sequence). The keys and values of every rank are
    all-gathered (one collective of ``B·L·H·(K + V)`` per rank; the backward reduce-scatters
    their gradients), and query t of rank r attends to global keys 0 .. r·L + t:
    what :func:`~fastweights.ops.softmax_attn` gives for those rows of the whole sequence.
    PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` (ring attention)
    would send less, but it does not run on the CPU (no sharding rule for
    ``aten._scaled_dot_product_flash_attention_for_cpu`` in torch 2.13). Returns ``o [B, L, H, V]``.
    """
    from ._checks import compute_dtype, resolve_scale

    rank, world = check_cp_group("softmax_attn_context_parallel", cp_group)
    batch, length, heads, key_dim = q.shape
    stop = (rank + 1) * length
    kv = gather_sequence(torch.cat([k, v], dim=-1), cp_group)[:, :stop]  # keys up to this slice's end
    keys, values = kv[..., :key_dim], kv[..., key_dim:]
    queries = rank * length + torch.arange(length, device=q.device)
    columns = torch.arange(stop, device=q.device)
    mask = columns[None, :] <= queries[:, None]
    if cu_seqlens is not None:
        seq = torch.searchsorted(cu_seqlens.to(device=q.device, dtype=torch.long)[1:], columns, right=True)
        mask = mask & (seq[None, :] == seq[queries][:, None])
    dt = compute_dtype(q.dtype)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(dt), keys.transpose(1, 2).to(dt), values.transpose(1, 2).to(dt), attn_mask=mask,
        scale=resolve_scale(scale, key_dim),
    )
    return o.transpose(1, 2).to(q.dtype)


# --------------------------------------------------------------------------------------
# GDN-2 and (Gated) DeltaProduct: the same affine summaries, K×K transitions
# --------------------------------------------------------------------------------------


def _resolved_chunk(chunk_size: Optional[int], q) -> Optional[int]:
    """``chunk_size`` as the chunk op would resolve it (:func:`~._chunk.resolve_chunk_size`, the one
    owner), so every rank checks and cuts with the length the op runs; None stays None for a
    malformed ``q`` (the checks name it)."""
    from ._chunk import resolve_chunk_size

    if not (isinstance(q, torch.Tensor) and q.dim() == 4):
        return chunk_size
    return resolve_chunk_size(chunk_size, q.shape[-1], q.device)


def _family_checks(op: str, q, k, v, gates, initial_state, cu_seqlens, chunk_size, seq_len: Optional[int]) -> None:
    """The argument checks of :func:`gdn2_context_parallel` / :func:`gated_delta_product_context_parallel` on
    this rank's slice (``gates``: ``(name, tensor, shape, low, high)``; ``seq_len``: the global length)."""
    from ..config import check_int
    from ._checks import _check_finite, _check_range, _check_tensor, _shape, check_cu_seqlens

    for name, t, layout in (("q", q, "[B, L, H, K]"), ("k", k, "[B, L·n, H, K]"), ("v", v, "[B, L·n, HV, V]")):
        _check_tensor(op, name, t, 4, layout)
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: `{name}` must have the dtype of `q` ({q.dtype}), got {t.dtype}")
        _check_finite(op, name, t)
    for name, t, shape, low, high in gates:
        _check_tensor(op, name, t, len(shape), "[" + ", ".join(str(s) for s in shape) + "]")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{op}: `{name}` must have shape {list(shape)}, got {_shape(t)}")
        _check_finite(op, name, t)
        _check_range(op, t, low, high, f"`{name}` must lie in [{'-inf' if low is None else f'{low:g}'}, {high:g}]")
    check_int(op, "chunk_size", chunk_size)
    n = q.shape[0] if cu_seqlens is None else check_cu_seqlens(op, cu_seqlens, q.shape[0], seq_len, q.device)
    if initial_state is not None:
        want = (n, q.shape[2], q.shape[3], v.shape[3])
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != want:
            got = _shape(initial_state) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            raise ValueError(f"{op}: `initial_state` must have shape [N, H, K, V] = {list(want)}, got {got}")


def _run_family(op: str, solve_rule, q, k, v, beta, g, gates, initial_state, output_final_state, cu_seqlens,
                chunk_size, qk_norm, scale, cp_group):
    """Checks shared by every rank, q/k normalization, then :func:`run_context_parallel` with ``solve_rule``."""
    from ._checks import compute_dtype, resolve_scale
    from .feature_maps import normalize_qk

    def check(seq_len):
        _family_checks(op, q, k, v, gates, initial_state, cu_seqlens, chunk_size, seq_len)

    _, segments = checked_segments(op, cp_group, check, q, k, v, beta=beta, g=g, initial_state=initial_state,
                                   cu_seqlens=cu_seqlens, cu_seqlens_cpu=None, chunk_size=chunk_size,
                                   output_final_state=output_final_state, normalize=False)
    out_dtype, dt = q.dtype, compute_dtype(q.dtype)
    scale = resolve_scale(scale, q.shape[-1])
    q, k = normalize_qk(q.to(dt), qk_norm, op), normalize_qk(k.to(dt), qk_norm, op)
    h0 = None if initial_state is None else initial_state.to(dt)
    o, h_t = run_context_parallel(solve_rule(scale), segments, cp_group, q, k, v.to(dt), beta.to(dt), g.to(dt), h0,
                                  output_final_state, scale, sum_rule=False)
    return o.to(out_dtype), h_t


def gdn2_context_parallel(
    chunk_op: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
    w: torch.Tensor, *,
    cp_group, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
    qk_norm: Optional[str] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``chunk_op`` (:func:`~fastweights.ops.chunk_gdn2`, or another GDN-2 form with its signature) on
    this rank's slice of a sequence split over ``cp_group``. The op is passed in: this module sits
    below the rule folders in the import graph (their front end imports it).

    The same arguments and layout as ``chunk_gdn2`` (``q, k [B, L, H, K]``, ``v [B, L, HV, V]``,
    ``g, b [B, L, HV, K]``, ``w [B, L, HV, V]``; ``cu_seqlens`` global), the conventions of this
    module (initial states read where a sequence starts, final states on every rank). GDN-2's
    transition ``(I − k (b ⊙ k)ᵀ) diag(e^g)`` is K×K and does not read the write gate w, so the
    slice's summary is the delta rules' ``(A, b)``: the K extra value columns that start from the
    identity get w = 1 (their values are 0, so nothing is written to them). Grouped value heads
    (HV > H) run with q and k repeated per value head.
    """
    op = "gdn2_context_parallel"
    H, HV = _shape_of(q, 2), _shape_of(v, 2)
    if H > 0 and HV > H and HV % H == 0 and k.dim() == 4:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    lead = tuple(v.shape[:3]) if isinstance(v, torch.Tensor) and v.dim() == 4 else (-1,)
    K = _shape_of(q, 3)
    chunk_size = _resolved_chunk(chunk_size, q)
    gates = [("g", g, lead + (K,), None, 0.0), ("b", b, lead + (K,), 0.0, 2.0), ("w", w, lead + (_shape_of(v, 3),), 0.0, 1.0)]
    packed = torch.cat([b, w], dim=-1) if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (b, w)) else b

    def solve_rule(s: float):
        def solve(q, k, v, beta, g, h0, cu, max_len):
            b_, w_ = beta.split([K, beta.shape[-1] - K], dim=-1)
            if v.shape[-1] > w_.shape[-1]:  # the identity columns: w = 1 (their values are 0)
                w_ = torch.cat([w_, w_.new_ones(w_.shape[:-1] + (v.shape[-1] - w_.shape[-1],))], dim=-1)
            return chunk_op(q, k, v, g, b_, w_, scale=s, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                              max_seqlen=max_len, chunk_size=chunk_size)
        return solve

    return _run_family(op, solve_rule, q, k, v, packed, g, gates, initial_state, output_final_state, cu_seqlens,
                       chunk_size, qk_norm, scale, cp_group)


def gated_delta_product_context_parallel(
    chunk_op: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    num_householder: int, *,
    cp_group, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
    qk_norm: Optional[str] = None, allow_neg_eigval: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``chunk_op`` (:func:`~fastweights.ops.chunk_gated_delta_product`, or another form with its
    signature; passed in as for :func:`gdn2_context_parallel`) on this rank's slice of a sequence
    split over ``cp_group``, in its fla layout: ``q [B, L, H, K]``, ``k [B, L·n_h, H, K]``, ``v [B, L·n_h, H, V]``,
    ``beta [B, L·n_h, H]``, ``g [B, L, H]`` (``cu_seqlens``: global token offsets). A token's
    transition is the product of its n_h steps ``I − β k kᵀ`` and its decay: K×K, so the slice's
    summary is the delta rules' ``(A, b)``. The sub-steps travel folded into the head axis
    (``[B, L, n_h·H, ·]``) so that every per-token tensor is cut at the same token positions.
    """
    from ..config import check_int

    op = "gated_delta_product_context_parallel"
    n_h = num_householder
    check_int(op, "num_householder", n_h, what="an int >= 1 (Householder sub-steps per token)")
    B, L, H, K = (_shape_of(q, i) for i in range(4))
    V = _shape_of(v, 3)
    chunk_size = _resolved_chunk(chunk_size, q)
    high = 2.0 if allow_neg_eigval else 1.0
    for name, t, width in (("k", k, K), ("v", v, V), ("beta", beta, None)):
        want = (B, L * n_h, H) + (() if width is None else (width,))
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: `{name}` must have shape {list(want)} (the n_h={n_h} sub-steps of each token "
                             f"after it), got {got}")
    ks, vs = k.reshape(B, L, n_h * H, K), v.reshape(B, L, n_h * H, V)
    betas = beta.reshape(B, L, n_h * H)
    gates = [("g", g, (B, L, H), None, 0.0), ("beta", betas, (B, L, n_h * H), 0.0, high)]

    def solve_rule(s: float):
        def solve(q, k, v, beta, g, h0, cu, max_len):
            b_, t_ = q.shape[:2]
            unfold = (lambda t: t.reshape((b_, t_ * n_h, H) + tuple(t.shape[3:])))
            return chunk_op(q, unfold(k), unfold(v), g, unfold(beta), n_h, scale=s, initial_state=h0,
                                             output_final_state=True, cu_seqlens=cu, max_seqlen=max_len,
                                             chunk_size=chunk_size, allow_neg_eigval=allow_neg_eigval)
        return solve

    return _run_family(op, solve_rule, q, ks, vs, betas, g, gates, initial_state, output_final_state, cu_seqlens,
                       chunk_size, qk_norm, scale, cp_group)
