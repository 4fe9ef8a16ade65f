"""The training flags (--precision, --val-data, --eval-tokens) and ``fastweights eval``: --precision (bf16 autocast on the
CPU; fp16's gradient scaler; the errors), --val-data / --eval-tokens, tok/s and elapsed time
in metrics.jsonl and the log lines, eval's numbers (text and --json), the help's defaults
and the nearest-flag hint for a mistyped flag."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from fastweights.training import load_model
from fastweights.cli import main as cli_main
from fastweights.models import LM, LMConfig
from fastweights.training import loop as train_module
from fastweights.training import TrainConfig, evaluate_tokens, train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--threads", "1", "--progress", "off"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    g = torch.Generator().manual_seed(0)
    words = ["delta", "rule", "memory", "key", "value", "write", "read", "the", "a", "fast", "weight"]
    def text(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g)) + "\n"
    (folder / "train.txt").write_text(text(1500))
    (folder / "val.txt").write_text(text(120))
    return folder / "train.txt", folder / "val.txt"


@pytest.fixture(scope="module")
def trained_run(texts, tmp_path_factory):
    """A bf16 run of a hybrid (DeltaNet + softmax), with a held-out file and two evaluations."""
    out = tmp_path_factory.mktemp("run") / "run"
    train_file, val_file = texts
    cli_main(["train", *TINY, "--n-layers", "2", "--mixer", '["deltanet", "softmax"]', "--data", str(train_file), "--val-data", str(val_file),
              "--seq-len", "32", "--steps", "6", "--batch-size", "4", "--eval-every", "3", "--eval-tokens", "0",
              "--precision", "bf16", "--max-seq-len", "1024", "--out", str(out)])
    return out


def test_bf16_run_logs_throughput_and_held_out_bits_per_byte(trained_run, texts, capsys):
    with open(trained_run / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    print(f"steps {len(steps)}, evals {len(evals)}; last step record {steps[-1]}; last eval {evals[-1]}")
    assert [r["step"] for r in steps] == list(range(1, 7)) and [r["step"] for r in evals] == [3, 6]
    assert all(r["tok_s"] > 0 and r["seconds"] > 0 for r in steps)
    assert [r["seconds"] for r in steps] == sorted(r["seconds"] for r in steps)
    val_bytes = os.path.getsize(texts[1])
    assert all(r["eval_tokens"] == val_bytes - 1 for r in evals)  # the whole held-out file (--eval-tokens 0)
    assert evals[-1]["eval_bpb"] == pytest.approx(evals[-1]["eval_loss"] / math.log(2))
    # the stored eval equals `fastweights eval` on the same file in the same precision
    capsys.readouterr()  # drop the training run's lines
    cli_main(["eval", str(trained_run), "--data", str(texts[1]), "--precision", "bf16", "--json"])
    result = json.loads(capsys.readouterr().out)
    print(f"train's last eval loss {evals[-1]['eval_loss']:.6f}, fastweights eval {result['loss_nats']:.6f}")
    assert result["loss_nats"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("mixer", ["softmax", "linear", "deltanet", "gated_deltanet"])
def test_bf16_training_follows_fp32(texts, mixer):
    """--precision bf16 autocasts the forward pass: the losses of a few steps stay within
    bf16's reach of the fp32 run's, and differ from them (autocast really ran)."""
    losses = {}
    for precision in ("fp32", "bf16"):
        config = TrainConfig(data=str(texts[0]), seq_len=32, steps=3, batch_size=4, precision=precision, threads=1,
                             eval_every=0, eval_tokens=64)
        result = train(LMConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, mixer=mixer), config,
                       progress=False, log=lambda _: None)
        losses[precision] = [r["loss"] for r in result.history]
    gap = max(abs(a - b) / a for a, b in zip(losses["fp32"], losses["bf16"]))
    print(f"{mixer}: fp32 losses {losses['fp32']}, bf16 {losses['bf16']}, max relative gap {gap:.2e}")
    assert 0 < gap < 1e-2


def test_log_lines_carry_tok_s_and_elapsed(texts, tmp_path):
    lines = []
    config = TrainConfig(data=str(texts[0]), seq_len=16, steps=2, batch_size=2, eval_every=1, eval_tokens=64, threads=1)
    train(LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2), config, progress=False, log=lines.append)
    print(lines)
    assert len(lines) == 2 and all(" tok/s, " in line and line.endswith(" s") and "bits/byte" in line for line in lines)


def test_eval_numbers_text_and_json(trained_run, texts, capsys):
    val = texts[1]
    data = torch.tensor(list(val.read_bytes()))
    model, _ = load_model(trained_run)
    capsys.readouterr()
    # one window holding the whole file is the plain forward pass: an independent reference
    cli_main(["eval", str(trained_run), "--data", str(val), "--seq-len", str(len(data) - 1), "--json"])
    one = json.loads(capsys.readouterr().out)
    with torch.no_grad():
        logits, _ = model(data[None, :-1])
    reference = F.cross_entropy(logits[0], data[1:]).item()
    # windows of 32 and a token limit; the text form shows the same numbers
    cli_main(["eval", str(trained_run), "--data", str(val), "--tokens", "100", "--json"])
    limited = json.loads(capsys.readouterr().out)
    print(f"eval over one window {one['loss_nats']:.6f}, plain forward {reference:.6f}")
    assert one["loss_nats"] == pytest.approx(reference, rel=1e-6)
    assert one["tokens"] == len(data) - 1
    assert one["bits_per_byte"] == pytest.approx(reference / math.log(2))
    assert one["perplexity"] == pytest.approx(math.exp(reference))
    assert limited["tokens"] == 100 and limited["seq_len"] == 32
    direct = evaluate_tokens(model, data[:101], 32, 16)
    assert limited["loss_nats"] == pytest.approx(direct["loss"], rel=1e-9)
    cli_main(["eval", str(trained_run), "--data", str(val), "--tokens", "100"])
    text = capsys.readouterr().out
    print(text)
    assert f"loss           {limited['loss_nats']:.4f} nats/token" in text
    assert f"bits per byte  {limited['bits_per_byte']:.4f}" in text
    assert f"perplexity     {limited['perplexity']:.3f}" in text


def test_evaluate_tokens_scores_every_token_once():
    """Windows of 5 over 23 tokens: 4 full windows and one of 2; 22 predictions in all."""
    model = LM(LMConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2)).double()
    tokens = torch.randint(0, 11, (23,))
    r = evaluate_tokens(model, tokens, 5, 3)
    with torch.no_grad():
        losses = [F.cross_entropy(model(tokens[a:min(a + 5, 22)][None])[0][0], tokens[a + 1:min(a + 5, 22) + 1], reduction="sum")
                  for a in range(0, 22, 5)]
    reference = sum(float(x) for x in losses) / 22
    print(f"evaluate_tokens {r['loss']:.12f}, window by window {reference:.12f}")
    assert r["tokens"] == 22 and abs(r["loss"] - reference) <= 1e-12


def test_fp16_runs_with_a_grad_scaler(texts, monkeypatch):
    """fp16 is refused on a CPU; with the guard lifted, the loop's scaler path runs (CPU
    autocast supports fp16, slowly) and the loss stays finite."""
    config = TrainConfig(data=str(texts[0]), seq_len=16, steps=3, batch_size=2, precision="fp16", threads=1)
    model_config = LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, mixer="softmax")
    with pytest.raises(ValueError, match=r"--precision fp16\) needs a CUDA device .* this run is on cpu"):
        train(model_config, config, progress=False, log=lambda _: None)
    scalers = []
    original = torch.amp.GradScaler
    monkeypatch.setattr(train_module, "check_precision", lambda precision, device: None)
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: scalers.append(original(*a, **k)) or scalers[-1])
    result = train(model_config, config, progress=False, log=lambda _: None)
    print(f"fp16 losses {[round(r['loss'], 4) for r in result.history]}, scale {scalers[0].get_scale()}")
    assert scalers[0].is_enabled() and all(math.isfinite(r["loss"]) for r in result.history)


@pytest.mark.parametrize("argv, message", [
    (["train", "--precision", "fp16", "--steps", "1"], "`precision`='fp16' (--precision fp16) needs a CUDA device"),
    (["train", "--precision", "bf16", "--dtype", "float64", "--steps", "1"],
     "`precision`='bf16' (--precision bf16) autocasts float32 weights; it cannot be combined with `dtype`='float64'"),
    (["train", "--precision", "fp8"], "unknown `precision` 'fp8' (--precision); expected one of fp32, bf16, fp16"),
    (["train", "--d-modle", "32", "--stpes", "3"], "--d-modle (did you mean --d-model?), --stpes (did you mean --steps?)"),
    (["eval", "x", "--data", "y", "--jsn"], "--jsn (did you mean --json?)"),
    (["train", "--val-data", "v.txt"], "`val_data` (--val-data) is a held-out text file; the recall task"),
], ids=["fp16-on-cpu", "bf16-with-fp64", "unknown-precision", "mistyped-train-flags", "mistyped-eval-flag", "val-data-with-recall"])
def test_bad_flags_get_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*argv, *TINY])
    err = capsys.readouterr().err
    print(err)
    assert exit_info.value.code == 2 and message in err


def test_eval_refuses_what_it_cannot_score(tmp_path, texts, capsys):
    recall = tmp_path / "recall"
    cli_main(["train", *TINY, "--steps", "1", "--batch-size", "2", "--recall-keys", "4", "--recall-values", "4",
              "--recall-pairs", "4", "--recall-active-keys", "2", "--recall-queries", "1", "--out", str(recall)])
    with pytest.raises(SystemExit):
        cli_main(["eval", str(recall), "--data", str(texts[1])])
    assert "was not trained on byte-level text (tokenizer 'recall')" in capsys.readouterr().err


def test_help_shows_the_real_defaults(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in [("--d-model D_MODEL", "64"), ("--n-layers N_LAYERS", "2"), ("--mixer MIXER", "deltanet"),
                          ("--precision PRECISION", "fp32"), ("--rope-theta ROPE_THETA", "10000.0"),
                          ("--vocab-size VOCAB_SIZE", "from the data (256 for text)")]:
        assert f"{flag} " in text and f"default: {default})" in text.split(flag + " ", 1)[1][:120], flag
    assert "required" not in text


def test_resuming_a_run_saved_before_the_new_flags(tmp_path, monkeypatch):
    """train.json written before `precision`, `val_data` and `eval_tokens` existed: repeating
    the command with --resume and --precision fp32 (what that run used) is accepted."""
    out = tmp_path / "run"
    flags = [*TINY, "--steps", "2", "--batch-size", "2", "--recall-keys", "4", "--recall-values", "4",
             "--recall-pairs", "4", "--recall-active-keys", "2", "--recall-queries", "1", "--out", str(out)]
    as_dict = TrainConfig.to_dict
    monkeypatch.setattr(TrainConfig, "to_dict", lambda self: {k: v for k, v in as_dict(self).items()
                                                              if k not in ("precision", "val_data", "eval_tokens")})
    cli_main(["train", *flags])
    monkeypatch.undo()
    stored = json.loads((out / "ckpt-000002" / "train.json").read_text())["train_config"]
    assert "precision" not in stored
    cli_main(["train", *flags, "--resume", "--precision", "fp32", "--steps", "3"])
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f if '"loss"' in line] == [1, 2, 3]
