"""``fastweights export --out`` never loses data: an existing file is replaced only with ``--overwrite``,
and a path inside a checkpoint folder (one with a ``manifest.json``) is refused always, since replacing
a checkpoint's own file would make it fail its SHA-256 check (it could neither resume nor generate)."""

from __future__ import annotations

import pytest

from fastweights.cli import main as cli_main
from fastweights.models import LM, LMConfig
from fastweights.io.checkpoint import load_checkpoint, save_checkpoint
from fastweights.io.listing import mark_latest


def tiny_run(folder, step=4):
    """A run folder with one checkpoint ``ckpt-<step>`` of a 1-layer byte-level LM; returns its checkpoint path."""
    model = LM(LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2))
    ckpt = save_checkpoint(folder / f"ckpt-{step:06d}", model, train={"run_id": "r1", "step": step, "tokenizer": "bytes"})
    mark_latest(folder, ckpt)
    return folder / f"ckpt-{step:06d}"


def export(capsys, *args):
    """(exit code, stderr) of ``fastweights export *args``."""
    try:
        code = cli_main(["export", *map(str, args)])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("target", ["own", "other", "nested"])
def test_a_file_inside_a_checkpoint_folder_is_refused_even_with_overwrite(tmp_path, capsys, target):
    run = tiny_run(tmp_path / "run").parent
    other = tiny_run(tmp_path / "other")
    out = {"own": run / "ckpt-000004" / "model.safetensors", "other": other / "model.safetensors",
           "nested": other / "sub" / "m.safetensors"}[target]
    before = {p: p.read_bytes() for p in (run / "ckpt-000004", other) for p in p.iterdir() if p.is_file()}
    for extra in ([], ["--overwrite"]):
        code, err = export(capsys, run, "--out", out, *extra)
        assert code == 2 and "lies inside the checkpoint folder" in err and "`--out`" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert {p: p.read_bytes() for p in before} == before  # nothing written, nothing replaced
    assert not (other / "sub").exists()
    load_checkpoint(other)  # still verifies against its manifest
    load_checkpoint(run)


def test_an_existing_file_is_kept_unless_overwrite(tmp_path, capsys):
    run = tiny_run(tmp_path / "run").parent
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    code, err = export(capsys, run, "--out", out)
    assert code == 2 and "already exists; pass --overwrite" in err, err
    assert out.read_bytes() == b"precious"
    assert export(capsys, run, "--out", out, "--overwrite")[0] == 0
    assert load_checkpoint(out).train["step"] == 4
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []  # temp file + rename, nothing left over


def test_a_symlink_into_a_checkpoint_folder_is_refused(tmp_path, capsys):
    ckpt = tiny_run(tmp_path / "run")
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    code, err = export(capsys, ckpt.parent, "--out", link / "model.safetensors", "--overwrite")
    assert code == 2 and "lies inside the checkpoint folder" in err, err
    load_checkpoint(ckpt)


def test_a_file_that_appears_during_the_write_is_kept(tmp_path, capsys, monkeypatch):
    """The last check and the rename are not one step: without --overwrite the file is published by a
    hard link, which fails on an existing name, so a file created in between survives."""
    import safetensors.torch

    run = tiny_run(tmp_path / "run").parent
    out = tmp_path / "model.safetensors"
    original = safetensors.torch.save_file

    def save_then_someone_writes(*args, **kwargs):
        original(*args, **kwargs)
        out.write_bytes(b"written meanwhile")

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_someone_writes)
    code, err = export(capsys, run, "--out", out)
    assert code == 2 and "already exists" in err, err
    assert out.read_bytes() == b"written meanwhile"
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_another_projects_manifest_does_not_make_a_checkpoint_folder(tmp_path, capsys):
    run = tiny_run(tmp_path / "run").parent
    site = tmp_path / "site"
    site.mkdir()
    (site / "manifest.json").write_text('{"name": "a web app", "icons": []}')
    assert export(capsys, run, "--out", site / "model.safetensors")[0] == 0
    (site / "manifest.json").write_text("{not json")  # a damaged checkpoint manifest is still one
    code, err = export(capsys, run, "--out", site / "other.safetensors")
    assert code == 2 and "lies inside the checkpoint folder" in err, err
