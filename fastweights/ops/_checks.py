"""Input validation shared by every op.

Every public op calls :func:`check_inputs` first, so a user who passes a wrong
shape, dtype, device or ``cu_seqlens`` gets one ``ValueError``/``TypeError`` that
names the argument, the expected value and the received value -- never a
broadcast surprise deep inside a matmul.

Non-finite inputs (NaN/Inf) are refused by default, because one NaN token
poisons the recurrent state for every later token. The check costs one pass
over the inputs; switch it off with ``fastweights.ops.finite_checks(False)``
(a context manager and a setter). Where the compiled CPU chunk kernels of the
delta rules, of linear attention and of KDA run (``OpSpec.fused_finite_check``), q, k
and v are not read in a pass of their own: the kernel counts their NaN/Inf
entries in the rows it reads anyway, and raises this module's ``ValueError``
(same text, same count) after the call; see :func:`check_qkv_finite`. KDA's and
GDN-2's per-channel log decay is checked the same way where their kernel runs
(``OpSpec.fused_decay_check``: finite and <= 0, :func:`check_decay_stats`).

- CPU tensors: checked on the spot; a bad input raises ``ValueError`` naming it.
- CUDA (any non-CPU) tensors: checked asynchronously with ``torch._assert_async``,
  so no call waits for the device (a host sync in every layer of every step would
  stall the GPU pipeline). A bad input then fails as a device-side assertion at
  the next synchronizing call, naming the op and the argument; such an error
  leaves the CUDA context unusable, as any device assertion does.

Values that are finite but outside the rule's domain are refused too: ``scale``
must be finite and > 0; β in [0, 1] (the write strength of the delta rules;
[0, 2] with ``allow_neg_eigval=True``, where I − β k kᵀ may flip a direction);
the log decay g <= 0 (a decay exp(g) above 1 makes the state grow without bound).
These range checks cost one min/max reduction over β or g ([B, T, H], K times
smaller than q); on CUDA they are queued with ``torch._assert_async`` instead of
read back, so they never wait for the device. ``fastweights.ops.value_checks(False)``
turns them off for users who mean to step outside those ranges.

Under ``torch.compile`` the value checks stay: the NaN/Inf checks, the β and g range
checks and the ``cu_seqlens`` offset checks (starts at 0, strictly increasing, ends at
T, no sequence longer than ``max_seqlen``) become ``torch._assert_async`` calls, which
the compiler keeps in the graph (no graph break; Inductor and AOTAutograd both run
them). A bad value then raises ``RuntimeError`` (not ``ValueError``) at the call, with
the same words: the op and the argument, without the count or the extreme value. The
switches are read when the function is traced: compile inside ``value_checks(False)``
for a graph without them. Checked only in eager mode: the memory check of the score
matrices (:func:`check_score_memory`, it asks the OS) and, without ``max_seqlen``, the
padded length (read from ``cu_seqlens``: the documented graph break).
:func:`check_op_inputs` (``fastweights.ops.check_inputs``) runs every check by hand,
reading the results back on any device.

Sizes: B, H, K and V must be positive; T = 0 is a valid empty sequence (the ops
return an empty output and a copy of the state). ``chunk_size`` must be a positive
int for every form (the recurrent and parallel forms accept it so that all forms
take the same arguments) and is capped at the next power of two of T
(:func:`effective_chunk_size`), and a form whose score matrices would not fit in
the device's memory is refused before it allocates them (:func:`check_score_memory`).
"""

from __future__ import annotations

import contextvars
import functools
import math
import os
import weakref
from typing import Optional, Tuple

import torch

from ..config import check_int
from ._chunk import LONG_CHUNK

__all__ = [
    "check_inputs", "check_op_inputs", "finite_checks", "value_checks", "state_dtype", "compute_dtype",
    "effective_chunk_size", "check_score_memory",
]

_CHECK_FINITE = True
_CHECK_VALUES = True
NO_CHUNKS = object()  # `chunk_size` of an op that has none (softmax attention)


class _Switch:
    """A setter that is also a context manager: ``switch(False)`` lasts until changed;
    ``with switch(False): ...`` restores the old setting on exit."""

    flag = ""  # the module global this switch sets

    def __init__(self, enabled: bool) -> None:
        self._previous = globals()[self.flag]
        globals()[self.flag] = bool(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        globals()[self.flag] = self._previous


class finite_checks(_Switch):
    """Turn the NaN/Inf check on op inputs on or off (a setter and a context manager)."""

    flag = "_CHECK_FINITE"


def finite_checks_on() -> bool:
    """Whether the NaN/Inf check of op inputs is on (:class:`finite_checks`)."""
    return _CHECK_FINITE


def value_checks_on() -> bool:
    """Whether the range checks of op inputs are on (:class:`value_checks`)."""
    return _CHECK_VALUES


class value_checks(_Switch):
    """Turn the range checks on β ([0, 1], or [0, 2]) and g (<= 0) on or off
    (a setter and a context manager). ``scale`` and the sizes are always checked."""

    flag = "_CHECK_VALUES"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of the ops: float64 stays float64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


state_dtype = compute_dtype  # the recurrent state is kept in the same dtype


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(op: str, name: str, t, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{op}: `{name}` must be a floating-point tensor, got dtype {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{op}: `{name}` must have rank {rank} with layout {layout}, got shape {_shape(t)}")


_READ_BACK = False  # set by check_op_inputs: read every check's result back, on any device


def _checked_on_host(t: torch.Tensor) -> bool:
    """Whether a check of ``t`` may wait for its values (CPU tensors, or an explicit
    :func:`check_op_inputs`); otherwise it is queued with ``torch._assert_async``."""
    return (t.device.type == "cpu" or _READ_BACK) and not torch.compiler.is_compiling()


def _check_finite(op: str, name: str, t: torch.Tensor) -> None:
    if not _CHECK_FINITE or t.numel() == 0:
        return
    # compiled (a data-dependent branch would break the graph) or on a device (no host sync):
    # an assert the compiler keeps / the device runs in stream order (module docstring)
    if not _checked_on_host(t):
        torch._assert_async(torch.isfinite(t).all(), f"{op}: `{name}` contains non-finite values (NaN or Inf)")
        return
    # One reduction, no temporaries: a sum is finite only if every entry is (NaN and ±Inf
    # propagate). A finite sum proves the tensor clean; otherwise (bad entries, or an
    # overflowing sum of large finite ones) look entry by entry. The sum runs in the tensor's
    # own dtype (torch accumulates bf16/fp16 in fp32 inside): asking for another dtype would
    # first copy the whole tensor (14 ms of a 37 ms bf16 call at B 1, T 2048, H 8, K = V = 128).
    if bool(torch.isfinite(t.sum())):
        return
    if not bool(torch.isfinite(t).all()):
        _raise_nonfinite(op, name, int((~torch.isfinite(t)).sum()))


def _raise_nonfinite(op: str, name: str, bad: int) -> None:
    raise ValueError(
        f"{op}: `{name}` contains {bad} non-finite value(s) (NaN or Inf); they would poison "
        f"the recurrent state. Clean the input, or disable this check with "
        f"fastweights.ops.finite_checks(False)."
    )


def check_qkv_finite(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The finite check of ``q``, ``k`` and ``v`` alone (:func:`check_inputs` makes it unless told that
    the solver will: ``finite_qkv=False``; the compiled chunk kernels count NaN/Inf while they gather
    the rows, with this text)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_finite(op, name, t)


def bf16_operands(check_finite: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``(q, k, check_finite)`` for a bf16-products kernel: q and k rounded to bf16 (v is bf16
    already), and the finite check left to the kernel (``check_finite``: the op's name, "" for none)
    unless q or k arrived wider (normalized in fp32): rounding a huge finite entry to bf16 may give
    ±Inf, so q, k, v are checked here as the caller gave them and the kernel's check is switched off."""
    if check_finite and not q.dtype == k.dtype == torch.bfloat16:
        check_qkv_finite(check_finite, q, k, v)
        check_finite = ""
    return q.to(torch.bfloat16), k.to(torch.bfloat16), check_finite


def _check_range(op: str, t: torch.Tensor, low: Optional[float], high: float, rule: str, hint: str = "") -> None:
    """Refuse entries of ``t`` outside [low, high] (``low=None``: no lower bound, one reduction
    less); ``rule`` says so in words ("`beta` must lie in [0, 1]"). On CUDA the comparison is
    queued (``torch._assert_async``), never read back."""
    if not _CHECK_VALUES or t.numel() == 0:
        return
    t = t.detach()
    lo, hi = torch.aminmax(t) if low is not None else (None, t.amax())
    if not _checked_on_host(t):  # no device->host sync on the hot path
        torch._assert_async(hi <= high if lo is None else (lo >= low) & (hi <= high), f"{op}: {rule}{hint}")
        return
    _raise_outside(op, None if lo is None else float(lo), float(hi), low, high, rule, hint)


def _raise_outside(op: str, lo: Optional[float], hi: float, low: Optional[float], high: float, rule: str,
                   hint: str) -> None:
    """:func:`_check_range`'s error for the extremes ``lo`` (None: not asked for) and ``hi``, if they are out."""
    if hi > high:
        found = f"values up to {hi:g}"
    elif lo is not None and lo < low:
        found = f"values down to {lo:g}"
    else:
        return
    raise ValueError(f"{op}: {rule}, got {found}{hint}")


def _beta_rule(allow_neg_eigval: bool) -> Tuple[float, str]:
    """β's upper bound and the rule's words."""
    if allow_neg_eigval:
        return 2.0, "`beta` must lie in [0, 2] (allow_neg_eigval=True)"
    return 1.0, "`beta` must lie in [0, 1] ([0, 2] with allow_neg_eigval=True)"


def _check_finite_in_range(op: str, name: str, t: torch.Tensor, low: Optional[float], high: float, rule: str,
                           hint: str = "") -> None:
    """:func:`_check_finite` then :func:`_check_range` on ``t``, from one reduction where both switches
    are on and ``t`` is checked on the host: extremes that are finite prove every entry finite
    (``aminmax`` propagates NaN, and ±Inf is an extreme)."""
    if _CHECK_FINITE and _CHECK_VALUES and t.numel() > 0 and _checked_on_host(t):
        lo, hi = torch.aminmax(t.detach())
        lo, hi = float(lo), float(hi)
        if math.isfinite(lo) and math.isfinite(hi):
            _raise_outside(op, None if low is None else lo, hi, low, high, rule, hint)
            return
    _check_finite(op, name, t)
    _check_range(op, t, low, high, rule, hint)


_G_RULE = ("`g` (the log decay) must be <= 0",
           "; a decay exp(g) above 1 makes the state grow. If that is intended, disable this "
           "check with fastweights.ops.value_checks(False)")


def check_beta_range(op: str, beta: torch.Tensor, allow_neg_eigval: bool) -> None:
    """β's range check alone (see the module docstring), for a caller that makes the finite check
    elsewhere; :func:`check_inputs` checks β finite and in range together."""
    _check_range(op, beta, 0.0, *_beta_rule(allow_neg_eigval))


def resolve_scale(scale: Optional[float], key_dim: int) -> float:
    """The one owner of ``scale``: the read scale itself, or ``K ** -0.5`` for ``None`` (every op's default)."""
    return key_dim ** -0.5 if scale is None else float(scale)


def check_scale(op: str, scale) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: `scale` must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{op}: `scale` must be a finite number > 0, got {scale!r} (None means K ** -0.5)")


def effective_chunk_size(chunk_size: int, seq_len: int) -> int:
    """The chunk length a chunk form uses: ``chunk_size``, but at most the next power of two
    of T and never below :data:`~._chunk.LONG_CHUNK` for that cap (so no default chunk length, and
    none up to 64, depends on T: a sequence's result is the same alone, in a batch and packed). A chunk much longer than
    the sequence only pads it, and costs O(C²) per chunk; a cap that followed T all the
    way down would make a short sequence's arithmetic (its chunking) depend on the
    longest sequence it is batched or packed with, and its result change in the last bits."""
    cap = max(LONG_CHUNK, 1 << max(seq_len - 1, 0).bit_length())
    return max(1, min(chunk_size, cap))


@functools.lru_cache(maxsize=None)
def _device_memory(kind: str, index: Optional[int]) -> int:
    if kind == "cuda":
        return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).total_memory
    return _host_memory()


@functools.lru_cache(maxsize=1)
def _host_memory() -> int:
    """The host's physical memory in bytes (asked once: two system calls a check otherwise)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no limit known
        return 1 << 62


def check_score_memory(op: str, n: int, heads: int, rows: int, width: int, dtype: torch.dtype,
                       device: torch.device, what: str) -> None:
    """Refuse a call whose ``[rows, width]`` score matrices per sequence and head (T x T for a
    parallel form, T x C for a chunk form) would not fit in the device's memory, before
    they are allocated (an allocator error for 1e12 bytes names nothing)."""
    needed = n * heads * rows * width * (torch.finfo(dtype).bits // 8)
    limit = _device_memory(device.type, device.index)
    if needed > limit:
        raise ValueError(
            f"{op}: {what} need {needed:.3g} bytes ({n} x {heads} x {rows} x {width} "
            f"{str(dtype).replace('torch.', '')}), more than the {limit:.3g} bytes of memory of {device}; "
            f"use a chunk form with a smaller `chunk_size`, or split the sequence"
        )


def check_cu_seqlens(
    op: str, cu_seqlens, batch_size: int, seq_len: int, device: torch.device,
    cu_seqlens_cpu=None, max_seqlen=None,
) -> int:
    """Validate FlashAttention-style packed sequence offsets; return the number of sequences.

    ``cu_seqlens_cpu`` (the same offsets on the CPU) lets the value checks run without
    a device sync; ``max_seqlen`` (an int >= the longest sequence) is the padded length.
    Under ``torch.compile`` the checks that read the offsets' values are skipped (a
    data-dependent branch would break the graph): there the caller vouches for them.
    Offsets checked once are remembered (with their host copy, until the tensor changes or
    is freed), so the LM's check serves every layer's op: one host read per forward.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: `cu_seqlens` must be a LongTensor of shape [N+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: `cu_seqlens` must have dtype torch.int64 or torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: `cu_seqlens` must be 1-D with at least 2 entries [0, ..., T], got shape {_shape(cu_seqlens)}")
    if cu_seqlens.device != device:
        raise ValueError(f"{op}: `cu_seqlens` is on {cu_seqlens.device}, expected the inputs' device {device}")
    if batch_size != 1:
        raise ValueError(f"{op}: `cu_seqlens` requires batch size 1 (sequences packed along T), got batch size {batch_size}")
    if cu_seqlens_cpu is not None:
        if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.dtype not in (torch.int64, torch.int32):
            what = cu_seqlens_cpu.dtype if isinstance(cu_seqlens_cpu, torch.Tensor) else type(cu_seqlens_cpu).__name__
            raise TypeError(f"{op}: `cu_seqlens_cpu` must be an int64 or int32 tensor (a CPU copy of `cu_seqlens`), got {what}")
        if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(
                f"{op}: `cu_seqlens_cpu` must be a CPU tensor of the shape of `cu_seqlens` {_shape(cu_seqlens)}, "
                f"got {_shape(cu_seqlens_cpu)} on {cu_seqlens_cpu.device}"
            )
    check_int(op, "max_seqlen", max_seqlen, none_ok=True, error=TypeError,
              what="a positive int (the longest sequence in `cu_seqlens`)")
    n = cu_seqlens.numel() - 1
    if torch.compiler.is_compiling():  # reading the offsets would break the graph: asserts instead
        cu = cu_seqlens.long()
        steps = cu[1:] - cu[:-1]
        torch._assert_async(cu[0] == 0, f"{op}: `cu_seqlens` must start at 0")
        torch._assert_async((steps > 0).all(), f"{op}: `cu_seqlens` must be strictly increasing")
        torch._assert_async(cu[-1] == seq_len, f"{op}: `cu_seqlens` must end at the sequence length T={seq_len}")
        if max_seqlen is not None:
            torch._assert_async(steps.max() <= max_seqlen,
                                f"{op}: `max_seqlen`={max_seqlen} is smaller than a sequence of `cu_seqlens`")
        return n
    seen = _CHECKED.get(id(cu_seqlens))
    if seen is not None and seen.tensor() is cu_seqlens and seen.version == cu_seqlens._version \
            and seen.seq_len == seq_len and (max_seqlen is None or seen.longest <= max_seqlen) \
            and (cu_seqlens_cpu is None or cu_seqlens_cpu is seen.host):
        return n  # these offsets, unchanged since, were checked (and copied to the host) already
    host = _check_offsets(op, cu_seqlens, cu_seqlens_cpu, seq_len, max_seqlen)
    _remember(cu_seqlens, host, seq_len)
    return n


class _Checked:
    """A ``cu_seqlens`` tensor whose offsets :func:`check_cu_seqlens` has checked: the tensor (weakly),
    its version counter then, the length it was checked against, its host copy, its longest sequence."""

    __slots__ = ("tensor", "version", "seq_len", "host", "longest")

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, seq_len: int) -> None:
        self.tensor, self.version, self.seq_len, self.host = weakref.ref(tensor), tensor._version, seq_len, host
        self.longest = int((host[1:] - host[:-1]).max())


_CHECKED: dict = {}  # id(cu_seqlens) -> _Checked, dropped when the tensor is freed


def _remember(cu_seqlens: torch.Tensor, host: torch.Tensor, seq_len: int) -> None:
    key = id(cu_seqlens)
    if key not in _CHECKED:
        weakref.finalize(cu_seqlens, _CHECKED.pop, key, None)
    _CHECKED[key] = _Checked(cu_seqlens, host, seq_len)


def checked_cu_seqlens_cpu(cu_seqlens: torch.Tensor) -> Optional[torch.Tensor]:
    """The host copy of offsets :func:`check_cu_seqlens` has checked (and that have not changed
    since), or ``None``. The LM checks its ``cu_seqlens`` once per forward; every layer's op then
    finds them checked, so nothing reads the offsets from the device again."""
    seen = _CHECKED.get(id(cu_seqlens))
    if seen is None or seen.tensor() is not cu_seqlens or seen.version != cu_seqlens._version:
        return None
    return seen.host


def _check_offsets(op: str, cu_seqlens: torch.Tensor, cu_seqlens_cpu, seq_len: int, max_seqlen) -> torch.Tensor:
    """The value checks of :func:`check_cu_seqlens` (one host read); returns the offsets on the host."""
    name = "cu_seqlens" if cu_seqlens_cpu is None else "cu_seqlens_cpu"
    host = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).to("cpu", torch.long)
    offsets = host.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{op}: `{name}` must start at 0, got {offsets[0]}")
    steps = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if any(s <= 0 for s in steps):
        i = next(i for i, s in enumerate(steps) if s <= 0)
        raise ValueError(
            f"{op}: `{name}` must be strictly increasing, got {offsets[i]} followed by {offsets[i + 1]} at index {i}"
        )
    if offsets[-1] != seq_len:
        raise ValueError(f"{op}: `{name}` must end at the sequence length T={seq_len}, got {offsets[-1]}")
    if max_seqlen is not None and max(steps) > max_seqlen:
        i = steps.index(max(steps))
        raise ValueError(
            f"{op}: `max_seqlen`={max_seqlen} is smaller than sequence {i} of `{name}` ({steps[i]} tokens); "
            f"pass at least the longest length, {max(steps)}"
        )
    return host


def check_chunk_size(op: str, chunk_size) -> None:
    """``chunk_size`` must be a positive int in every form (``None`` was resolved before: it means
    :func:`~fastweights.ops.default_chunk_size`'s choice)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"{op}: `chunk_size` must be a positive int, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"{op}: `chunk_size` must be positive, got {chunk_size}")


#: True while an op called with fla's ``state_v_first=True`` checks its arguments: the caller's
#: ``initial_state`` is ``[N, H, V, K]``, transposed on the way in, so a wrong shape is quoted in
#: the caller's layout (set by :func:`fastweights.ops._forms.accepts_state_v_first`). Read
#: only on the way to an error, and neither set nor read under ``torch.compile``, which cannot trace it.
STATE_V_FIRST = contextvars.ContextVar("fastweights_state_v_first", default=False)


def _state_v_first() -> bool:
    return not torch.compiler.is_compiling() and STATE_V_FIRST.get()

#: How the errors describe each per-channel log decay, by its layout.
_DECAY_KIND = {"[B, T, H, K]": "a per-key-channel log decay", "[B, T, H, V]": "a per-value-channel log decay"}


def _decay_rule(name: str, layout: str) -> Tuple[str, str]:
    """The range rule of a per-channel log decay and its hint, as the checks word them."""
    return (f"`{name}` ({_DECAY_KIND[layout]}) must be <= 0",
            f"; a decay exp({name}) above 1 makes the state grow. If that is intended, disable this "
            "check with fastweights.ops.value_checks(False)")


def check_decay(op: str, name: str, t: torch.Tensor, layout: str = "[B, T, H, K]") -> None:
    """A per-channel log decay's checks (the switches apply): finite, then <= 0. :func:`check_inputs`
    makes them, unless the solver will (``decay_by_solver``: a compiled kernel counts what it needs
    while it reads the decays, :func:`check_decay_stats`, or the solver calls this)."""
    _check_finite_in_range(op, name, t, None, 0.0, *_decay_rule(name, layout))


def check_decay_stats(op: str, name: str, stats: torch.Tensor, layout: str = "[B, T, H, K]") -> None:
    """:func:`check_decay` from a kernel's counts: ``stats [tasks, 3]`` (float64) holds each task's
    non-finite entries, NaN entries and largest entry NaN aside; the same errors, with the same
    numbers (the largest entry is NaN when any is, as ``amax`` gives it, and then none is out)."""
    if stats.numel() == 0:
        return
    # One read-back where the tasks are few (sequences x heads; each torch call after a long kernel
    # runs on cold caches, and this check follows one): the three columns reduced in Python.
    if stats.shape[0] <= 4096:
        rows = stats.tolist()
        bad, nan, high = sum(r[0] for r in rows), sum(r[1] for r in rows), max(r[2] for r in rows)
    else:
        (bad, nan), high = stats[:, :2].sum(0).tolist(), float(stats[:, 2].max())
    if _CHECK_FINITE and bad > 0:
        _raise_nonfinite(op, name, int(bad))
    if _CHECK_VALUES:
        _raise_outside(op, None, float("nan") if nan > 0 else float(high), None, 0.0, *_decay_rule(name, layout))


def _check_state_shape(op: str, initial_state: torch.Tensor, n: int, heads: int, sk: int, sv: int) -> None:
    """``initial_state`` must be ``[N, H, K, V]``, or ``[N, H, V, K]`` as the caller passed it under ``state_v_first``."""
    if tuple(initial_state.shape) == (n, heads, sk, sv):
        return
    if _state_v_first():  # quote the caller's own layout: the shape it must pass, and the one it passed
        got = list(initial_state.shape[:-2]) + [initial_state.shape[-1], initial_state.shape[-2]]
        raise ValueError(
            f"{op}: `initial_state` must have shape [N, H, V, K] = [{n}, {heads}, {sv}, {sk}] (state_v_first=True), got {got}"
        )
    raise ValueError(f"{op}: `initial_state` must have shape [N, H, K, V] = [{n}, {heads}, {sk}, {sv}], got {_shape(initial_state)}")


def check_inputs(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: Optional[torch.Tensor] = None,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    state_key_dim: Optional[int] = None,
    state_value_dim: Optional[int] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size=NO_CHUNKS,
    scale: Optional[float] = None,
    allow_neg_eigval: bool = False,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
    seq_len: Optional[int] = None,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    gk_name: str = "gk",
    finite_qkv: bool = True,
    decay_by_solver: bool = False,
) -> int:
    """Check the arguments of an op; return N, the number of sequences.

    ``state_key_dim``/``state_value_dim`` are the state's K and V after any
    feature map or normalizer column; they default to q's and v's last sizes.
    ``chunk_size`` is checked unless it is left at ``NO_CHUNKS`` (an op without one);
    ``allow_neg_eigval`` widens β's range to [0, 2]. ``seq_len`` is the length that
    ``cu_seqlens`` must end at, when it is not T (context parallelism: the global length).
    ``gk`` [B, T, H, K] and ``gv`` [B, T, H, V] are per-channel log decays (``gk_name``: the
    name the caller gave the key gate, ``g`` in fla's KDA call form), checked like ``g``.
    ``finite_qkv=False`` / ``decay_by_solver=True``: the solver makes the finite check of q, k, v /
    the checks of ``gk`` itself (:func:`check_qkv_finite`, :func:`check_decay`, or a compiled kernel).
    """
    _check_tensor(op, "q", q, 4, "[B, T, H, K]")
    _check_tensor(op, "k", k, 4, "[B, T, H, K]")
    _check_tensor(op, "v", v, 4, "[B, T, H, V]")
    if k.shape != q.shape:
        raise ValueError(f"{op}: `k` must have the shape of `q` {_shape(q)} ([B, T, H, K]), got {_shape(k)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{op}: `v` must have shape [B, T, H, V] = [{q.shape[0]}, {q.shape[1]}, {q.shape[2]}, V] to match `q`, "
            f"got {_shape(v)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: `{name}` must have the dtype of `q` ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{op}: `{name}` is on {t.device}, expected the device of `q` ({q.device})")
    B, T, H, K = q.shape
    if B == 0 or H == 0 or K == 0:
        raise ValueError(f"{op}: `q` must have sizes B, H, K > 0 (only T may be 0), got shape {_shape(q)}")
    if v.shape[-1] == 0:
        raise ValueError(f"{op}: `v` must have size V > 0, got shape {_shape(v)}")
    for name, t in (("beta", beta), ("g", g)):
        if t is None:
            continue
        _check_tensor(op, name, t, 3, "[B, T, H]")
        if t.shape != q.shape[:3]:
            raise ValueError(f"{op}: `{name}` must have shape [B, T, H] = [{B}, {T}, {H}], got {_shape(t)}")
        if t.device != q.device:
            raise ValueError(f"{op}: `{name}` is on {t.device}, expected the device of `q` ({q.device})")
    for name, t, width, layout in ((gk_name, gk, K, "[B, T, H, K]"), ("gv", gv, v.shape[-1], "[B, T, H, V]")):
        if t is None:
            continue
        _check_tensor(op, name, t, t.dim(), layout)  # a tensor of floats; the shape (rank included) below
        if t.shape != q.shape[:3] + (width,):
            raise ValueError(
                f"{op}: `{name}` ({_DECAY_KIND[layout]}) must have shape {layout} = [{B}, {T}, {H}, {width}], got {_shape(t)}"
            )
        if t.device != q.device:
            raise ValueError(f"{op}: `{name}` is on {t.device}, expected the device of `q` ({q.device})")
    if chunk_size is not NO_CHUNKS:
        check_chunk_size(op, chunk_size)
    check_scale(op, scale)
    n = B
    if cu_seqlens is not None:
        n = check_cu_seqlens(op, cu_seqlens, B, T if seq_len is None else seq_len, q.device, cu_seqlens_cpu, max_seqlen)
    elif cu_seqlens_cpu is not None or max_seqlen is not None:
        which = "cu_seqlens_cpu" if cu_seqlens_cpu is not None else "max_seqlen"
        raise ValueError(f"{op}: `{which}` describes packed sequences and needs `cu_seqlens`, which is None")
    if initial_state is not None:
        sk = K if state_key_dim is None else state_key_dim
        sv = v.shape[-1] if state_value_dim is None else state_value_dim
        layout = "[N, H, K, V]"
        if not (isinstance(initial_state, torch.Tensor) and initial_state.dim() == 4) and _state_v_first():
            layout = "[N, H, V, K]"  # an error is coming: in the caller's layout
        _check_tensor(op, "initial_state", initial_state, 4, layout)
        _check_state_shape(op, initial_state, n, H, sk, sv)
        want = state_dtype(q.dtype)
        if initial_state.dtype != want:
            raise TypeError(
                f"{op}: `initial_state` must have dtype {want} (states are fp32, or fp64 for fp64 inputs), "
                f"got {initial_state.dtype}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"{op}: `initial_state` is on {initial_state.device}, expected the device of `q` ({q.device})")
    if finite_qkv:  # else the solver checks them (check_qkv_finite, or a compiled kernel's gather)
        check_qkv_finite(op, q, k, v)
    checked_gk = None if decay_by_solver else gk
    # each finite and in range, from one reduction where it can (_check_finite_in_range)
    if beta is not None:
        _check_finite_in_range(op, "beta", beta, 0.0, *_beta_rule(allow_neg_eigval))
    if g is not None:
        _check_finite_in_range(op, "g", g, None, 0.0, *_G_RULE)
    for name, t, layout in ((gk_name, checked_gk, "[B, T, H, K]"), ("gv", gv, "[B, T, H, V]")):
        if t is not None:
            _check_finite_in_range(op, name, t, None, 0.0, *_decay_rule(name, layout))
    if initial_state is not None:
        _check_finite(op, "initial_state", initial_state)
    return n


def check_op_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: Optional[torch.Tensor] = None,
    g: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    allow_neg_eigval: bool = False,
    max_seqlen: Optional[int] = None,
    op: str = "check_inputs",
) -> int:
    """Every check an op makes on ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``beta, g [B, T, H]``,
    ``initial_state [N, H, K, V]`` and ``cu_seqlens [N + 1]``, by hand; returns N.

    Public as ``fastweights.ops.check_inputs``. Unlike the ops' own checks it reads every
    result back on any device (a ``ValueError`` naming the argument, here and now, instead
    of a queued device assertion), so call it outside compiled code, where you want to
    know. The switches :func:`finite_checks` / :func:`value_checks` apply.
    """
    global _READ_BACK
    previous, _READ_BACK = _READ_BACK, True
    try:
        return check_inputs(op, q, k, v, beta=beta, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            scale=scale, allow_neg_eigval=allow_neg_eigval, max_seqlen=max_seqlen)
    finally:
        _READ_BACK = previous
