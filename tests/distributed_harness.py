"""Run a function on N local processes joined in a gloo process group (for the distributed tests).

``run_ranks(fn, world, *args)`` starts ``world`` fresh processes, joins them in
one gloo group through a file store (no port to pick), calls ``fn(rank, world, *args)``
on each, and returns the list of what each returned, in rank order. A process that
raises sends its traceback back, and the call raises it in the test; a process that
does not finish within ``timeout`` seconds is killed and the call fails, so a
distributed bug costs a failed test, never a hung suite. Collectives themselves time
out after ``timeout`` seconds as well.

The processes come from a fork server that has imported torch and fastweights once
(importing torch costs seconds per process on a busy machine); the server itself runs
no tensor code, so forking it is safe for OpenMP.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp


def _child(fn: Callable, rank: int, world: int, store: str, timeout: float, results, args) -> None:
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # every failure goes back to the test
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args, timeout: float = 120.0) -> List[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each on its own process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fastweights.ops", "fastweights.models"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world, store, timeout, results, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        out, errors = {}, []
        try:
            for _ in range(world):
                rank, status, value = results.get(timeout=timeout + 60)
                if status == "ok":
                    out[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
        except queue.Empty:
            errors.append(f"no result within {timeout + 60:.0f} s from ranks {sorted(set(range(world)) - set(out))}")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]
