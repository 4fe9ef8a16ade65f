"""A checkpoint written before the package had rooms (``fastweights.checkpoint`` and
``fastweights.train``, the code of that time) still loads, evaluates and resumes.

``data/run_before_layout/`` is a run folder made with that code::

    fastweights train --out run_before_layout --d-model 16 --n-layers 2 --n-heads 2 \
        --mixer '["gated_deltanet","softmax"]' --steps 4 --save-every 4 --eval-every 4 \
        --eval-batches 1 --batch-size 2 --seq-len 32 --progress off

and ``data/run_before_layout.expected.json`` holds what that code computed from it: the
logits of a fixed batch, and the losses of steps 5 and 6 after
``fastweights train --out <copy> --resume --steps 6``.
"""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from fastweights.cli import main as cli_main
from fastweights.training import load_model, load_training_checkpoint

DATA = Path(__file__).parent / "data"
RUN = DATA / "run_before_layout"
EXPECTED = json.loads((DATA / "run_before_layout.expected.json").read_text())


@pytest.fixture
def run(tmp_path):
    """A copy of the run folder (resuming writes to it)."""
    return Path(shutil.copytree(RUN, tmp_path / "run"))


def test_the_old_checkpoint_loads_and_computes_what_the_old_code_did():
    model, ckpt = load_model(RUN)
    assert ckpt.config.mixers == ["gated_deltanet", "softmax"] and ckpt.train["step"] == 4
    with torch.no_grad():
        logits, _ = model(torch.tensor(EXPECTED["inputs"]), return_cache=False)
    logits = logits.double()
    assert logits.sum().item() == pytest.approx(EXPECTED["logits_sum"], rel=1e-6, abs=1e-6)
    assert logits.abs().sum().item() == pytest.approx(EXPECTED["logits_abs_sum"], rel=1e-6)
    assert torch.allclose(logits[0, :2, :5], torch.tensor(EXPECTED["logits_first"], dtype=torch.float64), atol=1e-6)
    load_training_checkpoint(RUN / "ckpt-000004")  # its training state passes today's schema


def test_the_old_checkpoint_loads_through_the_old_module_path():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fastweights.checkpoint import load_model as old_load_model
    model, _ = old_load_model(RUN)
    assert model.num_parameters() == load_model(RUN)[0].num_parameters()


def test_the_old_run_evaluates_and_resumes_on_the_old_trajectory(run, capsys):
    """``fastweights train --resume`` continues the old run; steps 5 and 6 lose what they lost
    under the old code (the same batches, optimizer moments and RNG state)."""
    assert cli_main(["train", "--out", str(run), "--resume", "--steps", "6", "--progress", "off"]) == 0
    assert "resumed" in capsys.readouterr().out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {str(r["step"]): r["loss"] for r in records if "loss" in r and r["step"] > 4}
    assert losses.keys() == EXPECTED["resumed_losses"].keys()
    for step, loss in EXPECTED["resumed_losses"].items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step
    assert any("eval_loss" in r and r["step"] == 6 for r in records)
