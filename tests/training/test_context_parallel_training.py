"""``train --context-parallel N`` on the CPU with gloo: each sequence split over N ranks, the step equal to
the one-process step (float64), with data parallelism and FSDP around it; a --context-parallel that does not
divide the world stops every rank at once with the same one-line error.

Ranks are started from a subprocess with a timeout (nothing can hang). The default run trains with
``--context-parallel 2 --fsdp`` on 2 ranks in test_fsdp.py; here, in ``-m slow``, context parallelism alone
on 2 ranks, with data parallelism and FSDP on 4, and the refused sizes.
"""

from __future__ import annotations

import pytest
import torch

from fastweights.cli import main as cli_main

from spawn_ranks import losses, text_args, torchrun, write_words

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return write_words(tmp_path_factory.mktemp("text") / "words.txt")


def args_for(text, out, *extra):
    return ["train", *text_args(text), "--dtype", "float64", "--steps", "3", "--save-every", "3", *extra,
            "--out", str(out)]


def weights(run):
    from fastweights.io.checkpoint import load_model

    model, _ = load_model(run)
    return model.state_dict()


def compare(one, many, what):
    a, b = losses(one), losses(many)
    diff = max(abs(x[1] - y[1]) for x, y in zip(a, b))
    wa, wb = weights(one), weights(many)
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    print(f"{what} vs one process, float64, 3 steps: max |loss difference| {diff:.2e}, max |weight difference| {worst:.2e}")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3]
    assert diff <= 1e-10 and worst <= 1e-10 and a[0][1] != a[-1][1]


@pytest.mark.slow  # the default run has it with --fsdp (test_fsdp.py)
def test_context_parallel_step_equals_one_process(text, tmp_path):
    one, two = tmp_path / "one", tmp_path / "cp2"
    done = torchrun(2, *args_for(text, two, "--context-parallel", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert cli_main(args_for(text, one)) == 0
    compare(one, two, "--context-parallel 2 on 2 ranks")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--context-parallel", "2"], ["--context-parallel", "2", "--fsdp"],
                                   ["--context-parallel", "4"]], ids=["dp2xcp2", "dp2xcp2-fsdp", "cp4"])
def test_four_ranks_with_context_parallel_equal_one_process(text, tmp_path, extra):
    one, four = tmp_path / "one", tmp_path / "four"
    done = torchrun(4, *args_for(text, four, *extra))
    assert done.returncode == 0, done.stderr[-3000:]
    assert cli_main(args_for(text, one)) == 0
    compare(one, four, f"{' '.join(extra)} on 4 ranks")


@pytest.mark.slow
def test_a_context_parallel_size_that_does_not_divide_the_world_stops_every_rank(text, tmp_path):
    done = torchrun(4, *args_for(text, tmp_path / "run", "--context-parallel", "3"), timeout=120)
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    print("\n".join(errors))
    assert done.returncode == 2 and len(errors) == 4
    assert all("--context-parallel 3 does not divide the number of processes (4)" in e for e in errors)
    assert "Traceback" not in done.stderr


def test_the_loss_of_a_split_sequence_is_the_global_mean():
    """The grid keeps the targets of the globally shifted sequence: a slice's last target is the next
    slice's first input (no token is dropped or counted twice at a boundary)."""
    from fastweights.training.parallel import ParallelPlan

    ids = torch.arange(17)[None]
    inputs, targets = ids[:, :-1], ids[:, 1:]
    pieces = [ParallelPlan(r, 2, dp=1, cp=2).local_batch(inputs, targets) for r in range(2)]
    assert torch.equal(pieces[0][1][0, -1], pieces[1][0][0, 0])
    assert torch.equal(torch.cat([p[1] for p in pieces], 1), targets)


@pytest.mark.slow
def test_context_parallel_trains_the_recall_task_on_slices_of_partial_chunks(tmp_path):
    """The built-in recall task's 40-token rows split into 20 tokens per rank, no multiple of the chunk
    size (32): each slice ends in a partial chunk, padded with no-op tokens, and the run equals one process."""
    common = ["train", "--dtype", "float64", "--steps", "3", "--save-every", "3", "--eval-every", "0",
              "--progress", "off", "--threads", "1"]
    one, two = tmp_path / "one", tmp_path / "cp2"
    done = torchrun(2, *common, "--context-parallel", "2", "--out", str(two))
    assert done.returncode == 0, done.stderr[-3000:]
    assert cli_main([*common, "--out", str(one)]) == 0
    compare(one, two, "the recall task, --context-parallel 2 (local T = 20, chunk size 32)")
