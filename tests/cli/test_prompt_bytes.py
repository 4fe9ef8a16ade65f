"""``generate --prompt`` with bytes that are not UTF-8 is refused in one line naming ``--prompt`` and
``--prompt-file``; ``--prompt-file`` hands a byte-level model the file's bytes exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastweights.cli import main as cli_main
from test_export_targets import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("gen") / "run").parent


def generate(capsys, *args):
    try:
        code = cli_main(["generate", *map(str, args)])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_prompt_that_is_not_utf8_names_the_flag_and_the_way_to_pass_bytes(run, capsys):
    code, _, err = generate(capsys, run, "--prompt", "ab\udcc3(", "--max-new-tokens", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "`--prompt` is not valid UTF-8 (byte 0xc3 at position 2)" in err and "--prompt-file" in err, err


def test_the_real_command_line_with_raw_bytes(run):
    """The shell passes the bytes; Python turns the bad one into a lone surrogate (as a user sees it)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "LC_ALL": "C.UTF-8", "CI": "true"}
    done = subprocess.run([sys.executable, "-m", "fastweights.cli", "generate", os.fsencode(run), b"--prompt",
                           b"ab\xc3(", b"--max-new-tokens", b"1"], env=env, capture_output=True, timeout=120)
    err = done.stderr.decode()
    assert done.returncode == 2 and err.count("\n") == 1 and "--prompt-file" in err, err


def test_prompt_file_gives_the_model_the_raw_bytes(run, tmp_path, capsys, monkeypatch):
    from fastweights.models import LM

    seen = []
    real = LM.generate

    def spy(self, prompt, *args, **kwargs):
        seen.append(prompt.tolist())
        return real(self, prompt, *args, **kwargs)

    monkeypatch.setattr(LM, "generate", spy)
    prompt = tmp_path / "prompt.bin"
    prompt.write_bytes(b"ab\xc3(\xff\x00")
    code, out, err = generate(capsys, run, "--prompt-file", prompt, "--max-new-tokens", "2", "--temperature", "0")
    assert code == 0, err
    assert seen == [[97, 98, 0xC3, 40, 0xFF, 0]] and "[6 prompt + 2 new tokens" in out
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    code, _, err = generate(capsys, run, "--prompt-file", empty)
    assert code == 2 and "`--prompt-file` is empty" in err
    code, _, err = generate(capsys, run, "--prompt-file", tmp_path / "missing")
    assert code == 2 and "`--prompt-file`" in err and "cannot be read" in err
    with pytest.raises(SystemExit):  # one or the other, not both
        cli_main(["generate", str(run), "--prompt", "a", "--prompt-file", str(prompt)])
