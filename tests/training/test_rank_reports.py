"""A distributed run reports once, with global figures: only rank 0 prints (the step lines and the
"done" line), and every evaluation is of the whole held-out set, each rank scoring its share of the
windows and the sums all-reduced, so the printed and recorded figure equals one process's evaluation
of the same weights (float64: to rounding)."""

from __future__ import annotations

import json

import pytest

from spawn_ranks import ENV, torchrun, write_words

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def no_compiled_kernels():
    from fastweights.ops import cpu

    cpu.set_enabled(False)
    yield
    cpu.set_enabled(None)

ENV["FASTWEIGHTS_CPU_KERNELS"] = "0"  # kernels play no part here; no rank waits for their build

ARGS = ["--seq-len", "16", "--chunk-size", "4", "--batch-size", "4", "--d-model", "16", "--n-layers", "1",
        "--n-heads", "2", "--threads", "1", "--progress", "off", "--dtype", "float64", "--steps", "4",
        "--eval-every", "2", "--eval-tokens", "200", "--lr", "1e-2"]


def check_run(tmp_path, *extra):
    from fastweights.training import TrainConfig, load_model
    from fastweights.training.evaluation import evaluate
    from fastweights.tasks.adapters import make_task

    run = tmp_path / "run"
    done = torchrun(2, "train", "--data", str(write_words(tmp_path / "words.txt")), *ARGS, *extra, "--out", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("done:") for line in lines) == 1, done.stdout
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 2", "step 4"], done.stdout
    recorded = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    model, ckpt = load_model(run)
    config = TrainConfig.from_dict(ckpt.train["train_config"])
    alone = evaluate(model, make_task(config), config)  # one process, every window
    last = recorded[-1]
    print(f"2 ranks {extra}: eval loss {last['eval_loss']:.12f} vs one process {alone['eval_loss']:.12f}")
    assert last["step"] == 4 and last["eval_tokens"] == alone["eval_tokens"] == 200
    assert abs(last["eval_loss"] - alone["eval_loss"]) <= 1e-12 and last["eval_accuracy"] == alone["eval_accuracy"]
    assert f"eval accuracy {alone['eval_accuracy']:.3f}" in [line for line in lines if line.startswith("done:")][0]


def test_two_data_parallel_ranks_report_once_with_the_global_evaluation(tmp_path):
    check_run(tmp_path)


@pytest.mark.slow
def test_two_context_parallel_ranks_report_once_with_the_global_evaluation(tmp_path):
    check_run(tmp_path, "--context-parallel", "2")


@pytest.mark.slow
def test_an_fsdp_run_reports_once_with_the_global_evaluation(tmp_path):
    check_run(tmp_path, "--fsdp")
