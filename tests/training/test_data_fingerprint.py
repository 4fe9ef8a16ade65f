"""A run records its data files by absolute path and content fingerprint; ``--resume`` refuses
another file (a changed file, or a relative path that resolves elsewhere from another working
directory) naming it, unless ``--allow-data-change``. Checkpoints from before fingerprints
resume as they did, and record one from then on."""

from __future__ import annotations

import os

import pytest

from fastweights.cli import main
from fastweights.io.checkpoint import load_checkpoint

FLAGS = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--d-model", "16", "--n-layers", "1",
         "--n-heads", "2", "--eval-every", "0", "--save-every", "1", "--progress", "off", "--threads", "1"]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() * 40)


def run(capsys, *argv):
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip()


@pytest.fixture
def started(tmp_path, monkeypatch, capsys):
    """A 2-step run on ``a/data.txt`` given relatively from ``a/``; then its steps raised to 3."""
    write(tmp_path / "a" / "data.txt", "the first file, its own bytes. ")
    write(tmp_path / "b" / "data.txt", "another file with other bytes! ")
    monkeypatch.chdir(tmp_path / "a")
    out = str(tmp_path / "run")
    assert run(capsys, "train", "--out", out, "--data", "data.txt", *FLAGS)[0] == 0
    return tmp_path, out


def resume_flags():
    flags = list(FLAGS)
    flags[flags.index("--steps") + 1] = "3"
    return flags


def test_a_run_records_its_data_file_by_absolute_path_and_fingerprint(started):
    tmp_path, out = started
    files = load_checkpoint(out).train["data_files"]
    recorded = files["data"]
    assert recorded["path"] == str(tmp_path / "a" / "data.txt")
    assert recorded["bytes"] == os.path.getsize(tmp_path / "a" / "data.txt") and len(recorded["sha256"]) == 64


def test_resume_from_another_directory_is_refused_naming_both_files(started, monkeypatch, capsys):
    tmp_path, out = started
    monkeypatch.chdir(tmp_path / "b")  # `data.txt` now resolves to b/data.txt
    code, err = run(capsys, "train", "--out", out, "--resume", "--data", "data.txt", *resume_flags())
    assert code not in (0, None)
    assert str(tmp_path / "a" / "data.txt") in err and str(tmp_path / "b" / "data.txt") in err
    assert "--allow-data-change" in err
    assert load_checkpoint(out).train["step"] == 2  # nothing trained on the other file


def test_a_file_changed_in_place_is_refused(started, capsys):
    tmp_path, out = started
    write(tmp_path / "a" / "data.txt", "the first file, edited bytes!! ")
    code, err = run(capsys, "train", "--out", out, "--resume", *resume_flags())
    assert code not in (0, None) and "changed" in err and str(tmp_path / "a" / "data.txt") in err


def test_the_same_file_resumes(started, capsys):
    _, out = started
    assert run(capsys, "train", "--out", out, "--resume", *resume_flags())[0] == 0
    assert load_checkpoint(out).train["step"] == 3


def test_allow_data_change_continues_on_the_new_file_and_records_it(started, monkeypatch, capsys):
    tmp_path, out = started
    monkeypatch.chdir(tmp_path / "b")
    code, err = run(capsys, "train", "--out", out, "--resume", "--allow-data-change", *resume_flags())
    assert code == 0, err
    assert load_checkpoint(out).train["data_files"]["data"]["path"] == str(tmp_path / "b" / "data.txt")


def test_a_checkpoint_without_fingerprints_still_resumes(started, capsys):
    """Checkpoints written before fingerprints: resumed unchecked (said in the log), recorded from then on."""
    from fastweights.models import LM
    from fastweights.io.checkpoint import load_weights, save_checkpoint

    tmp_path, out = started
    ckpt = load_checkpoint(out)
    train = dict(ckpt.train)
    del train["data_files"]
    lm = LM(ckpt.config)
    load_weights(lm, ckpt.weights, ckpt.path)
    save_checkpoint(ckpt.path, lm, train=train, train_tensors=ckpt.train_tensors)
    assert "data_files" not in load_checkpoint(out).train
    capsys.readouterr()
    try:
        code = main(["train", "--out", out, "--resume", *resume_flags()])
    except SystemExit as e:
        code = e.code
    printed = capsys.readouterr()
    assert code == 0 and "no data fingerprint" in printed.out + printed.err
    assert load_checkpoint(out).train["data_files"]["data"]["path"] == str(tmp_path / "a" / "data.txt")
