"""The compiled CPU kernels as ``torch.library`` custom ops (namespace ``fastweights``).

A pybind function is opaque to ``torch.compile``: it cannot run on the fake tensors the
compiler traces with, so a traced call site had to take its PyTorch formulas instead, and
a compiled graph ran different code from eager. Registered as custom ops, with a fake
implementation that gives the outputs' exact shapes, dtypes and strides, the kernels
appear in the graph as single calls (``torch.ops.fastweights.<name>``) and run at
execution time exactly as in eager: compiled and eager results are bitwise equal.

One entry per kernel: a function named after the extension's function, whose
annotations are the op's schema and whose body is the fake implementation (shapes
only, nothing computed). The real implementation calls the extension's function of the
same name (or the entry's ``call``). To add a kernel, add one entry::

    @kernel
    def my_kernel_fwd(x: Tensor, eps: float) -> Tensor:
        return torch.empty_like(x)

and call it at the call site as ``mod.my_kernel_fwd(...)`` on the ``mod`` that
:func:`~fastweights.ops.cpu.kernels_for` returned (this module).

Each entry's module-level function routes: while ``torch.compile`` traces, it calls the
custom op (the graph gets the op, the fake gives the shapes); otherwise it calls the
extension's function directly (eager pays no dispatcher overhead: the decode step is a
few microseconds). Registration builds nothing: the extension is built or loaded on the
first real call (``fastweights.ops.cpu.kernels()``), and whether the kernels are
available is decided at trace time, outside the graph (``kernels_for``).

Differentiable kernels (the short convolution, the q/k L2 norm) also carry autograd, the
backward being the ``_bwd`` op. The chunk forward and backward need none: they run inside
``fastweights::chunk_delta_rule_fwd``/``_bwd`` (``../delta_rule/chunk.py``; inference:
``chunk_delta_rule_infer``), whose registered backward calls the backward kernel.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["kernel", "OPS", "chunk_delta_fwd", "chunk_delta_fwd_bf16", "chunk_kda_fwd_bf16", "chunk_delta_bwd", "delta_step", "delta_step_pool",
           "short_conv_fwd", "short_conv_bwd", "l2norm_fwd", "l2norm_bwd"]

#: name -> the registered op, ``torch.ops.fastweights.<name>.default``.
OPS: Dict[str, torch._ops.OpOverload] = {}
_LIB = torch.library.Library("fastweights", "FRAGMENT")  # holds the registrations (kept alive here)


_package = sys.modules[__package__]  # fastweights.ops.cpu (importing this module at its end)


def _extension():
    """The built extension (building or loading it on the first call); raises if unavailable,
    which a call site never sees: it asked :func:`~fastweights.ops.cpu.kernels_for` first.
    (The loaded module is read directly: a decode step is a few microseconds.)"""
    mod = _package._module or _package.kernels()
    if mod is None:
        raise RuntimeError(f"fastweights: a compiled CPU kernel was called but {_package.status()}")
    return mod


def _as_outputs(result):
    """pybind returns a ``std::vector`` as a list; a custom op declared ``-> Tuple[...]`` returns a tuple."""
    return tuple(result) if isinstance(result, list) else result


def kernel(fake: Optional[Callable] = None, *, mutates_args=(), call: Optional[Callable] = None):
    """Register the kernel named ``fake.__name__`` as ``fastweights::<name>``; returns the routed function.

    ``fake``: annotated like the op (``Tensor``, ``Optional[Tensor]``, ``float``, ``int``, ``bool``;
    ``-> Tensor`` or ``-> Tuple[Tensor, ...]``) and returning empty tensors shaped as the kernel's
    outputs. ``call(mod, *args)``: the real implementation on the built extension ``mod``
    (default: ``mod.<name>(*args)``). ``mutates_args``: the names of the arguments written in place.
    """
    if fake is None:
        return lambda f: kernel(f, mutates_args=mutates_args, call=call)
    name = fake.__name__

    def run(*args):
        mod = _extension()
        return _as_outputs(call(mod, *args) if call is not None else getattr(mod, name)(*args))

    # Defined through torch.library.Library rather than torch.library.custom_op: the dispatcher
    # then calls ``run`` directly (about 7 us a call here against about 75 us through custom_op's
    # Python autograd and view-tracking layers), which a compiled decode step pays per layer.
    _LIB.define(name + torch.library.infer_schema(fake, mutates_args=mutates_args))
    _LIB.impl(name, run, "CPU")
    torch.library.register_fake(f"fastweights::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.fastweights, name).default
    OPS[name] = op

    def routed(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return run(*args)

    routed.__name__ = routed.__qualname__ = name
    routed.__doc__ = fake.__doc__
    routed.op = op
    return routed


def _distinct_empties(outputs, first_empty: int):
    """The chunk forward returns one empty tensor in every unused slot; a custom op's outputs
    must not alias each other, so each slot gets its own."""
    return outputs[:first_empty] + tuple(t.new_empty(0) for t in outputs[first_empty:])


# -- the chunk forward / backward (chunk_delta.cpp) --------------------------------------------
#
# The output layout is the kernels' chunk buffer [N, NC·C, H, ·] (``from_chunk_buffer`` views it).


def _chunk_delta_fwd(mod, *args):
    out = tuple(mod.chunk_delta_fwd(*args))
    return out if args[9] else _distinct_empties(out, 2)  # args[9]: keep


@kernel(call=_chunk_delta_fwd)
def chunk_delta_fwd(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], h0: Optional[Tensor],
                    scale: float, chunk_size: int, nb: int, keep: bool, check_finite: str = ""
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The (gated) delta rule's chunk forward on ``[N, H, T, ·]`` inputs (fp32 or fp64, unit last
    stride), ``h0 [N·H, K, V]`` or None: ``(o [N, NC·C, H, V], h_T [N·H, K, V], states [NC, N·H, K, V],
    q_flat [R, C, K], kv_flat [R, C, K + V], wu [R, C, K + V], inverses [nb, R, C/nb, C/nb])`` with
    R = NC·N·H; the last five are empty unless ``keep``. ``check_finite``: an op's name, for the
    finite check of q, k, v made as the rows are gathered (the ops' ValueError), or "" for none."""
    n, nh, t_len, dk = k.shape
    dv, c = v.shape[-1], chunk_size
    nc = -(-t_len // c)
    o, h = v.new_empty(n, nc * c, nh, dv), v.new_empty(n * nh, dk, dv)
    if not keep:
        return (o, h) + tuple(v.new_empty(0) for _ in range(5))
    rows = nc * n * nh
    return (o, h, v.new_empty(nc, n * nh, dk, dv), v.new_empty(rows, c, dk), v.new_empty(rows, c, dk + dv),
            v.new_empty(rows, c, dk + dv), v.new_empty(nb, rows, c // nb, c // nb))


@kernel
def chunk_delta_fwd_bf16(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], h0: Optional[Tensor],
                         scale: float, chunk_size: int, check_finite: str = "") -> Tuple[Tensor, Tensor]:
    """The bf16-products inference forward: q, k, v bf16 ``[N, H, T, ·]``, beta/g/h0 fp32 ->
    ``(o [N, NC·C, H, V] bf16, h_T [N·H, K, V] fp32)``; ``check_finite`` as for :func:`chunk_delta_fwd`."""
    n, nh, t_len, dk = k.shape
    dv, nc = v.shape[-1], -(-t_len // chunk_size)
    return v.new_empty(n, nc * chunk_size, nh, dv), beta.new_empty(n * nh, dk, dv)


@kernel
def chunk_kda_fwd_bf16(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gk: Tensor, h0: Optional[Tensor], scale: float,
                       chunk_size: int, check_finite: str = "", check_decay: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """KDA's bf16-products inference forward (``chunk_kda_bf16.cpp``): q, k, v bf16 ``[N, H, T, ·]``,
    beta ``[N, H, T]``, gk ``[N, H, T, K]`` and h0 ``[N·H, K, V]`` fp32 -> ``(o [N, NC·C, H, V] bf16,
    h_T [N·H, K, V] fp32, decay_stats [N·H, 3] float64)``, the stats empty unless ``check_decay``
    (gk's non-finite and NaN counts and largest entry per task, for ``_checks.check_decay_stats``);
    ``check_finite`` as for :func:`chunk_delta_fwd`."""
    n, nh, t_len, dk = k.shape
    dv, nc = v.shape[-1], -(-t_len // chunk_size)
    return (v.new_empty(n, nc * chunk_size, nh, dv), beta.new_empty(n * nh, dk, dv),
            beta.new_empty(n * nh if check_decay else 0, 3, dtype=torch.float64))


@kernel
def chunk_delta_bwd(q_flat: Tensor, kv_flat: Tensor, wu: Tensor, states: Tensor, beta: Tensor, g: Optional[Tensor],
                    do: Tensor, dh_final: Tensor, scale: float, chunk_size: int
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The chunk backward from the forward's kept tensors: ``(dq, dk [N, NC·C, H, K], dv [N, NC·C, H, V],
    dbeta [N, NC·C, H], dg [N, NC·C, H] (empty without g), dh0 [N·H, K, V])``."""
    nc, nhh, dk, dv = states.shape
    n, nh = beta.shape[:2]
    rows = nc * chunk_size
    dg = states.new_empty(n, rows, nh) if g is not None else states.new_empty(0)
    return (states.new_empty(n, rows, nh, dk), states.new_empty(n, rows, nh, dk), states.new_empty(n, rows, nh, dv),
            states.new_empty(n, rows, nh), dg, states.new_empty(nhh, dk, dv))


# -- the decode step (decode_step.cpp) --------------------------------------------------------
#
# The kernel updates the state in place or into a new tensor; an op's output may not alias
# its input, so these are two ops, and ``delta_step`` below keeps the extension's signature.


@kernel(call=lambda mod, q, k, v, beta, g, state, scale: mod.delta_step(q, k, v, beta, g, state, scale, False))
def delta_step_out(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], state: Tensor,
                   scale: float) -> Tuple[Tensor, Tensor]:
    """One (gated) delta-rule token into a new state: ``q, k [N, H, K]``, ``v [N, H, V]``, ``beta, g [N, H]``
    (cast to the state's dtype), ``state [N, H, K, V]`` contiguous -> ``(o [N, H, V] in v's dtype, h')``."""
    n, nh, _, dv = state.shape
    return state.new_empty(n, nh, dv, dtype=v.dtype), torch.empty_like(state)


@kernel(mutates_args=("state",),
        call=lambda mod, q, k, v, beta, g, state, scale: mod.delta_step(q, k, v, beta, g, state, scale, True)[0])
def delta_step_inplace(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], state: Tensor,
                       scale: float) -> Tensor:
    """:func:`delta_step_out` writing the new state into ``state``; returns ``o [N, H, V]``."""
    n, nh, _, dv = state.shape
    return state.new_empty(n, nh, dv, dtype=v.dtype)


@kernel(mutates_args=("pool",))
def delta_step_pool(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], pool: Tensor, slots: Tensor,
                    has_initial_state: Optional[Tensor], scale: float) -> Tensor:
    """One token for N sessions held in a pool ``[S, H, K, V]`` (contiguous), each reading and writing its
    slot ``slots [N]`` (int64, −1: a fresh state, not written) in place; ``has_initial_state [N]`` bool or
    None; ``q, k [N, H, K]``, ``v [N, H, V]``, ``beta, g [N, H]`` -> ``o [N, H, V]`` in v's dtype."""
    return pool.new_empty(q.shape[0], pool.shape[1], pool.shape[3], dtype=v.dtype)


def delta_step(q, k, v, beta, g, state, scale: float, inplace: bool):
    """The extension's ``delta_step``: ``(o, state)`` with ``state`` updated in place when ``inplace``, else
    ``(o, new state)``; under ``torch.compile`` by the two ops above."""
    if not torch.compiler.is_compiling():
        return _as_outputs(_extension().delta_step(q, k, v, beta, g, state, scale, inplace))
    if inplace:
        return delta_step_inplace(q, k, v, beta, g, state, scale), state
    return delta_step_out(q, k, v, beta, g, state, scale)


# -- the short convolution (short_conv.cpp) ---------------------------------------------------


@kernel
def short_conv_fwd(x: Tensor, state: Tensor, taps: Tensor) -> Tensor:
    """``y [B, T, C]`` from ``x [B, T, C]``, ``state [B, W−1, C]``, ``taps [W, C]`` (contiguous, fp32 or fp64)."""
    return torch.empty_like(x)


@kernel
def short_conv_bwd(dy: Tensor, x: Tensor, state: Tensor, taps: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Its backward: ``(dx, dstate, dtaps)``, shaped as ``x``, ``state``, ``taps``."""
    return torch.empty_like(x), torch.empty_like(state), torch.empty_like(taps)


def _short_conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _short_conv_backward(ctx, dy):
    x, state, taps = ctx.saved_tensors
    return short_conv_bwd.op(dy.contiguous(), x, state, taps)


torch.library.register_autograd("fastweights::short_conv_fwd", _short_conv_backward, setup_context=_short_conv_setup, lib=_LIB)


# -- the q/k L2 norm (l2norm.cpp) -------------------------------------------------------------


@kernel
def l2norm_fwd(x: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """``(y, r)``: ``y = x · r`` with ``r = rsqrt(Σx² + eps)`` per row of the last dim (``x`` contiguous,
    fp32 or fp64; ``r`` flat, one entry per row)."""
    dim = x.shape[-1] if x.dim() else 0
    return torch.empty_like(x), x.new_empty(0 if dim == 0 else x.numel() // dim)


@kernel
def l2norm_bwd(dy: Tensor, y: Tensor, r: Tensor) -> Tensor:
    """Its backward: ``dx = r · (dy − y (y·dy))``, shaped as ``y``."""
    return torch.empty_like(y)


def _l2norm_setup(ctx, inputs, output):
    ctx.save_for_backward(*output)


def _l2norm_backward(ctx, dy, _dr):
    y, r = ctx.saved_tensors
    return l2norm_bwd.op(dy.contiguous(), y, r), None


torch.library.register_autograd("fastweights::l2norm_fwd", _l2norm_backward, setup_context=_l2norm_setup, lib=_LIB)


def __getattr__(name: str):
    """An extension function without an entry above: eager calls reach it directly (as before
    this module existed); under ``torch.compile`` it would be opaque, so tracing it is refused."""
    if name.startswith("__"):
        raise AttributeError(name)

    def unregistered(*args):
        if torch.compiler.is_compiling():
            raise RuntimeError(f"fastweights: the CPU kernel `{name}` has no custom op: add an entry for it in "
                               "fastweights/ops/cpu/library.py so torch.compile can call it")
        return _as_outputs(getattr(_extension(), name)(*args))

    return unregistered
