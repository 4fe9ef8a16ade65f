"""A transformers folder without ``model.embed.weight`` is refused with ``WeightsMismatchError`` naming it,
as for every other missing tensor: with a tied head transformers itself lists it nowhere (neither of its
two names is in the file) and leaves it a meta tensor, which used to surface later as a RuntimeError."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers not installed (pip install 'fastweights[hf]')")

import fastweights.hf as fh
from fastweights.io.checkpoint import save_checkpoint
from test_hf_safety import _hf_folder, run_cli, tiny_lm

pytestmark = pytest.mark.filterwarnings("ignore")


def drop(folder, name):
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    del weights[name]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("tie", [True, False])
def test_a_missing_embedding_is_a_weights_mismatch_naming_it(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "hf"
    fh.checkpoint_to_hf(save_checkpoint(tmp_path / "src", tiny_lm(tie=tie)), folder)
    drop(folder, "model.embed.weight")
    with pytest.raises(fh.WeightsMismatchError, match=r"missing from the weights: model\.embed\.weight"):
        AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(fh.WeightsMismatchError, match=r"model\.embed\.weight"):
        fh.hf_to_checkpoint(folder, tmp_path / "out")


def test_hf_import_without_the_embedding_is_one_line(tmp_path, capsys):
    folder = _hf_folder(tmp_path)
    drop(folder, "model.embed.weight")
    code, err = run_cli(capsys, "hf", "import", str(folder), str(tmp_path / "out"))
    errors = [line for line in err.splitlines() if "error" in line.lower()]  # transformers' progress bar aside
    assert code == 2 and len(errors) == 1 and "fastweights hf: error:" in errors[0] and "model.embed.weight" in errors[0], err
    assert "Traceback" not in err and "meta" not in err
    assert not (tmp_path / "out").exists()
