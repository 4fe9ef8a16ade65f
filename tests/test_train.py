"""Training: the recall task, text data, the train/generate commands, exact resume after
SIGKILL, and two-process data parallelism matching one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastweights.cli import main as cli_main
from fastweights.models import LMConfig
from fastweights.tasks import IGNORE, AssociativeRecall, ByteText
from fastweights.train import TrainConfig, learning_rate, make_task, train

TINY_MODEL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--threads", "1"]
TINY_RECALL = ["--recall-keys", "8", "--recall-values", "8", "--recall-pairs", "8",
               "--recall-active-keys", "4", "--recall-queries", "2"]
ENV = {**os.environ, "CI": "true", "OMP_NUM_THREADS": "1"}


def run_cli(*args, timeout=240, **kw):
    return subprocess.run([sys.executable, "-m", "fastweights.cli", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout, **kw)


def read_losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


# -- the recall task ---------------------------------------------------------------------------


def test_recall_answers_are_the_latest_values():
    task = AssociativeRecall(n_keys=8, n_values=8, n_pairs=12, n_active_keys=4, n_queries=3)
    batch = task.sample(50, torch.Generator().manual_seed(0))
    assert batch.tokens.shape == (50, task.seq_len) and int(batch.tokens.max()) < task.vocab_size
    overwritten = 0
    for row, targets, flags in zip(batch.tokens.tolist(), batch.targets.tolist(), batch.overwritten.tolist()):
        memory, counts = {}, {}
        for i in range(0, 24, 2):  # replay the writes in order
            memory[row[i]] = row[i + 1]
            counts[row[i]] = counts.get(row[i], 0) + 1
        assert row[24] == 0  # the separator
        asked = row[25::2]
        assert len(set(asked)) == 3 and all(k in memory for k in asked)
        answers = [t for t in targets if t != IGNORE]
        assert answers == [memory[k] for k in asked]
        assert [f for f, t in zip(flags, targets) if t != IGNORE] == [counts[k] > 1 for k in asked]
        overwritten += sum(counts[k] > 1 for k in asked)
    assert overwritten > 50  # most queries ask for an overwritten key
    assert task.decode(task.encode("a 3 ? a")) == "a 3 ? a"


def test_recall_generator_is_deterministic():
    task = AssociativeRecall()
    a, b = (task.sample(4, torch.Generator().manual_seed(7)) for _ in range(2))
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("kwargs, match", [
    ({"n_queries": 7, "n_active_keys": 6}, "`n_queries`=7 exceeds `n_active_keys`=6"),
    ({"n_active_keys": 20}, "`n_active_keys`=20 exceeds `n_keys`=16"),
    ({"n_pairs": 0}, "`n_pairs` must be a positive int"),
])
def test_recall_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AssociativeRecall(**kwargs)


# -- text data ---------------------------------------------------------------------------------


def test_empty_data_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="data file .*empty.txt' is empty"):
        ByteText(empty, seq_len=16)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--data", str(empty), "--steps", "1", "--progress", "off"])
    assert exit_info.value.code == 2


def test_too_short_or_missing_data_file(tmp_path):
    short = tmp_path / "short.txt"
    short.write_bytes(b"hello world")
    with pytest.raises(ValueError, match="too few for windows"):
        ByteText(short, seq_len=16)
    with pytest.raises(ValueError, match="does not exist"):
        ByteText(tmp_path / "missing.txt", seq_len=16)


def test_train_on_text_then_generate(tmp_path, capsys):
    text = tmp_path / "abc.txt"
    text.write_text("the cat sat on the mat. " * 200)
    out = tmp_path / "run"
    code = cli_main(["train", "--data", str(text), "--seq-len", "32", "--steps", "60", "--batch-size", "8",
                     "--lr", "1e-2", "--warmup-steps", "5", "--eval-every", "30", "--save-every", "30",
                     "--progress", "off", "--mixer", "gated_deltanet", *TINY_MODEL, "--out", str(out)])
    assert code == 0
    losses = [loss for _, loss in read_losses(out)]
    print(f"text: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.5 * losses[0]
    assert sorted(d for d in os.listdir(out) if d.startswith("ckpt")) == ["ckpt-000030", "ckpt-000060"]
    capsys.readouterr()
    assert cli_main(["generate", str(out), "--prompt", "the cat ", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("the cat ") and "cache" in printed


def test_prompt_longer_than_the_model_allows_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    cli_main(["train", "--steps", "2", "--batch-size", "4", "--progress", "off", "--max-seq-len", "24",
              *TINY_MODEL, "--mixer", "softmax", *TINY_RECALL, "--out", str(out)])  # max_seq_len caps softmax models
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", str(out), "--prompt", " ".join(["a 1"] * 13), "--max-new-tokens", "1"])
    assert exit_info.value.code == 2
    assert "the prompt has 26 tokens, more than the model allows (`max_seq_len`=24)" in capsys.readouterr().err


# -- configs -----------------------------------------------------------------------------------


def test_config_file_with_unknown_keys(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": {"d_model": 32}, "train": {"step": 10}}))
    with pytest.raises(SystemExit):
        cli_main(["train", "--config", str(config), "--progress", "off"])
    assert "unknown config key(s) in " in capsys.readouterr().err
    config.write_text(json.dumps({"modle": {}}))
    with pytest.raises(SystemExit):
        cli_main(["train", "--config", str(config)])
    assert "unknown section(s) ['modle']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown config key.*'batchsize' \\(did you mean 'batch_size'\\?\\)"):
        TrainConfig.from_dict({"batchsize": 3})


def test_flags_override_the_config_file(tmp_path):
    from fastweights.commands.train import build_configs
    from fastweights.cli import build_parser

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": {"d_model": 48, "n_heads": 4, "mixer": "linear"}, "train": {"steps": 7, "lr": 0.5}}))
    args = build_parser().parse_args(["train", "--config", str(config), "--lr", "0.01", "--mixer", "deltanet,softmax"])
    model_config, train_config = build_configs(args)
    assert (model_config.d_model, model_config.n_heads, model_config.mixer) == (48, 4, ["deltanet", "softmax"])
    assert (train_config.steps, train_config.lr) == (7, 0.01)
    assert model_config.vocab_size == make_task(train_config).vocab_size


def test_model_vocabulary_must_match_the_data():
    with pytest.raises(ValueError, match="`vocab_size`=50 does not match the data's vocabulary of 33 tokens"):
        train(LMConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2), TrainConfig(steps=1), progress=False)


def test_learning_rate_schedule():
    config = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [learning_rate(config, s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] > 0.1


def test_resume_refuses_a_changed_model(tmp_path):
    out = tmp_path / "run"
    cli_main(["train", "--steps", "2", "--batch-size", "4", "--progress", "off", *TINY_MODEL, *TINY_RECALL, "--out", str(out)])
    with pytest.raises(SystemExit):
        cli_main(["train", "--resume", "--out", str(out), "--d-model", "64"])
    with pytest.raises(SystemExit):
        cli_main(["train", "--resume", "--out", str(out), "--lr", "1.0"])


# -- kill and resume ---------------------------------------------------------------------------


def test_resume_after_sigkill_follows_the_uninterrupted_trajectory(tmp_path):
    args = ["train", "--steps", "150", "--save-every", "10", "--eval-every", "0", "--batch-size", "8",
            "--progress", "off", *TINY_MODEL, *TINY_RECALL]
    whole, killed = tmp_path / "whole", tmp_path / "killed"

    proc = subprocess.Popen([sys.executable, "-m", "fastweights.cli", *args, "--out", str(killed)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (killed / "latest").exists():  # the first checkpoint is written...
        assert proc.poll() is None, f"the run ended before its first checkpoint: {proc.stderr.read()}"
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # ...then the run dies without any chance to clean up
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = int((killed / "latest").read_text().strip().split("-")[1])
    assert killed_at < 150, "the run finished before the kill; the test proves nothing"

    resumed = run_cli(*args, "--out", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    complete = run_cli(*args, "--out", str(whole))
    assert complete.returncode == 0, complete.stderr

    a, b = read_losses(whole), read_losses(killed)
    print(f"killed at checkpoint step {killed_at}; resumed to 150; "
          f"max |loss difference| {max(abs(x[1] - y[1]) for x, y in zip(a, b)):.1e}")
    assert [s for s, _ in b] == list(range(1, 151))  # each step logged once, none lost or repeated
    assert a == b  # bit-for-bit the same trajectory


# -- data parallel -----------------------------------------------------------------------------


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    args = ["train", "--steps", "12", "--save-every", "12", "--eval-every", "0", "--batch-size", "8",
            "--dtype", "float64", "--progress", "off", "--mixer", "deltanet", *TINY_MODEL, *TINY_RECALL]
    two = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "fastweights.cli", *args, "--out", str(tmp_path / "two")],
        env=ENV, capture_output=True, text=True, timeout=240,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli(*args, "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    a, b = read_losses(tmp_path / "one"), read_losses(tmp_path / "two")
    diff = max(abs(x[1] - y[1]) for x, y in zip(a, b))
    print(f"2 processes vs 1 process, 12 steps, float64: max |loss difference| {diff:.2e}; losses {a[0][1]:.4f} -> {a[-1][1]:.4f}")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 13))
    assert diff <= 1e-9
    assert a[0][1] != a[-1][1]  # training moved: equal trajectories are not two frozen models


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match="`batch_size`=3 must be divisible by the number of processes"):
        from fastweights import train as train_module

        train_module._train(LMConfig(vocab_size=33, d_model=32, n_layers=1, n_heads=2),
                            TrainConfig(batch_size=3, steps=1), None, False, False, print, "t", 0, 2)
