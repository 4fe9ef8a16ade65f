"""How a training step is spread over processes: data parallelism, FSDP2, context parallelism.

``torchrun --nproc_per_node=P`` starts P processes (the world). They form a grid of
``dp × cp`` ranks, ``cp`` = ``--context-parallel`` (1: off) and ``dp = P / cp``:

- rank ``r`` is data-parallel rank ``r // cp`` and context-parallel rank ``r % cp``, so
  the ``cp`` ranks of one context-parallel group are neighbours (on one machine, first);
- every rank draws the same global batch of step s; data-parallel rank d keeps rows
  ``[d·B/dp, (d+1)·B/dp)``; within its group, context-parallel rank c keeps the
  contiguous slice ``[c·T/cp, (c+1)·T/cp)`` of every one of those rows (the token
  positions stay global: the group's ops pass the state from slice to slice);
- the loss is the sum of token losses over the whole world divided by the global
  number of target tokens, and every parameter's gradient is summed over all P ranks
  (data-parallel ranks saw other rows; context-parallel ranks other tokens of the same
  rows): one step equals the single-process step on the whole batch.

With ``--fsdp`` (:func:`shard_model`) each block and then the root is wrapped in
``torch.distributed.fsdp.fully_shard`` over all P ranks: parameters, gradients and
optimizer moments are sharded over the world (dim 0), gathered for each block's
forward and backward, and the gradients reduce-scattered as sums (the division FSDP
does by default is switched off, since the loss is already normalized globally).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import check_int

__all__ = ["ParallelPlan", "init_single_process_group", "mixed_precision_policy", "plan_parallel", "shard_model"]


@dataclass
class ParallelPlan:
    """Where this process sits in the ``dp × cp`` grid (see the module docstring).

    ``cp_group``: the process group of this rank's context-parallel group (``None`` when
    ``cp == 1``); ``mesh``: a one-dimensional ``DeviceMesh`` over the world (FSDP shards
    over it; ``None`` unless ``fsdp``).
    """

    rank: int
    world: int
    dp: int
    cp: int
    fsdp: bool = False
    cp_group: dist.ProcessGroup | None = None
    mesh: object | None = None

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    def rows(self, batch_size: int) -> slice:
        """The rows of the global batch this rank's data-parallel group keeps."""
        per = batch_size // self.dp
        return slice(self.dp_rank * per, (self.dp_rank + 1) * per)

    def columns(self, seq_len: int) -> slice:
        """The contiguous token slice this rank keeps of each row (all of it without CP)."""
        per = seq_len // self.cp
        return slice(self.cp_rank * per, (self.cp_rank + 1) * per)

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs, targets (B, T)`` of the global batch -> this rank's ``(B/dp, T/cp)`` piece."""
        rows, cols = self.rows(inputs.shape[0]), self.columns(inputs.shape[1])
        return inputs[rows, cols], targets[rows, cols]

    def check_batch(self, batch_size: int, seq_len: int) -> None:
        """The global batch must split evenly: ``batch_size`` over dp, ``seq_len`` over cp (the same on every rank)."""
        if batch_size % self.dp:
            groups = (f"the number of processes ({self.world})" if self.cp == 1 else
                      f"the number of data-parallel groups ({self.dp} = {self.world} processes / --context-parallel {self.cp})")
            raise ValueError(f"train: `batch_size`={batch_size} must be divisible by {groups}")
        if seq_len % self.cp:
            raise ValueError(f"train: the sequences have {seq_len} tokens, which --context-parallel {self.cp} cannot "
                             f"split into equal contiguous slices; choose a --context-parallel that divides {seq_len}")


def plan_parallel(rank: int, world: int, context_parallel: int = 1, fsdp: bool = False,
                  device_type: str = "cpu") -> ParallelPlan:
    """The grid of ``world`` processes for ``--context-parallel`` and ``--fsdp``.

    Checks first, with no collective (so every rank raises the same error, and none waits):
    ``context_parallel`` must divide ``world``. Then (P > 1) makes the context-parallel groups
    (``dist.new_group`` is a collective over the world: every rank calls it for every group)
    and, for FSDP, the device mesh over ``device_type`` (where the model lives: the training loop
    keeps it on the CPU).
    """
    check_int("train", "context_parallel", context_parallel, what="an int >= 1 (--context-parallel)")
    if world % context_parallel:
        raise ValueError(f"train: --context-parallel {context_parallel} does not divide the number of processes "
                         f"({world}); the data-parallel size is processes / --context-parallel, so use a divisor "
                         f"of {world}")
    plan = ParallelPlan(rank, world, world // context_parallel, context_parallel, fsdp)
    if context_parallel > 1:
        for start in range(0, world, context_parallel):  # every rank makes every group, in the same order
            group = dist.new_group(list(range(start, start + context_parallel)))
            if start <= rank < start + context_parallel:
                plan.cp_group = group
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        plan.mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
    return plan


def mixed_precision_policy(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for ``--precision``: bf16 gathers bf16 parameters for the
    forward and backward and reduces the gradients in fp32 (the sharded weights and the optimizer
    stay fp32); fp32 changes nothing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp32":
        return MixedPrecisionPolicy()
    raise ValueError(f"train: `precision`={precision!r} (--precision) is not supported with --fsdp; use fp32 or bf16")


def shard_model(model: torch.nn.Module, plan: ParallelPlan, precision: str = "fp32") -> torch.nn.Module:
    """Wrap every block of ``model`` (an :class:`~fastweights.models.LM`), then the root, in
    FSDP2's ``fully_shard`` over ``plan.mesh``; the gradients are reduced as sums. In place;
    returns ``model``. The root unit holds the embedding, the final norm and the (tied) output
    projection."""
    import warnings

    from torch.distributed.fsdp import FSDPModule, fully_shard

    # The blocks return their decode state too; its short-convolution tail is a view of the block's
    # input. Nothing changes it in place (training discards it), which is what this warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    policy = mixed_precision_policy(precision)
    for block in model.blocks:
        fully_shard(block, mesh=plan.mesh, mp_policy=policy)
    fully_shard(model, mesh=plan.mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sums: the loss is normalized by the global token count
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def init_single_process_group(timeout: float) -> bool:
    """A gloo process group of this one process (FSDP and DCP need one even then); True once made."""
    import datetime

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout))
    return True
