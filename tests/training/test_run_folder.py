"""A run owns its --out: lock, run ids, pruning by step within the run, refusing a used
folder, damaged train.json, a full disk, SIGINT/SIGTERM, a silent data-parallel rank.

Each group of tests names the failure it covers. In-process runs keep them fast; the
signal and data-parallel tests need real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastweights.io import checkpoint as ckpt_module
from fastweights.training import CheckpointError, load_checkpoint
from fastweights.cli import main as cli_main
from fastweights.models import LMConfig
from fastweights.tasks import make_task
from fastweights.training import RunFolderError, StopSignals, TrainConfig, prune_checkpoints, train

from spawn_ranks import spawn, stop_all

pytestmark = pytest.mark.usefixtures("one_thread")

RECALL = dict(recall_keys=8, recall_values=8, recall_pairs=8, recall_active_keys=4, recall_queries=2)
TINY_MODEL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--threads", "1"]
TINY_RECALL = ["--recall-keys", "8", "--recall-values", "8", "--recall-pairs", "8",
               "--recall-active-keys", "4", "--recall-queries", "2"]
ENV = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1"}


def configs(steps, **kw):
    config = TrainConfig(steps=steps, **{"batch_size": 4, "save_every": 2, "eval_every": 0, "threads": 1, **RECALL, **kw})
    model = LMConfig(vocab_size=make_task(config).vocab_size, d_model=32, n_layers=1, n_heads=2, mixer="deltanet",
                     max_seq_len=64)
    return model, config


def run(out, steps, **kw):
    lines = []
    train_kw = {k: kw.pop(k) for k in ("resume", "overwrite") if k in kw}
    result = train(*configs(steps, **kw), None if out is None else str(out), progress=False, log=lines.append, **train_kw)
    return result, lines


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def checkpoints(out):
    return sorted(d for d in os.listdir(out) if d.startswith("ckpt-"))


def rehash(folder):
    """Recompute a checkpoint's manifest after an edit: a damaged file that is consistent with its
    checksum (as a buggy tool would write it), so the schema check is what must catch it."""
    files = {n: ckpt_module._file_digest(os.path.join(folder, n)) for n in sorted(os.listdir(folder)) if n != "manifest.json"}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"format": ckpt_module.FORMAT, "files": files}, f)


# -- a new run in a used --out ------------------------------------------------------------


def _resume_fails_in_one_line(capsys, out, steps):
    """``fastweights train --resume`` on ``out`` exits 2 with one error line and no traceback; returns it."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--resume", "--out", str(out), "--steps", str(steps), "--progress", "off"])
    err = capsys.readouterr().err
    print(err)
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("fastweights train: error: ") and "Traceback" not in err
    return err


def test_a_new_run_in_a_used_out_is_refused_unless_overwrite(tmp_path, capsys):
    """It used to prune its own ckpt-000004 in favour of the old run's ckpt-000008 and exit 0
    with `latest` naming a missing folder."""
    out = tmp_path / "run"
    run(out, 8, keep_checkpoints=1)
    with pytest.raises(RunFolderError, match=r"holds 1 checkpoint\(s\) of run \w+ \(up to ckpt-000008\); "
                                             r"pass --resume to continue that run or --overwrite to replace it"):
        run(out, 4, keep_checkpoints=1)
    assert checkpoints(out) == ["ckpt-000008"]  # untouched
    with pytest.raises(SystemExit) as exit_info:  # the command line says the same in one line
        cli_main(["train", "--steps", "4", "--batch-size", "4", "--progress", "off", *TINY_MODEL, *TINY_RECALL,
                  "--out", str(out)])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err

    _, lines = run(out, 4, keep_checkpoints=1, overwrite=True)
    print(lines)
    assert checkpoints(out) == ["ckpt-000004"] and (out / "latest").read_text().strip() == "ckpt-000004"
    ckpt = load_checkpoint(out)
    assert ckpt.train["step"] == 4 and [s for s, _ in losses(out)] == [1, 2, 3, 4]
    assert "--overwrite: removed the previous run's 1 checkpoint(s)" in lines[0]


def test_pruning_is_by_step_within_the_run(tmp_path):
    """Names sort ckpt-1000000 before ckpt-999999; another run's folders are not this run's to prune."""
    def fake(name, run_id):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.json").write_text(json.dumps({"run_id": run_id}))

    for name in ("ckpt-999998", "ckpt-999999", "ckpt-1000000"):
        fake(name, "mine")
    fake("ckpt-2000000", "other")
    prune_checkpoints(str(tmp_path), "mine", keep=2, latest=str(tmp_path / "ckpt-1000000"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1000000", "ckpt-2000000", "ckpt-999999"]
    prune_checkpoints(str(tmp_path), "mine", keep=1, latest=str(tmp_path / "ckpt-999999"))  # never `latest`
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1000000", "ckpt-2000000", "ckpt-999999"]


def test_every_checkpoint_carries_the_run_id_and_a_resume_keeps_it(tmp_path):
    out = tmp_path / "run"
    run(out, 4, keep_checkpoints=5)
    ids = {json.loads((out / c / "train.json").read_text())["run_id"] for c in checkpoints(out)}
    run(out, 6, keep_checkpoints=5, resume=True)
    ids_after = {json.loads((out / c / "train.json").read_text())["run_id"] for c in checkpoints(out)}
    assert len(ids) == 1 and ids_after == ids and checkpoints(out) == ["ckpt-000002", "ckpt-000004", "ckpt-000006"]


# -- two trainers on one --out ------------------------------------------------------------


def start_cli(out, *extra, steps=100000):
    args = ["train", "--steps", str(steps), "--save-every", "5", "--eval-every", "0", "--batch-size", "4",
            "--progress", "off", *TINY_MODEL, *TINY_RECALL, "--out", str(out), *extra]
    return subprocess.Popen([sys.executable, "-m", "fastweights.cli", *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc=None, timeout=120, what="the condition"):
    deadline = time.time() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended before {what}: {proc.stderr.read()[-2000:]}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_two_trainers_on_one_out_are_locked_out(tmp_path):
    """Metrics used to interleave and checkpoints vanish; now the second trainer is refused, naming
    the first; after the first is SIGKILLed its lock is stale (by pid) and is taken over."""
    out = tmp_path / "run"
    first = start_cli(out)
    try:
        wait_for(lambda: (out / "latest").exists(), first, what="the first checkpoint")
        for resume in (False, True):
            with pytest.raises(RunFolderError, match=rf"is in use by another trainer \(pid {first.pid} on "):
                run(out, 3, resume=resume)
    finally:
        first.kill()
        first.wait()
    assert json.loads((out / "lock").read_text())["pid"] == first.pid  # left behind by the kill
    _, lines = run(out, 12, save_every=5, batch_size=4, resume=True)
    print(lines)
    assert any(f"took over the stale lock of pid {first.pid}" in line and "no longer running" in line for line in lines)
    assert not (out / "lock").exists(), "the lock is released when the run ends"


def test_the_lock_is_released_when_a_run_fails(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError):
        train(*configs(2, **{"data": str(tmp_path / "missing.txt")}), str(out), progress=False)
    assert not (out / "lock").exists()


# -- a kill while pruning ------------------------------------------------------------------


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after it runs (not even `except Exception`)."""


def test_a_kill_while_pruning_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """Deleting a pruned checkpoint in place left a half-deleted ckpt folder when killed midway."""
    out = tmp_path / "run"
    real = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        victim = os.path.join(path, "model.safetensors")
        if os.path.exists(victim):  # a checkpoint being deleted: lose one file, then die
            os.remove(victim)
            raise Killed()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(Killed):
        run(out, 8, keep_checkpoints=1)
    monkeypatch.setattr(shutil, "rmtree", real)
    for name in checkpoints(out):
        if ".tmp-" not in name:
            load_checkpoint(out / name)  # every folder under a checkpoint's name is whole
    assert load_checkpoint(out).train["step"] == 4
    _, lines = run(out, 8, keep_checkpoints=1, resume=True)
    assert any("removed 1 temp file(s)" in line for line in lines), lines
    assert checkpoints(out) == ["ckpt-000008"]
    run(tmp_path / "whole", 8, keep_checkpoints=1)
    assert losses(out) == losses(tmp_path / "whole")


def test_stray_temp_folders_are_cleaned_at_start(tmp_path):
    out = tmp_path / "run"
    run(out, 2)
    (out / "ckpt-000004.tmp-99999").mkdir()
    (out / "ckpt-000004.tmp-99999" / "model.safetensors").write_bytes(b"half")
    (out / "latest.abcd.tmp").write_text("ckpt-000004")
    _, lines = run(out, 4, resume=True)
    assert sorted(os.listdir(out)) == ["ckpt-000002", "ckpt-000004", "latest", "metrics.jsonl"]
    assert "removed 2 temp file(s)" in lines[0]


# -- a damaged but valid train.json ----------------------------------------------------------


@pytest.mark.parametrize("damage,message", [
    ("list", r"train.json: expected a JSON object, got list \[\]"),
    ("no-history", r"train.json: `history` is missing \(expected a list\)"),
    ("step-string", r"train.json: `step` must be an int >= 0, got \"4\""),
    ("step-999", r"train.json: `step`=999 does not match the history, which ends at step 4"),
    ("history-short", r"train.json: `step`=4 does not match the history, which ends at step 3"),
    ("loss-string", r"train.json: `history\[1\]` must be \{\"step\": 2, \"loss\": <number>, ...\}"),
], ids=lambda x: x if not x.startswith("train") else "")
def test_damaged_train_json_is_refused_in_one_line(tmp_path, capsys, damage, message):
    out = tmp_path / "run"
    cli_main(["train", "--steps", "4", "--save-every", "4", "--batch-size", "4", "--progress", "off",
              *TINY_MODEL, *TINY_RECALL, "--out", str(out)])
    file = out / "ckpt-000004" / "train.json"
    state = json.loads(file.read_text())
    if damage == "list":
        state = []
    elif damage == "no-history":
        del state["history"]
    elif damage == "step-string":
        state["step"] = "4"
    elif damage == "step-999":
        state["step"] = 999
    elif damage == "history-short":
        state["history"] = state["history"][:3]
    else:
        state["history"][1]["loss"] = "0.5"
    file.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="fails its SHA-256 check"):  # the checksum sees the edit first
        load_checkpoint(out)
    rehash(out / "ckpt-000004")
    err = _resume_fails_in_one_line(capsys, out, steps=6)
    assert pytest.importorskip("re").search(message, err)



# -- damaged but checksum-consistent tensors of the training state -----------------------------------


def _edit_safetensors(file, edit):
    import safetensors

    with safetensors.safe_open(str(file), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    edit(tensors)
    safetensors.torch.save_file(tensors, str(file), metadata=metadata)


def _first(tensors, suffix):
    return next(k for k in sorted(tensors) if k.endswith(suffix) and tensors[k].dim() == 2)


TENSOR_DAMAGE = {  # name -> (file, edit, message)
    "rng-short": ("train_state", lambda t: t.update({"rng.torch": t["rng.torch"][:100]}),
                  r"`rng.torch` must be torch's CPU generator state, a torch.uint8 tensor of shape \[\d+\]; got torch.uint8 \[100\]"),
    "rng-float": ("train_state", lambda t: t.update({"rng.torch": t["rng.torch"].float()}), r"got torch.float32"),
    "moment-shape": ("train_state", lambda t: t.update({(k := _first(t, "exp_avg")): t[k][:1]}),
                     r"`optimizer.0.exp_avg` must have its parameter's shape \[17, 32\] and dtype torch.float32, got \[1, 32\]"),
    "moment-dtype": ("train_state", lambda t: t.update({(k := _first(t, "exp_avg")): t[k].double()}), r"got \[17, 32\] torch.float64"),
    "moment-missing": ("train_state", lambda t: t.pop(_first(t, "exp_avg_sq")), r"`optimizer.0.exp_avg_sq` is missing"),
    "moment-nan": ("train_state", lambda t: t[_first(t, "exp_avg")].fill_(float("nan")), r"`optimizer.0.exp_avg` holds 544 non-finite"),
    "unknown-index": ("train_state", lambda t: t.update({"optimizer.99.exp_avg": torch.zeros(3)}),
                      r"`optimizer.99.exp_avg` names no parameter \(the optimizer has 15"),
    "weight-nan": ("model", lambda t: t[sorted(t)[0]].fill_(float("nan")), r"model.safetensors: weight `.*` holds \d+ non-finite"),
}


@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("three") / "run"
    assert cli_main(["train", "--steps", "3", "--save-every", "3", "--batch-size", "4", "--progress", "off",
                     *TINY_MODEL, *TINY_RECALL, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("damage", list(TENSOR_DAMAGE))
def test_damaged_training_tensors_are_refused_in_one_line(tmp_path, capsys, three_step_run, damage):
    """A tensor of the training state edited consistently with the manifest (as a buggy tool would
    write it) used to give a raw traceback deep in the optimizer or torch.set_rng_state, or to be
    taken silently (a moment in float64, a moment of a parameter that does not exist)."""
    out = tmp_path / "run"
    shutil.copytree(three_step_run, out)
    file, edit, message = TENSOR_DAMAGE[damage]
    _edit_safetensors(out / "ckpt-000003" / f"{file}.safetensors", edit)
    rehash(out / "ckpt-000003")
    err = _resume_fails_in_one_line(capsys, out, steps=5)
    assert f"ckpt-000003/{file}.safetensors: " in err and pytest.importorskip("re").search(message, err)


# -- disk full ----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 640 KiB tmpfs: room for one checkpoint of the d_model=48 model (about 400 KB), not two."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_is_one_line_and_keeps_latest(small_disk, tmp_path, capsys):
    """It used to be a SafetensorError traceback, leaving a ckpt-N.tmp-PID folder per failed save."""
    out = small_disk / "run"
    args = ["train", "--steps", "8", "--save-every", "2", "--keep-checkpoints", "1", "--batch-size", "4", "--eval-every", "0",
            "--progress", "off", "--d-model", "48", "--n-layers", "1", "--n-heads", "2", "--threads", "1", *TINY_RECALL]
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*args, "--out", str(out)])
    err = capsys.readouterr().err
    print(err, os.listdir(out))
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "No space left on device" in err and "(latest) is intact" in err
    assert not [n for n in os.listdir(out) if ".tmp" in n], "the failed write left a temp folder"
    saved = load_checkpoint(out)  # the previous checkpoint, whole
    cli_main([*args, "--steps", str(saved.train["step"]), "--out", str(tmp_path / "whole")])
    whole = load_checkpoint(tmp_path / "whole")
    assert all(torch.equal(saved.weights[k], whole.weights[k]) for k in whole.weights)


# -- SIGINT / SIGTERM --------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_a_checkpoint_and_exits_cleanly(tmp_path, signum):
    """SIGINT/SIGTERM used to save nothing, and Ctrl-C printed a traceback."""
    out = tmp_path / "run"
    proc = start_cli(out, "--save-every", "1000", steps=30)
    wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3,
             proc, what="three steps")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    print(err)
    assert proc.returncode == 128 + signum
    assert "Traceback" not in err
    step = int((out / "latest").read_text().strip().split("-")[1])
    assert f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint " in err
    assert 3 <= step < 30 and [s for s, _ in losses(out)] == list(range(1, step + 1))
    if signum == signal.SIGTERM:  # and the resumed run is exactly the uninterrupted one
        assert cli_main(["train", "--resume", "--out", str(out), "--progress", "off"]) == 0
        run(tmp_path / "whole", 30, save_every=1000)
        assert losses(out) == losses(tmp_path / "whole")


def test_a_second_signal_exits_at_once(monkeypatch):
    exits, released = [], []
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite itself runs in the background (nohup, &)
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    with StopSignals(on_force=lambda: released.append(True)) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested == signal.SIGINT and exits == []  # the first only asks
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [143] and released == [True]
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


# -- a silent data-parallel rank -----------------------------------------------------------


class FakeStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_a_failed_collective_names_the_rank_that_stopped_beating():
    """The default-run part of the SIGSTOP test below: which rank the message names."""
    from fastweights.training import Heartbeat

    store, lines = FakeStore(), []
    beats = [Heartbeat(r, 3, interval=0.0, log=lines.append) for r in range(3)]
    for hb in beats:
        hb.store = store
    for step in (1, 2, 3):
        for r, hb in reversed(list(enumerate(beats))):  # rank 0 last: it logs what the others reported
            if not (r == 2 and step == 3):  # rank 2 stops after step 2
                hb.beat(step)
    error = beats[0].failure("an all-reduce", RuntimeError("Timed out waiting 4000ms for recv operation to complete"))
    print(error, lines[-1])
    assert "rank 0 gave up on an all-reduce: waiting for rank 2 (silent for" in str(error)
    assert "last heartbeat at step 2" in str(error) and "Timed out waiting 4000ms" in str(error)
    assert "rank 1" not in str(error).split("waiting for")[1]
    assert lines[-1].startswith("heartbeat: step 3; 3 of 3 ranks reported, the last one rank 2 at step 2")


@pytest.mark.slow  # two processes importing torch, then a 4 s timeout: ~25 s on a busy machine
def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    """SIGSTOP on one rank used to hang the others forever; with --ddp-timeout 4 the live rank
    exits naming the silent one, and rank 0 logged heartbeats while the job ran."""
    args = ["train", "--steps", "100000", "--save-every", "0", "--eval-every", "0", "--batch-size", "4",
            "--ddp-timeout", "4", "--progress", "off", *TINY_MODEL, *TINY_RECALL, "--out", str(tmp_path / "run")]
    procs = spawn(2, *args)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, procs[0], what="five steps")
        time.sleep(2.5)  # long enough for a heartbeat line (every ddp_timeout / 2 s)
        procs[1].send_signal(signal.SIGSTOP)
        stopped = time.time()
        out, err = procs[0].communicate(timeout=60)
        took = time.time() - stopped
        print(f"rank 0 exited {took:.1f} s after rank 1 stopped:\n{out[-500:]}\n{err}")
        assert procs[0].returncode == 1 and "Traceback" not in err
        assert "waiting for rank 1 (silent for" in err and "--ddp-timeout" in err
        assert took < 4 + 20
        assert "heartbeat: step" in out
        procs[1].send_signal(signal.SIGCONT)  # the stopped rank, woken, finds its peer gone and exits too
        procs[1].communicate(timeout=60)
        assert procs[1].returncode not in (0, None)
    finally:
        stop_all(procs)
