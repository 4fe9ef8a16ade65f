"""A pool of recurrent states addressed by slot indices, as serving engines keep them.

An inference server holds one preallocated pool ``[S, H, K, V]`` of states, one slot per
live session, and runs a batch of N sequences (a prefill with ``cu_seqlens``, or one decode
token each) whose sessions sit anywhere in it. ``state_indices [N]`` says which slot each
sequence reads its initial state from and writes its final state back to, in place; vLLM
and SGLang call their linear-attention kernels this way. The chunk ops and the one-token
steps take it as::

    o, h = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, state_indices=idx,
                                  has_initial_state=mask, cu_seqlens=cu)
    o, _ = gated_delta_rule_step(q, k, v, beta, g, pool, state_indices=idx)

Per sequence i:

- ``state_indices[i] = s >= 0`` and ``has_initial_state[i]`` True (or no mask): start from
  ``pool[s]``, write the final state into ``pool[s]``;
- ``has_initial_state[i]`` False: a fresh session, start from zeros, write into ``pool[s]``;
- ``state_indices[i] = -1``: start from zeros and write nothing (vLLM's padding slot).

Everything is checked before the pool is touched: an index that is not an int32/int64
tensor of shape [N], one outside [-1, S), or a slot named twice (two sequences writing one
state) is a ``ValueError``/``TypeError`` naming ``state_indices``, and the pool is unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["check_state_indices", "gather_states", "scatter_states"]


def check_state_indices(op: str, pool, state_indices, n: int, has_initial_state=None,
                        pool_name: str = "initial_state") -> None:
    """Refuse a malformed pool, slot index or mask (module docstring); reads the indices (one host sync).

    ``pool`` must be ``[S, H, K, V]``, ``state_indices`` an int32/int64 ``[n]`` tensor of slots
    in ``[-1, S)`` with no slot twice, ``has_initial_state`` None or a bool ``[n]`` tensor.
    """
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
        got = f"shape {list(pool.shape)}" if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(f"{op}: with `state_indices`, `{pool_name}` must be the state pool [S, H, K, V], got {got}")
    if not isinstance(state_indices, torch.Tensor):
        raise TypeError(f"{op}: `state_indices` must be an int32/int64 tensor [N]=[{n}], "
                        f"got {type(state_indices).__name__}")
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: `state_indices` must be an int32/int64 tensor [N]=[{n}], got dtype {state_indices.dtype}")
    if tuple(state_indices.shape) != (n,):
        raise ValueError(f"{op}: `state_indices` must have shape [N]=[{n}] (one slot per sequence), "
                         f"got {list(state_indices.shape)}")
    slots = pool.shape[0]
    # As a Python list (one host read): a decode step checks its few hundred slots in a few µs,
    # where tensor comparisons and a sort cost ~10 µs of dispatch each, in every layer.
    host = state_indices.tolist()
    if host and (min(host) < -1 or max(host) >= slots):
        i = next(i for i, s in enumerate(host) if not -1 <= s < slots)
        raise ValueError(f"{op}: `state_indices`[{i}] = {host[i]} is out of range: expected a slot in "
                         f"[0, {slots}) of the pool, or -1 for a sequence without one")
    used = [s for s in host if s >= 0]
    if len(set(used)) != len(used):
        seen = set()
        twice = next(s for s in used if s in seen or seen.add(s))
        raise ValueError(f"{op}: `state_indices` names slot {twice} more than once; each "
                         f"sequence needs its own slot (two would write one state)")
    if has_initial_state is not None:
        if not isinstance(has_initial_state, torch.Tensor) or has_initial_state.dtype != torch.bool:
            what = has_initial_state.dtype if isinstance(has_initial_state, torch.Tensor) else type(has_initial_state).__name__
            raise TypeError(f"{op}: `has_initial_state` must be a bool tensor [N]=[{n}], got {what}")
        if tuple(has_initial_state.shape) != (n,):
            raise ValueError(f"{op}: `has_initial_state` must have shape [N]=[{n}], got {list(has_initial_state.shape)}")


def _reads(state_indices: torch.Tensor, has_initial_state: Optional[torch.Tensor]) -> torch.Tensor:
    """Which sequences start from their slot's state (``[N]`` bool, on the indices' device)."""
    reads = state_indices >= 0
    if has_initial_state is not None:
        reads = reads & has_initial_state.to(reads.device)
    return reads


def gather_states(pool: torch.Tensor, state_indices: torch.Tensor,
                  has_initial_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The initial states ``[N, H, K, V]``: ``pool[state_indices[i]]``, zeros for a fresh sequence.

    A new tensor (the pool is left as it is): the chunk ops' solvers take one state per sequence.
    """
    idx = state_indices.to(pool.device).long()
    h0 = pool[idx.clamp(min=0)]
    reads = _reads(idx, has_initial_state).view(-1, 1, 1, 1)
    return torch.where(reads, h0, torch.zeros((), dtype=pool.dtype, device=pool.device))


def scatter_states(pool: torch.Tensor, state_indices: torch.Tensor, final: torch.Tensor) -> None:
    """Write ``final [N, H, K, V]`` into ``pool[state_indices[i]]`` in place (rows with -1 are skipped)."""
    idx = state_indices.to(pool.device).long()
    keep = idx >= 0
    pool.index_copy_(0, idx[keep], final[keep].to(pool.dtype))
