"""Run a chunk delta op on the implementation ``_backend.select_backend`` picks.

The PyTorch chunk form and the Triton kernels are peers; this module is the only one
that reaches both (the Triton one imported only when it is chosen).
"""

from __future__ import annotations

from ._backend import BACKENDS, CHUNK_SIZE, select_backend
from ._chunk import resolve_chunk_size

__all__ = ["run_chunk_delta"]

#: Options of the chunk ops that only the PyTorch chunk form runs (docs/serving.md): ``auto`` picks it for them.
SERVING_OPTIONS = ("return_intermediate_states", "state_block_size", "state_indices", "has_initial_state")


def run_chunk_delta(op: str, torch_solver, q, k, v, *, backend: str = "auto", torch_kwargs=None, **kwargs):
    """Run chunk delta op ``op`` on the backend :func:`select_backend` picks; returns ``(o, h_T)``.

    ``torch_solver`` is the PyTorch chunk form's solver (``run_op``'s core), passed in by
    the public op so that this module imports neither implementation at load time;
    ``kwargs`` are the op's arguments as both paths take them, ``torch_kwargs`` those
    only ``run_op`` takes (the Triton path packs varlen batches natively).
    """
    if kwargs.get("chunk_size") is None and backend == "triton":
        kwargs["chunk_size"] = CHUNK_SIZE  # the kernels' one length (what the policy gives on CUDA, too)
    kwargs["chunk_size"] = resolve_chunk_size(kwargs.get("chunk_size"), q)
    serving = any((torch_kwargs or {}).get(name) is not None and (torch_kwargs or {}).get(name) is not False
                  for name in SERVING_OPTIONS)
    if serving and backend == "triton":
        raise ValueError(f"{op}: `backend`='triton' does not take the serving options ({', '.join(SERVING_OPTIONS)}); "
                         f"use backend='auto' or 'torch'")
    if serving or (torch_kwargs or {}).get("cp_group") is not None:  # context parallelism runs the PyTorch chunk form
        if backend == "triton":
            raise ValueError(f"{op}: `backend`='triton' does not run with `cp_group` (context parallelism runs "
                             f"the PyTorch chunk form); use backend='auto' or 'torch'")
        choice = "torch" if backend in BACKENDS else select_backend(op, backend, q, v)
    else:
        choice = select_backend(op, backend, q, v, chunk_size=kwargs["chunk_size"],
                                feature_map=kwargs.get("feature_map"))
    if choice == "triton":
        from ._frontend import autocast_off
        from .triton.chunk import chunk_op_triton

        with autocast_off(q.device):  # under torch.autocast the kernels' PyTorch glue stays fp32 too
            return chunk_op_triton(op, q, k, v, **kwargs)
    from ._frontend import run_op

    return run_op(op, torch_solver, q, k, v, **kwargs, **(torch_kwargs or {}), requires_beta=True)
