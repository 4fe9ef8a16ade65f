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
from fastweights.tasks import make_task
from fastweights.training import TrainConfig, learning_rate, train
from fastweights.training import loop as train_module

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



# -- fp16: the gradient scaler's state is part of the training state --------------------------------

FP16_RECALL = dict(recall_keys=8, recall_values=8, recall_pairs=8, recall_active_keys=4, recall_queries=2)


class Stopped(BaseException):
    """Stands in for a kill right after a checkpoint was written."""


def _fp16_run(monkeypatch, out, *, stop_after=None, resume=False):
    """8 fp16 steps of a tiny DeltaNet LM on the CPU, a checkpoint after each; ``stop_after``:
    stop right after that step's checkpoint. The trainer refuses fp16 on a CPU (it is slow
    there), but torch 2.13 runs CPU fp16 autocast and GradScaler("cpu"), so the guard is lifted.
    The scaler has torch's defaults except growth every 2 clean steps (default 2000), so the
    scale moves within 8 steps: it doubles to 2^17 at step 2, the gradients of step 4 overflow
    at 2^17 (the scaler skips that step and halves the scale), and it doubles again at steps 6
    and 8 (measured; the test asserts the overflow at step 4)."""
    monkeypatch.setattr(train_module, "check_precision", lambda precision, device: None)
    monkeypatch.setattr(train_module, "make_scaler", lambda config, device: torch.amp.GradScaler("cpu", growth_interval=2))
    real_save = train_module._save

    def save(*args):
        path = real_save(*args)
        if stop_after is not None and path.endswith(f"ckpt-{stop_after:06d}"):
            raise Stopped
        return path

    monkeypatch.setattr(train_module, "_save", save)
    config = TrainConfig(steps=8, batch_size=4, save_every=1, keep_checkpoints=8, eval_every=0, threads=1,
                         precision="fp16", **FP16_RECALL)
    model_config = LMConfig(vocab_size=make_task(config).vocab_size, d_model=32, n_layers=1, n_heads=2,
                            mixer="deltanet", max_seq_len=64)
    return train(model_config, config, str(out), resume=resume, progress=False, log=lambda _: None)


def _scaler_states(out):
    states = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("ckpt-"):
            with open(os.path.join(out, name, "train.json")) as f:
                states[int(name[5:])] = json.load(f).get("grad_scaler")
    return states


def test_interrupted_fp16_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Stopped after step 3 (scale 2^17, one clean step counted towards the next growth) and after
    step 5 (after the skipped step 4), resumed each time: the same losses, skipped steps, scaler
    states and final weights as the uninterrupted run, bit for bit. A resume with a fresh scaler
    (scale 2^16) does not overflow at step 4 and leaves the trajectory."""
    whole = _fp16_run(monkeypatch, tmp_path / "whole")
    reference = [(r["step"], r["loss"], r.get("skipped", False)) for r in whole.history]
    scales = _scaler_states(tmp_path / "whole")
    print("uninterrupted:", reference)
    print("scaler after each step:", {s: (v["scale"], v["_growth_tracker"]) for s, v in scales.items()})
    assert scales[3] != scales[5] and scales[3]["scale"] != 2.0 ** 16 and [r[0] for r in reference if r[2]] == [4]

    out = tmp_path / "interrupted"
    for stop_after in (3, 5):
        with pytest.raises(Stopped):
            _fp16_run(monkeypatch, out, stop_after=stop_after, resume=stop_after != 3)
    resumed = _fp16_run(monkeypatch, out, resume=True)
    got = [(r["step"], r["loss"], r.get("skipped", False)) for r in resumed.history]
    print("stopped after 3 and 5, resumed:", got)
    assert got == reference
    assert _scaler_states(out) == scales
    final, expected = resumed.model.state_dict(), whole.model.state_dict()
    assert all(torch.equal(final[k], expected[k]) for k in expected)


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop("grad_scaler"), r"`grad_scaler` is missing: a `precision`='fp16' run must save its gradient scaler"),
    (lambda t: t["grad_scaler"].update(scale=-1.0), r"`grad_scaler.scale` must be a finite number > 0, got -1.0"),
    (lambda t: t["grad_scaler"].update(_growth_tracker=2), r"`grad_scaler._growth_tracker`=2 must be below `growth_interval`=2"),
    (lambda t: t["history"][3].pop("skipped"), r"`step`=5 does not match the optimizer state \(optimizer.0.step = 4\)"),
], ids=["missing", "negative-scale", "tracker-past-interval", "skipped-step-unmarked"])
def test_damaged_grad_scaler_state_is_refused(tmp_path, monkeypatch, damage, message):
    from fastweights.training import CheckpointError, check_train_state, load_training_checkpoint

    with pytest.raises(Stopped):
        _fp16_run(monkeypatch, tmp_path / "run", stop_after=5)
    ckpt = load_training_checkpoint(tmp_path / "run")  # step 5, after the skipped step 4
    damage(ckpt.train)
    with pytest.raises(CheckpointError, match=message):
        check_train_state(ckpt.train, ckpt.train_tensors)


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
        from fastweights.training import loop as train_module

        train_module._train(LMConfig(vocab_size=33, d_model=32, n_layers=1, n_heads=2),
                            TrainConfig(batch_size=3, steps=1), None, False, False, print, "t", 0, 2)
