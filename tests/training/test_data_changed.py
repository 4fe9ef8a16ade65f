"""A ``--data`` file truncated while ``train`` runs: one line ("the data file changed while training: ..."),
exit code 2, the last checkpoint intact, instead of a silent SIGBUS death (rc 135).

- the size check before every step (so at every epoch boundary) catches it in-process;
- a truncation between that check and a read of the mapping is caught by the SIGBUS handler
  (a subprocess reads a truncated mapping under the guard);
- the real command, killed mid-run by a truncation from outside (slow).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fastweights.cli import main as cli_main
from fastweights.training import loop as loop_module
from fastweights.io.checkpoint import load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the compiled CPU kernels play no part here: off, so that no test waits for their build
ENV = {**os.environ, "PYTHONPATH": ROOT, "CI": "true", "OMP_NUM_THREADS": "1", "FASTWEIGHTS_CPU_KERNELS": "0"}
TINY = ["--seq-len", "16", "--batch-size", "2", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
        "--threads", "1", "--eval-every", "0", "--eval-tokens", "64", "--progress", "off", "--save-every", "2"]


@pytest.fixture(autouse=True)
def no_compiled_kernels():
    from fastweights.ops import cpu

    cpu.set_enabled(False)
    yield
    cpu.set_enabled(None)


def words(path, n=4000):
    path.write_bytes(b"the delta rule writes a key and a value " * (n // 40))
    return path


def test_a_truncation_between_steps_is_one_line_and_the_last_checkpoint_survives(tmp_path, capsys, monkeypatch):
    data, run = words(tmp_path / "data.txt"), tmp_path / "run"
    real = loop_module.write_metrics

    def write_then_truncate(out_dir, record):  # the file shrinks right after step 3 was logged
        real(out_dir, record)
        if record.get("step") == 3:
            os.truncate(data, 100)

    monkeypatch.setattr(loop_module, "write_metrics", write_then_truncate)
    with pytest.raises(SystemExit) as info:
        cli_main(["train", "--data", str(data), "--steps", "50", *TINY, "--out", str(run)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the data file changed while training: --data" in err and "was 4,000 bytes when the run began, now 100" in err
    assert "ckpt-000002 (latest) is intact" in err, err
    assert load_checkpoint(run).train["step"] == 2  # verifies against its manifest
    assert not (run / "lock").exists()


GUARDED_READ = """
import os, sys
from fastweights.tasks.text import read_bytes
from fastweights.training.data_files import BusErrorGuard, DataWatch
path, guarded = sys.argv[1], sys.argv[2] == "1"
tokens, _ = read_bytes(path)
watch = DataWatch({"data": path}, lambda: "the previous checkpoint ckpt-000004 (latest) is intact")
guard = BusErrorGuard(watch, on_fault=lambda: os.write(2, b"lock released\\n")) if guarded else None
if guard is not None:
    guard.__enter__()
os.truncate(path, 100)  # between the size check and the read: the page is gone
print(int(tokens[900_000:900_010].long().sum()))
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_read_of_a_truncated_mapping_is_one_line_not_sigbus(tmp_path, guarded):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(1 << 20))
    done = subprocess.run([sys.executable, "-c", GUARDED_READ, str(data), "1" if guarded else "0"], env=ENV,
                          capture_output=True, text=True, timeout=120)
    if not guarded:  # what happens without the guard: the kernel's SIGBUS, no message
        assert done.returncode == -7 and "data file" not in done.stderr, (done.returncode, done.stderr)
        return
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stderr)
    assert lines == [f"train: the data file changed while training: --data {data} was 1,048,576 bytes when the run "
                     f"began, now 100; training reads it in place, so it must not change until the run ends; the "
                     f"previous checkpoint ckpt-000004 (latest) is intact", "lock released"], lines


@pytest.mark.slow
def test_the_command_killed_by_a_truncation_from_outside(tmp_path):
    """``fastweights train`` in a subprocess; once its first checkpoint is marked, the file is truncated."""
    data, run = words(tmp_path / "data.txt", 400_000), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fastweights.cli", "train", "--data", str(data), "--steps",
                             "1000000", *TINY, "--out", str(run)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (run / "latest").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1]
        os.truncate(data, 1000)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2 and "the data file changed while training: --data" in err, (proc.returncode, err)
    assert "(latest) is intact" in err
    assert load_checkpoint(run).train["step"] >= 2
