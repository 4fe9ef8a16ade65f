"""Fault injection into the trainer: crashes at every file operation of a run (pruning
included), real SIGKILLs at random moments and in the middle of pruning, two trainers at once,
corrupted files, a full disk and stop signals. After each fault: every folder under a checkpoint's
name loads, ``latest`` loads, and resuming gives exactly the uninterrupted trajectory.

The default run keeps a sample of each kind (about 40 s); ``-m slow`` runs every file operation
and more random kills.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import safetensors.torch

from fastweights.training import load_checkpoint, load_training_checkpoint
from fastweights.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6
ARGS = ["train", "--steps", str(STEPS), "--save-every", "1", "--keep-checkpoints", "2", "--eval-every", "0",
        "--batch-size", "4", "--progress", "off", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
        "--threads", "1", "--recall-keys", "8", "--recall-values", "8", "--recall-pairs", "8",
        "--recall-active-keys", "4", "--recall-queries", "2"]
ENV = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1"}


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's losses, for ``steps`` steps."""
    cache = {}

    def get(steps=STEPS):
        if steps not in cache:
            out = tmp_path_factory.mktemp("whole") / "run"
            assert cli_main([*ARGS, "--steps", str(steps), "--out", str(out)]) == 0
            cache[steps] = losses(out)
        return cache[steps]

    return get


def assert_recoverable(out, reference, steps=STEPS, resume_args=()):
    """Every ckpt-N folder loads, `latest` (if any) loads, and a resume ends on the reference trajectory."""
    os.makedirs(out, exist_ok=True)  # a crash in the very first operation leaves no folder at all
    for name in os.listdir(out):
        if name.startswith("ckpt-") and ".tmp-" not in name:
            load_checkpoint(os.path.join(out, name))
    if os.path.exists(os.path.join(out, "latest")):
        load_training_checkpoint(out)
        code = cli_main([*ARGS, "--steps", str(steps), "--out", str(out), "--resume", *resume_args])
    else:  # killed before the first checkpoint: nothing to resume, start over
        code = cli_main([*ARGS, "--steps", str(steps), "--out", str(out), "--overwrite"])
    assert code == 0
    assert losses(out) == reference(steps)
    assert not [n for n in os.listdir(out) if ".tmp" in n or n == "lock"]


# -- crashes at every file operation (in-process) ---------------------------------------------------


class Killed(BaseException):
    """Stands in for a kill: raised from inside a file operation; `except Exception` does not catch it."""


OPERATIONS = [(os, "replace"), (os, "remove"), (os, "makedirs"), (os, "fsync"), (shutil, "rmtree"),
              (safetensors.torch, "save_file"), (builtins, "open")]


def crash_at(monkeypatch, n):
    """Make the n-th file-changing call (1-based) raise :class:`Killed` halfway: rmtree deletes one
    file first, save_file writes half a file first. Returns the call counter."""
    count = [0]
    for module, name in OPERATIONS:
        real = getattr(module, name)

        def wrapped(*args, __real=real, __name=name, **kwargs):
            if __name == "open" and not any(m in str(args[1] if len(args) > 1 else kwargs.get("mode", "r")) for m in "wax+"):
                return __real(*args, **kwargs)  # reads are not faults
            count[0] += 1
            if count[0] == n:
                if __name == "rmtree" and os.path.isdir(args[0]) and os.listdir(args[0]):
                    os.remove(os.path.join(args[0], sorted(os.listdir(args[0]))[0]))
                if __name == "save_file":  # half a file (io.open is the unpatched open)
                    with io.open(args[1], "wb") as f:
                        f.write(b"\0" * 100)
                raise Killed(f"{__name} #{n}")
            return __real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)
    return count


def count_operations(tmp_path, monkeypatch):
    """The file operations of one clean run (the second one: a process's first run does one-time work)."""
    for i in range(2):
        with monkeypatch.context() as m:
            count = crash_at(m, 0)
            assert cli_main([*ARGS, "--out", str(tmp_path / f"count-{i}")]) == 0
    return count[0]


def run_crash_trials(tmp_path, monkeypatch, reference, points):
    survived = 0
    for n in points:
        out = tmp_path / f"crash-{n}"
        with monkeypatch.context() as m:
            crash_at(m, n)
            with pytest.raises(Killed):
                cli_main([*ARGS, "--out", str(out)])
        assert_recoverable(out, reference)
        survived += 1
    return survived


def test_a_crash_at_sampled_file_operations_is_recoverable(tmp_path, monkeypatch, reference):
    total = count_operations(tmp_path, monkeypatch)
    points = list(range(1, total + 1, 12))
    survived = run_crash_trials(tmp_path, monkeypatch, reference, points)
    print(f"{survived} of {len(points)} crashes survived (every 12th of the run's {total} file operations)")
    assert survived == len(points) and total > 50


@pytest.mark.slow
def test_a_crash_at_every_file_operation_is_recoverable(tmp_path, monkeypatch, reference):
    total = count_operations(tmp_path, monkeypatch)
    survived = run_crash_trials(tmp_path, monkeypatch, reference, range(1, total + 1))
    print(f"{survived} of {total} crashes survived (one at every file operation of a {STEPS}-step run)")
    assert survived == total


# -- real SIGKILLs --------------------------------------------------------------------------------------


def popen(out, *extra, steps=40, script=None):
    command = [sys.executable, "-m", "fastweights.cli"] if script is None else [sys.executable, str(script)]
    return subprocess.Popen([*command, *ARGS, "--steps", str(steps), "--out", str(out), *extra], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(proc, out, timeout=120):
    deadline = time.time() + timeout
    while not (out / "latest").exists():
        if proc.poll() is not None:
            return False
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.01)
    return True


def sigkill_chain(tmp_path, reference, kills, seed):
    """Kill one run folder's trainer `kills` times at random moments, resuming after each."""
    rng, out, survived = random.Random(seed), tmp_path / "chain", 0
    for _ in range(kills):
        proc = popen(out, *(["--resume"] if (out / "latest").exists() else []))
        if wait_for_checkpoint(proc, out):
            time.sleep(rng.uniform(0.0, 0.6))  # somewhere in a step, a save, a prune
        proc.kill()
        proc.wait()
        survived += 1
        for name in os.listdir(out):  # after every kill: whole checkpoints only
            if name.startswith("ckpt-") and ".tmp-" not in name:
                load_checkpoint(out / name)
        load_training_checkpoint(out)
    assert_recoverable(out, reference, steps=40)
    return survived


def test_sigkill_at_random_moments(tmp_path, reference):
    survived = sigkill_chain(tmp_path, reference, kills=2, seed=0)
    print(f"{survived} SIGKILLs at random moments survived; the resumed run equals the uninterrupted one")


@pytest.mark.slow
def test_many_sigkills_at_random_moments(tmp_path, reference):
    survived = sigkill_chain(tmp_path, reference, kills=20, seed=1)
    print(f"{survived} SIGKILLs at random moments survived; the resumed run equals the uninterrupted one")


KILL_WHILE_PRUNING = textwrap.dedent("""\
    # Run the trainer, but SIGKILL this process in the middle of deleting a pruned checkpoint
    # (after its first file is gone): the real kill, at the worst moment.
    import os, shutil, signal, sys
    real = shutil.rmtree
    def rmtree(path, *args, **kwargs):
        if ".tmp-del-" in str(path) or "ckpt-" in os.path.basename(str(path)) and ".tmp" not in str(path):
            files = sorted(os.listdir(path))
            if files:
                os.remove(os.path.join(path, files[0]))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *args, **kwargs)
    shutil.rmtree = rmtree
    from fastweights.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigkill_in_the_middle_of_pruning(tmp_path, reference):
    script = tmp_path / "kill_while_pruning.py"
    script.write_text(KILL_WHILE_PRUNING)
    out = tmp_path / "run"
    proc = popen(out, steps=STEPS, script=script)
    proc.wait(timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    print(f"killed while pruning; left: {sorted(os.listdir(out))}")
    assert load_training_checkpoint(out).train["step"] == 3  # keep 2: the first prune follows the third save
    assert_recoverable(out, reference)


# -- two trainers, corrupted files, a full disk, signals -----------------------------------------------


@pytest.mark.slow  # the lock itself is tested in the default run (test_run_folder.py)
def test_two_trainers_started_together(tmp_path, reference):
    out = tmp_path / "run"
    procs = [popen(out, steps=STEPS) for _ in range(2)]
    results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    print(results)
    assert codes == [0, 2]
    refused = next(err for code, err in results if code == 2)
    assert "is in use by another trainer" in refused or "already holds" in refused
    assert losses(out) == reference()  # the one that ran was not disturbed
    load_training_checkpoint(out)


@pytest.mark.parametrize("file", ["model.safetensors", "train_state.safetensors", "train.json", "config.json"])
def test_a_corrupted_file_is_refused_and_the_restored_one_resumes(tmp_path, reference, capsys, file):
    out = tmp_path / "run"
    assert cli_main([*ARGS, "--steps", "3", "--out", str(out)]) == 0
    path = out / "ckpt-000003" / file
    good = path.read_bytes()
    data = bytearray(good)
    position = random.Random(file).randrange(len(data))
    data[position] ^= 0x10
    path.write_bytes(bytes(data))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*ARGS, "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    print(f"byte {position} of {file} flipped: {err.strip()}")
    assert exit_info.value.code == 2 and f"checkpoint file {file} fails its SHA-256 check" in err
    path.write_bytes(good)
    assert_recoverable(out, reference)


@pytest.mark.parametrize("size_k", [300, 640], ids=["full-at-first-save", "full-at-second-save"])
def test_disk_full_at_different_moments(tmp_path, capsys, size_k):
    """A tmpfs too small for the first checkpoint (about 400 KB), and one too small for the second."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli_main([*ARGS, "--d-model", "48", "--out", str(disk / "run")])
        err = capsys.readouterr().err
        print(f"{size_k} KiB: {err.strip()}")
        assert exit_info.value.code == 2 and "No space left on device" in err and len(err.strip().splitlines()) == 1
        assert not [n for n in os.listdir(disk / "run") if ".tmp" in n]
        shutil.copytree(disk / "run", tmp_path / "run")  # move to a disk with room, then resume
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert cli_main([*ARGS, "--d-model", "48", "--out", str(whole)]) == 0
    if size_k == 300:
        assert "no earlier checkpoint exists" in err and not (out / "latest").exists()
        assert cli_main([*ARGS, "--d-model", "48", "--out", str(out), "--overwrite"]) == 0
    else:
        assert "the previous checkpoint ckpt-000001 (latest) is intact" in err
        assert load_training_checkpoint(out).train["step"] == 1
        assert cli_main([*ARGS, "--d-model", "48", "--out", str(out), "--resume"]) == 0
    assert losses(out) == losses(whole)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(4))
def test_sigterm_at_random_moments(tmp_path, reference, trial):
    out = tmp_path / "run"
    proc = popen(out, steps=40)
    wait_for_checkpoint(proc, out)
    time.sleep(random.Random(trial).uniform(0.0, 0.5))
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    if proc.returncode == -signal.SIGTERM:
        # the signal landed after training had ended and restored the default handler (the process
        # was exiting): allowed only when the run's final checkpoint is already in place
        assert load_training_checkpoint(out).train["step"] == 40, err
    else:
        assert proc.returncode in (143, 0), err
    assert "Traceback" not in err, err
    assert_recoverable(out, reference, steps=40)


# -- a full disk at every kind of write (no root needed) ----------------------------------------------

WRITES = [(os, "makedirs", "makedirs"), (os, "fsync", "fsync"), (safetensors.torch, "save_file", "save_file"),
          (builtins, "open", "open"), (os, "open", "os.open")]


def _target(name, args, kwargs):
    """What a write touches, as a class: the file's name with digits and temp suffixes folded
    (``ckpt-000002.tmp-41/`` -> ``ckpt-N``, ``latest.x1y2.tmp`` -> ``latest``)."""
    if name == "fsync":
        path = os.readlink(f"/proc/self/fd/{args[0]}")
    else:
        path = str(args[1] if name == "save_file" else args[0])
    return name, re.sub(r"\d+", "N", os.path.basename(path).split(".")[0])


def disk_full_at(monkeypatch, n, seen=None):
    """Make the n-th write (1-based) raise ENOSPC, as a full disk does; ``seen`` collects the
    class of every write (:func:`_target`). Reads and lock-file opens without O_CREAT are not writes."""
    count = [0]
    for module, attribute, name in WRITES:
        real = getattr(module, attribute)

        def wrapped(*args, __real=real, __name=name, **kwargs):
            if __name == "open" and not any(m in str(args[1] if len(args) > 1 else kwargs.get("mode", "r")) for m in "wax+"):
                return __real(*args, **kwargs)
            if __name == "os.open" and not args[1] & os.O_CREAT:
                return __real(*args, **kwargs)
            count[0] += 1
            if seen is not None:
                seen.append(_target(__name, args, kwargs))
            if count[0] == n:
                raise OSError(errno.ENOSPC, "No space left on device")
            return __real(*args, **kwargs)

        monkeypatch.setattr(module, attribute, wrapped)


def write_classes(tmp_path, monkeypatch):
    """``{class: the first write of that class}`` in a clean run (the second one), plus
    ``{(class, 2): its second write}`` for the second checkpoint's weights and `latest`
    (a failure there must leave the first checkpoint as `latest`)."""
    for i in range(2):
        seen = []
        with monkeypatch.context() as m:
            disk_full_at(m, 0, seen)
            assert cli_main([*ARGS, "--out", str(tmp_path / f"count-{i}")]) == 0
    first, again = {}, {}
    for n, cls in enumerate(seen, 1):
        if cls in first and cls in (("save_file", "model"), ("fsync", "latest")):
            again.setdefault((cls, 2), n)
        first.setdefault(cls, n)
    return {**first, **again}, len(seen)


def run_disk_full_trials(tmp_path, monkeypatch, capsys, reference, points):
    """Returns each trial's error line (printed at the end: capsys reads each trial's output)."""
    said = []
    for n in points:
        out = tmp_path / f"full-{n}"
        with monkeypatch.context() as m:
            disk_full_at(m, n)
            with pytest.raises(SystemExit) as exit_info:
                cli_main([*ARGS, "--out", str(out)])
        err = capsys.readouterr().err.strip()
        said.append(f"write {n}: {err}")
        if (out / "latest").exists():  # a later checkpoint failed: the earlier one is named intact
            assert "(latest) is intact" in err or "metrics.jsonl" in err, err
        assert exit_info.value.code == 2 and "No space left on device" in err and len(err.splitlines()) == 1, err
        assert not os.path.isdir(out) or not [x for x in os.listdir(out) if ".tmp" in x or x == "lock"]
        if os.path.isdir(out):
            assert_recoverable(out, reference)
    return said


def test_a_full_disk_at_each_kind_of_write_fails_in_one_line(tmp_path, monkeypatch, capsys, reference):
    """ENOSPC at the first write of each kind (the run folder, the lock, metrics, each checkpoint
    file and its fsync, `latest` and its fsync): one line, exit 2, no temp file, and the run
    resumes exactly from what is left."""
    first, total = write_classes(tmp_path, monkeypatch)
    assert (("fsync", "latest"), 2) in first and ("makedirs", "count-N") in first and len(first) >= 12
    said = run_disk_full_trials(tmp_path, monkeypatch, capsys, reference, sorted(first.values()))
    print(f"{len(first)} kinds of write among the run's {total}: {sorted(first, key=str)}", *said, sep="\n")


@pytest.mark.slow
def test_a_full_disk_at_every_write_fails_in_one_line(tmp_path, monkeypatch, capsys, reference):
    _, total = write_classes(tmp_path, monkeypatch)
    said = run_disk_full_trials(tmp_path, monkeypatch, capsys, reference, range(1, total + 1))
    print(f"{len(said)} of {total} writes failed with a full disk, each in one line, each recovered", *said, sep="\n")


# -- resume without `latest` ----------------------------------------------------------------------------


def test_a_kill_before_the_first_checkpoint_is_marked_still_resumes(tmp_path, monkeypatch, reference):
    """Killed between renaming ckpt-000001 into place and writing `latest`: --resume takes ckpt-000001."""
    import fastweights.training.loop as train_module

    def killed(*args):
        raise Killed("before `latest` was written")

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(train_module, "mark_latest", killed)
        with pytest.raises(Killed):
            cli_main([*ARGS, "--out", str(out)])
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt-")) == ["ckpt-000001"]
    assert not (out / "latest").exists()
    assert cli_main([*ARGS, "--out", str(out), "--resume"]) == 0
    assert losses(out) == reference()


def test_resume_without_latest_skips_a_corrupt_newest_checkpoint(tmp_path, reference, capsys):
    """No `latest`, the newest checkpoint corrupt: it is named with the reason and skipped, never
    used; the run resumes from the newest one that verifies and ends on the reference."""
    out = tmp_path / "run"
    assert cli_main([*ARGS, "--steps", "3", "--out", str(out)]) == 0  # keeps ckpt-000002 and ckpt-000003
    (out / "latest").unlink()
    weights = out / "ckpt-000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    capsys.readouterr()
    assert cli_main([*ARGS, "--out", str(out), "--resume"]) == 0
    said = capsys.readouterr().out
    print(said)
    assert "skipping ckpt-000003" in said and "model.safetensors fails its SHA-256 check" in said
    assert "resuming from ckpt-000002, the newest checkpoint that verifies" in said
    assert losses(out) == reference()
