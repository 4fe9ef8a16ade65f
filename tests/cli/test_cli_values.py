"""Every bad numeric flag of the command line is one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import pytest
import torch

from fastweights.io.checkpoint import save_checkpoint
from fastweights.cli import build_parser, main
from fastweights.models import LM, LMConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    return save_checkpoint(path, LM(LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, mixer="deltanet")))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "text.txt"
    path.write_bytes(b"hello world, " * 100)
    return str(path)


def run(capsys, argv):
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("extra, words", [
    (["--temperature", "nan"], "finite"),
    (["--temperature", "inf"], "finite"),
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "100000000000"], "max_new_tokens"),
    (["--max-new-tokens", "1e11"], "max-new-tokens"),
    (["--max-new-tokens", "-5"], "max-new-tokens"),
    (["--top-k", "0"], "top_k"),
])
def test_generate_bad_values(capsys, ckpt, extra, words):
    code, err = run(capsys, ["generate", ckpt, "--prompt", "ab", *extra])
    assert code not in (0, None) and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("extra, words", [
    (["--threads", "-1"], "threads"),
    (["--tokens", "-3"], "tokens"),
    (["--batch-size", "0"], "batch-size"),
])
def test_eval_bad_values(capsys, ckpt, text, extra, words):
    code, err = run(capsys, ["eval", ckpt, "--data", text, *extra])
    assert code not in (0, None) and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("extra, words", [
    (["--init-std", "nan"], "init_std"),
    (["--init-std", "-1"], "init_std"),
    (["--d-model", "100000000000", "--n-heads", "1"], "memory"),
])
def test_train_bad_values(capsys, tmp_path, text, extra, words):
    code, err = run(capsys, ["train", "--out", str(tmp_path / "run"), "--data", text, "--steps", "1", *extra])
    assert code not in (0, None) and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("extra, words", [
    (["--chunk-size", "0"], "chunk-size"), (["--threads", "0"], "threads"), (["--batch", "-1"], "batch"),
])
def test_bench_bad_values(capsys, extra, words):
    code, err = run(capsys, ["bench", "--no-memory", *extra])
    assert code not in (0, None) and words in err and "Traceback" not in err, err


def test_every_float_flag_refuses_nan_and_every_size_flag_refuses_negatives():
    """The parser-level guard covers every command's numeric flags (seeds may be negative)."""
    import argparse

    parser = build_parser()
    checked = 0

    def walk(p):
        nonlocal checked
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in set(action.choices.values()):
                    walk(sub)
            elif callable(action.type) and action.type.__name__ in ("finite number",):
                with pytest.raises(argparse.ArgumentTypeError):
                    action.type("nan")
                checked += 1
            elif callable(action.type) and getattr(action.type, "__qualname__", "").startswith("_non_negative_int"):
                with pytest.raises(argparse.ArgumentTypeError):
                    action.type("-1")
                checked += 1
            assert action.type not in (int, float) or action.dest in ("seed", "root_seed"), action.dest

    walk(parser)
    assert checked > 20
