"""FSDP2 training (``train --fsdp``) on the CPU with gloo: the same steps as one process, sharded
checkpoints through DCP that resume bitwise on the same world size and on another one, export to one
file, and a killed or stopped rank ending the job within the deadline without losing what was saved.

Every rank is started as torchrun starts one (``spawn_ranks``), with a timeout: nothing here can hang. The
default run keeps two 2-rank launches (FSDP and context parallelism together); ``-m slow`` adds FSDP alone on
4 ranks, bf16, and the failures.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from fastweights.cli import main as cli_main

from spawn_ranks import losses, rewind, spawn, stop_all, text_args, torchrun, write_words

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--threads", "1", "--recall-keys", "8",
        "--recall-values", "8", "--recall-pairs", "8", "--recall-active-keys", "4", "--recall-queries", "2",
        "--eval-every", "0", "--progress", "off", "--batch-size", "8"]


def final_weights(path):
    from fastweights.io.checkpoint import load_model

    model, _ = load_model(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The default run's one 2-rank job: FSDP over both ranks, which also form one context-parallel group
    (each sequence split in two), a hybrid DeltaNet + softmax LM on text, float64: 6 steps, a sharded
    checkpoint every 3 (both kept)."""
    folder = tmp_path_factory.mktemp("fsdp")
    out = folder / "run"
    args = ["train", "--fsdp", "--context-parallel", "2", "--dtype", "float64", "--steps", "6", "--save-every", "3",
            "--keep-checkpoints", "2", *text_args(write_words(folder / "words.txt")), "--out", str(out)]
    done = torchrun(2, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, args


def one_process(args):
    """The same run's arguments for one process: no FSDP, no context parallelism."""
    drop = {"--fsdp": 1, "--context-parallel": 2}
    kept, i = [], 0
    while i < len(args):
        skip = drop.get(args[i], 0)
        kept += [] if skip else [args[i]]
        i += skip or 1
    return kept


def test_fsdp_equals_one_process_and_exports_one_file(fsdp_run, tmp_path):
    out, args = fsdp_run
    one = tmp_path / "one"
    assert cli_main(one_process(args)[:-1] + [str(one)]) == 0
    a, b = losses(one), losses(out)
    diff = max(abs(x[1] - y[1]) for x, y in zip(a, b))
    print(f"FSDP and context parallelism on 2 ranks vs one process, float64, 6 steps: max |loss difference| "
          f"{diff:.2e}; losses {a[0][1]:.4f} -> {a[-1][1]:.4f}")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 7))
    assert diff <= 1e-10 and a[0][1] != a[-1][1]
    assert sorted(n for n in os.listdir(out / "ckpt-000006") if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    model_file = tmp_path / "model.safetensors"
    assert cli_main(["export", str(out), "--out", str(model_file)]) == 0
    sharded, single = final_weights(model_file), final_weights(one)
    worst = max(float((sharded[k] - single[k]).abs().max()) for k in single)
    print(f"exported FSDP weights vs the one-process run's: max |difference| {worst:.2e}")
    assert sharded.keys() == single.keys() and worst <= 1e-10
    assert cli_main(["generate", str(model_file), "--prompt", "the ", "--max-new-tokens", "3"]) == 0


def test_fsdp_resume_is_bitwise_and_reshards_to_one_process(fsdp_run, tmp_path):
    out, args = fsdp_run
    same = rewind(out, tmp_path / "same", 3)
    done = torchrun(2, *args[:-1], str(same), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(same) == losses(out)  # bit for bit: the same shards, the same sums

    other = rewind(out, tmp_path / "other", 3)  # 2 ranks wrote it; one process resumes it (DCP reshards)
    assert cli_main([*args[:-1], str(other), "--resume", "--context-parallel", "1"]) == 0
    diff = max(abs(x[1] - y[1]) for x, y in zip(losses(other), losses(out)))
    print(f"resumed 2 ranks -> 1 process: max |loss difference| {diff:.2e} (the sums' order changed)")
    assert [s for s, _ in losses(other)] == list(range(1, 7)) and diff <= 1e-10


def test_a_sharded_checkpoint_is_checked_before_it_is_read(fsdp_run, tmp_path, capsys):
    out, args = fsdp_run
    run = rewind(out, tmp_path / "run", 6)
    shard = run / "ckpt-000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", str(run), "--out", str(tmp_path / "m.safetensors")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "checkpoint file __1_0.distcp fails its SHA-256 check" in err, err
    assert not (tmp_path / "m.safetensors").exists()


def test_an_exported_file_is_checked_when_loaded(fsdp_run, tmp_path, capsys):
    """The single file carries a SHA-256 of its tensors: a flipped bit is refused naming the file; `--out`
    must name a .safetensors file."""
    from fastweights.io.checkpoint import load_checkpoint
    from fastweights.io.errors import CheckpointError

    out, _ = fsdp_run
    model_file = tmp_path / "model.safetensors"
    assert cli_main(["export", str(out / "ckpt-000003"), "--out", str(model_file)]) == 0
    assert load_checkpoint(model_file).train["step"] == 3
    data = bytearray(model_file.read_bytes())
    data[-7] ^= 0x04  # inside the last tensor's bytes
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="the tensors fail their SHA-256 check"):
        load_checkpoint(model_file)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", str(out), "--out", str(tmp_path / "model.bin")])
    assert exit_info.value.code == 2 and "`--out` must name a .safetensors file" in capsys.readouterr().err


def test_dcp_metadata_is_read_without_running_code(fsdp_run, tmp_path):
    """DCP's .metadata is a pickle: an object outside DCP's metadata classes is refused, not built."""
    import pickle

    from fastweights.io.dcp_checkpoint import _read_metadata
    from fastweights.io.errors import CheckpointError

    out, _ = fsdp_run
    _read_metadata(str(out / "ckpt-000006" / ".metadata"))  # the real one reads

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    bad = tmp_path / ".metadata"
    bad.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="posix.system is not part of DCP's checkpoint metadata"):
        _read_metadata(str(bad))
    assert not (tmp_path / "pwned").exists()


def test_context_parallel_must_divide_the_world():
    from fastweights.training.parallel import plan_parallel

    with pytest.raises(ValueError, match=r"--context-parallel 3 does not divide the number of processes \(4\)"):
        plan_parallel(0, 4, 3)
    with pytest.raises(ValueError, match=r"`context_parallel` must be an int >= 1 \(--context-parallel\), got 0"):
        plan_parallel(0, 4, 0)
    plan = plan_parallel(0, 1, 1)
    assert (plan.dp, plan.cp) == (1, 1)


def test_the_grid_splits_rows_over_dp_and_tokens_over_cp():
    from fastweights.training.parallel import ParallelPlan

    inputs = torch.arange(4 * 8).view(4, 8)
    pieces = {}
    for rank in range(4):  # 2 data-parallel groups of 2 context-parallel ranks
        plan = ParallelPlan(rank, 4, dp=2, cp=2)
        pieces[rank] = plan.local_batch(inputs, inputs)[0]
    assert torch.equal(torch.cat([torch.cat([pieces[0], pieces[1]], 1), torch.cat([pieces[2], pieces[3]], 1)]), inputs)
    with pytest.raises(ValueError, match="--context-parallel 2 cannot split"):
        ParallelPlan(0, 4, dp=2, cp=2).check_batch(4, 7)


# -- 4 ranks, failures (slow) ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_four_ranks_fp32_match_one_process_and_resume_on_two(tmp_path):
    out = tmp_path / "four"
    args = ["train", "--fsdp", "--steps", "6", "--save-every", "3", "--keep-checkpoints", "2", *TINY]
    done = torchrun(4, *args, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    one = tmp_path / "one"
    assert cli_main([a for a in args if a != "--fsdp"] + ["--out", str(one)]) == 0
    a, b = losses(one), losses(out)
    rel = max(abs(x[1] - y[1]) / abs(x[1]) for x, y in zip(a, b))
    print(f"FSDP on 4 ranks vs one process, float32: max relative loss difference {rel:.2e}")
    assert rel <= 1e-5

    same = rewind(out, tmp_path / "same", 3)
    assert torchrun(4, *args, "--out", str(same), "--resume").returncode == 0
    assert losses(same) == losses(out)
    two = rewind(out, tmp_path / "two", 3)
    done = torchrun(2, *args, "--out", str(two), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    rel = max(abs(x[1] - y[1]) / abs(x[1]) for x, y in zip(losses(two), losses(out)))
    print(f"resumed 4 ranks -> 2: max relative loss difference {rel:.2e}")
    assert rel <= 1e-5


@pytest.mark.slow
def test_fsdp_bf16_trains(tmp_path):
    args = ["train", "--fsdp", "--precision", "bf16", "--steps", "30", "--save-every", "0", *TINY, "--lr", "1e-2"]
    done = torchrun(2, *args, "--out", str(tmp_path / "bf16"))
    assert done.returncode == 0, done.stderr[-3000:]
    fp32 = tmp_path / "fp32"
    assert cli_main([{"bf16": "fp32"}.get(a, a) for a in args if a != "--fsdp"] + ["--out", str(fp32)]) == 0
    a, b = losses(fp32), losses(tmp_path / "bf16")
    print(f"bf16 FSDP vs fp32 one process: first loss {b[0][1]:.4f} vs {a[0][1]:.4f}, last {b[-1][1]:.4f} vs {a[-1][1]:.4f}")
    assert abs(a[0][1] - b[0][1]) < 0.02 and b[-1][1] < b[0][1]


def _wait_for(predicate, procs, timeout=180, what="a condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert all(p.poll() is None for p in procs), f"a rank ended before {what}"
        assert time.time() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_lost_rank_ends_the_job_and_keeps_the_checkpoints(tmp_path, fault):
    """One of 4 FSDP ranks is killed (or stopped) after the second checkpoint: every other rank exits with
    the one-line error within the deadline (--ddp-timeout 6), the checkpoints written before load, and a
    resume ends on the uninterrupted run's losses."""
    out = tmp_path / "run"
    args = ["train", "--fsdp", "--steps", "400", "--save-every", "2", "--keep-checkpoints", "2", "--ddp-timeout", "6",
            *TINY, "--out", str(out)]
    procs = spawn(4, *args)
    try:
        _wait_for(lambda: (out / "latest").exists() and (out / "latest").read_text().strip() >= "ckpt-000004", procs,
                  what="the second checkpoint")
        victim = procs[2]
        victim.send_signal(getattr(signal, fault))
        hit = time.time()
        results = [(p.communicate(timeout=120), p.returncode) for p in (procs[0], procs[1], procs[3])]
        took = time.time() - hit
        for (_, err), code in results:
            print(f"exit {code} after {took:.1f} s: {err.strip().splitlines()[-1] if err.strip() else ''}")
            assert code == 1 and "Traceback" not in err, err[-2000:]
            assert "rank 2" in err and "--ddp-timeout" in err, err[-2000:]
        assert took < 6 + 60
    finally:
        stop_all(procs)
    from fastweights.io.checkpoint import load_checkpoint

    saved = [n for n in os.listdir(out) if n.startswith("ckpt-") and ".tmp" not in n]
    for name in saved:
        load_checkpoint(out / name)  # every checkpoint written before the fault verifies
    step = int((out / "latest").read_text().strip().split("-")[1])
    assert step >= 4
    resumed = torchrun(4, *args[:3], str(step + 2), *args[4:], "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [s for s, _ in losses(out)] == list(range(1, step + 3))


def test_a_failure_names_the_rank_whose_pulse_stopped_not_those_that_gave_up():
    """Rank 2 of 4 is killed: rank 1 fails fast (its connection to rank 2 was reset) and gives up; rank 0
    then times out. Rank 0 names rank 2 (no pulse, never gave up), not rank 1 (which only gave up)."""
    from fastweights.training.distributed import Heartbeat

    class Store(dict):
        def set(self, key, value):
            self[key] = value.encode()

        def check(self, keys):
            return all(k in self for k in keys)

        def get(self, key):
            return self[key]

    store, now = Store(), time.time()
    beats = [Heartbeat(r, 4, interval=60.0, log=lambda _: None, pulse=0.05) for r in range(4)]
    for hb in beats:
        hb.store = store
        hb.beat(4)
        store.set(Heartbeat.ALIVE.format(hb.rank), str(now))
    store.set(Heartbeat.ALIVE.format(0), str(now + 1.0))  # rank 0 and 3 are still pulsing
    store.set(Heartbeat.ALIVE.format(3), str(now + 1.0))
    store.set(Heartbeat.GAVE_UP.format(1), str(now))  # rank 1 exited for rank 2's sake
    time.sleep(0.3)  # more than 5 pulses: rank 1's and 2's pulses are stale
    store.set(Heartbeat.ALIVE.format(3), str(time.time()))
    error = str(beats[0].failure("the forward pass", RuntimeError("Timed out waiting 6000ms for recv operation")))
    print(error)
    named = error.split("waiting for ")[1].split("; the job")[0]
    assert "rank 2 (silent for" in named and "killed or stopped" in named
    assert "rank 1" not in named and "rank 3" not in named


@pytest.mark.slow
def test_sigkill_of_the_whole_job_at_random_moments_resumes_bitwise(tmp_path):
    """Both ranks of an FSDP job SIGKILLed at random moments (a checkpoint every step, so most kills land
    in or near a sharded save), resumed each time: every checkpoint folder left loads, and the finished run's
    losses equal the uninterrupted run's bit for bit."""
    import random

    from fastweights.io.checkpoint import load_checkpoint

    args = ["train", "--fsdp", "--steps", "12", "--save-every", "1", "--keep-checkpoints", "2", *TINY]
    whole = torchrun(2, *args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    out, rng = tmp_path / "killed", random.Random(0)
    for _ in range(3):
        procs = spawn(2, *args, "--out", str(out), *(["--resume"] if (out / "latest").exists() else []))
        try:
            deadline = time.time() + 180
            while not (out / "latest").exists() and time.time() < deadline and all(p.poll() is None for p in procs):
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.5))
        finally:
            for p in procs:
                p.kill()
            stop_all(procs)
        for name in os.listdir(out):  # after every kill: whole checkpoints only
            if name.startswith("ckpt-") and ".tmp" not in name:
                load_checkpoint(out / name)
    done = torchrun(2, *args, "--out", str(out), *(["--resume"] if (out / "latest").exists() else ["--overwrite"]))
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(out) == losses(tmp_path / "whole")
    assert not [n for n in os.listdir(out) if ".tmp" in n or n == "lock"]
