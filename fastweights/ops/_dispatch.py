"""The one dispatcher: every linear/delta op's public function ends in :func:`run`.

The descent of a call (docs/design.md, "The path of a call"): the public function maps fla's
options to plain inputs and passes its :class:`~._spec.OpSpec`; :func:`run` resolves
``chunk_size`` (:func:`~._chunk.resolve_chunk_size`, the one place) and the backend
(:func:`choose_backend`), then calls the Triton front end, or :func:`~._frontend.run_op` with the
spec's PyTorch or compiled-CPU solver. The PyTorch chunk form and the Triton kernels are peers;
this module is the only one that reaches both (the Triton one imported only when it is chosen).
"""

from __future__ import annotations

import torch

from ._backend import BACKENDS, select_backend
from ._chunk import resolve_chunk_size
from ._spec import Form, OpSpec

__all__ = ["run", "choose_backend"]

#: Options of the chunk ops that only the PyTorch chunk form runs (docs/serving.md): ``auto`` picks it for them.
SERVING_OPTIONS = ("return_intermediate_states", "state_block_size", "state_indices", "has_initial_state")


def choose_backend(spec: OpSpec, backend: str, q, v, *, chunk_size, feature_map=None, pytorch_only: bool = False) -> str:
    """``"torch"``, ``"cpu"`` or ``"triton"`` for one call of ``spec``'s op.

    ``auto``: Triton where :func:`~._backend.select_backend` takes it (CUDA tensors the kernels
    fit), the compiled CPU kernels on the CPU where the op has them, PyTorch otherwise.
    ``torch``: the PyTorch code, on every device. ``cpu`` and ``triton`` insist, and say why when
    they cannot. ``pytorch_only``: the call has options only the PyTorch code runs (serving,
    context parallelism), so ``triton`` is refused and ``auto`` does not take it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{spec.name}: unknown `backend` {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    if backend != "auto" and backend not in spec.backends():
        raise ValueError(f"{spec.name}: `backend`={backend!r} is not one this op runs; expected one of "
                         f"{', '.join(map(repr, ('auto',) + spec.backends()))}")
    on_cpu = isinstance(q, torch.Tensor) and q.device.type == "cpu"
    if backend == "cpu" and not on_cpu:
        where = q.device if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"{spec.name}: backend='cpu' runs the compiled CPU kernels on CPU tensors, got `q` on {where}; "
                         f"use backend='auto' or 'torch'")
    if backend in ("torch", "cpu"):
        return backend
    if spec.triton and not (pytorch_only and backend == "auto"):
        if select_backend(spec.name, backend, q, v, chunk_size=chunk_size, feature_map=feature_map) == "triton":
            return "triton"
    return "cpu" if spec.cpu is not None and on_cpu else "torch"


def run(spec: OpSpec, q, k, v, *, backend: str = "auto", chunk_size=None, feature_map=None, cp_group=None, **kwargs):
    """Run ``spec``'s op on its chosen backend; returns what the op returns (``(o, h_T or None)``,
    with a third item when intermediate states are asked for). ``chunk_size`` belongs to the chunk
    forms only (resolved here, :func:`~._chunk.resolve_chunk_size`); the other forms have none.

    ``kwargs`` are :func:`~._frontend.run_op`'s arguments; the Triton front end takes those of
    them it runs (it packs varlen batches natively and refuses the serving options).
    """
    if spec.form is Form.CHUNK:
        shaped = isinstance(q, torch.Tensor) and q.dim() == 4
        chunk_size = resolve_chunk_size(chunk_size, q.shape[-1] if shaped else None, q.device if shaped else None, backend)
    elif chunk_size is not None:
        raise TypeError(f"{spec.name}: only a chunk form takes `chunk_size`, got {chunk_size!r}")
    pytorch_only = cp_group is not None or any(kwargs.get(name) is not None and kwargs.get(name) is not False
                                               for name in SERVING_OPTIONS)
    if pytorch_only and backend == "triton":
        why = ("the serving options (" + ", ".join(SERVING_OPTIONS) + ")" if cp_group is None
               else "`cp_group` (context parallelism runs the PyTorch chunk form)")
        raise ValueError(f"{spec.name}: `backend`='triton' does not run with {why}; use backend='auto' or 'torch'")
    choice = choose_backend(spec, backend, q, v, chunk_size=chunk_size, feature_map=feature_map,
                            pytorch_only=pytorch_only)
    if choice == "triton":
        from .precision import autocast_off
        from .triton.chunk import chunk_op_triton

        triton_kwargs = {name: kwargs[name] for name in ("beta", "g", "scale", "initial_state", "output_final_state",
                                                         "cu_seqlens", "qk_norm", "requires_g", "allow_neg_eigval")
                         if name in kwargs}
        with autocast_off(q.device):  # under torch.autocast the kernels' PyTorch glue stays fp32 too
            return chunk_op_triton(spec.name, q, k, v, chunk_size=chunk_size, feature_map=feature_map, **triton_kwargs)
    from ._frontend import run_op

    return run_op(spec, choice, q, k, v, chunk_size=chunk_size, feature_map=feature_map, cp_group=cp_group, **kwargs)
