"""The HF converter never destroys what it did not write, and never loads garbage.

- ``hf export`` / ``hf import`` write only into a new or empty folder, or one they wrote
  before (a checked marker file); anything else is refused naming the folder, unless
  ``--overwrite``; a folder that is, or holds, the source (or the current directory) is
  refused even then.
- ``from_pretrained`` and ``hf import`` refuse missing and unexpected tensors, naming them;
  a truncated weights file is one line and a non-zero exit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers not installed (pip install 'fastweights[hf]')")

import fastweights.hf as fh
from fastweights.io.checkpoint import load_model, save_checkpoint
from fastweights.cli import main
from fastweights.models import LM, LMConfig

pytestmark = pytest.mark.filterwarnings("ignore")


def tiny_lm(n_layers=2, tie=True, seed=0):
    torch.manual_seed(seed)
    return LM(LMConfig(vocab_size=40, d_model=16, n_layers=n_layers, n_heads=2, mixer="deltanet", chunk_size=4,
                       max_seq_len=64, tie_embeddings=tie))


@pytest.fixture
def ckpt(tmp_path):
    return save_checkpoint(tmp_path / "ckpt", tiny_lm())


def cli(*argv):
    """(exit code, stderr text) of ``fastweights ARGV``."""
    try:
        return main(list(argv)), ""
    except SystemExit as e:
        return e.code, ""


def run_cli(capsys, *argv):
    capsys.readouterr()  # drop what the setup printed (transformers' progress bars)
    code, _ = cli(*argv)
    return code, capsys.readouterr().err


# -- 1. output folders -----------------------------------------------------------------------


def test_export_refuses_a_folder_with_user_files_and_keeps_them(tmp_path, ckpt, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    code, err = run_cli(capsys, "hf", "export", ckpt, str(out))
    assert code != 0
    assert str(out) in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "thesis.tex").read_text() == "years of work"


def test_import_refuses_a_run_folder(tmp_path, ckpt, capsys):
    fh.checkpoint_to_hf(ckpt, tmp_path / "hf")
    run = tmp_path / "run"
    save_checkpoint(run / "ckpt-000010", tiny_lm())
    (run / "metrics.jsonl").write_text("{}\n")
    code, err = run_cli(capsys, "hf", "import", str(tmp_path / "hf"), str(run))
    assert code != 0 and str(run) in err
    assert (run / "metrics.jsonl").exists() and (run / "ckpt-000010" / "model.safetensors").exists()


def test_export_into_the_current_directory_is_refused_even_with_overwrite(tmp_path, ckpt, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    for extra in ((), ("--overwrite",)):
        code, err = run_cli(capsys, "hf", "export", ckpt, ".", *extra)
        assert code != 0 and str(work) in err
    assert (work / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("where", ["same", "parent"])
def test_a_folder_that_is_or_holds_the_source_is_always_refused(tmp_path, ckpt, capsys, where):
    out = ckpt if where == "same" else str(tmp_path)
    for extra in ((), ("--overwrite",)):
        code, err = run_cli(capsys, "hf", "export", ckpt, out, *extra)
        assert code != 0 and "source" in err, err
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors"))
    fh.checkpoint_to_hf(ckpt, tmp_path / "hf")
    hf_dir = str(tmp_path / "hf")
    code, err = run_cli(capsys, "hf", "import", hf_dir, hf_dir, "--overwrite")
    assert code != 0 and "source" in err
    assert os.path.isfile(os.path.join(hf_dir, "model.safetensors"))


def test_new_empty_and_own_folders_are_written_and_replaced(tmp_path, ckpt, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("hf", "export", ckpt, str(empty))[0] == 0
    assert cli("hf", "export", ckpt, str(empty))[0] == 0  # its own earlier output: replaced
    assert cli("hf", "import", str(empty), str(tmp_path / "new" / "ckpt"))[0] == 0
    assert cli("hf", "import", str(empty), str(tmp_path / "new" / "ckpt"))[0] == 0
    lm, _ = load_model(tmp_path / "new" / "ckpt")
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        assert torch.equal(lm(ids)[0], tiny_lm()(ids)[0])
    # a user file added to our own output: no longer only ours, refused
    (empty / "README.md").write_text("my notes")
    code, err = run_cli(capsys, "hf", "export", ckpt, str(empty))
    assert code != 0 and "README.md" in err
    # --overwrite: explicit, then it replaces
    assert cli("hf", "export", ckpt, str(empty), "--overwrite")[0] == 0
    assert not (empty / "README.md").exists()
    # a forged marker (not ours) does not count
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / ".fastweights-output.json").write_text("not json")
    (forged / "data.bin").write_text("x")
    assert cli("hf", "export", ckpt, str(forged))[0] != 0 and (forged / "data.bin").exists()


def test_output_that_is_a_file_is_refused(tmp_path, ckpt, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    code, err = run_cli(capsys, "hf", "export", ckpt, str(f), "--overwrite")
    assert code != 0 and str(f) in err and f.read_text() == "x"


# -- 2. missing / unexpected tensors ----------------------------------------------------------


def _hf_folder(tmp_path, **config_changes):
    """A saved HF folder whose config.json is then edited (more layers, untied head, ...)."""
    folder = tmp_path / "hf"
    fh.checkpoint_to_hf(save_checkpoint(tmp_path / "src", tiny_lm()), folder)
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(config_changes)
    cfg_file.write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("change", [{"n_layers": 3}, {"tie_embeddings": False, "tie_word_embeddings": False}])
def test_from_pretrained_refuses_missing_tensors_naming_them(tmp_path, change):
    from transformers import AutoModelForCausalLM

    folder = _hf_folder(tmp_path, **change)
    with pytest.raises(ValueError, match=r"missing.*(blocks\.2|lm_head)"):
        AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"missing.*(blocks\.2|lm_head)"):
        fh.hf_to_checkpoint(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_from_pretrained_refuses_a_dropped_tensor_and_an_unexpected_one(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = _hf_folder(tmp_path)
    weights = load_file(folder / "model.safetensors")
    dropped = "model.blocks.1.mixer.k_proj.weight"
    del weights[dropped]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(folder)
    weights[dropped] = torch.zeros(16, 16)
    weights["model.blocks.9.extra.weight"] = torch.zeros(3)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected.*blocks\.9\.extra"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_complete_loads_are_deterministic_and_loading_info_still_works(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = _hf_folder(tmp_path)
    a = AutoModelForCausalLM.from_pretrained(folder)
    b, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_import_of_a_truncated_weights_file_is_one_line(tmp_path, capsys):
    folder = _hf_folder(tmp_path)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, err = run_cli(capsys, "hf", "import", str(folder), str(tmp_path / "out"))
    assert code not in (0, None) and "model.safetensors" in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()
