"""A sharded checkpoint reads only its own files: every file DCP's ``.metadata`` points at must be a shard
file of the folder itself, listed (with its SHA-256) in the manifest, a regular file and not a symlink.
Malicious or damaged variants (each re-sealed with a fresh manifest, as a careless copy or an attacker
would leave it) are refused in one line naming the file: no other checkpoint's weights are exported,
no FIFO hangs the reader, and a refused pickle is one line, not DCP's tracebacks and "does not fit"."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import shutil
import signal
import warnings

import pytest
import torch

from fastweights.cli import main as cli_main
from fastweights.models import LM, LMConfig
from fastweights.io.dcp_checkpoint import FORMAT_DCP, _read_metadata, save_sharded
from fastweights.io.sealing import MANIFEST, write_manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SHARD = "__0_0.distcp"


def sharded(path, seed):
    """A sharded (DCP) checkpoint of a tiny byte-level LM, written by one process; returns the model."""
    torch.manual_seed(seed)
    model = LM(LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2))
    train = {"run_id": f"r{seed}", "step": seed, "history": [], "evals": [], "tokenizer": "bytes",
             "train_config": {"dtype": "float32"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(str(path), model, torch.optim.AdamW(model.parameters()), model.config.to_json(), train, rank=0)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two sharded checkpoints ``a`` and ``b`` with different weights."""
    root = tmp_path_factory.mktemp("dcp")
    sharded(root / "a", 1)
    sharded(root / "b", 2)
    return root


def repoint(folder, name):
    """Rewrite ``folder/.metadata`` so that every shard is read from ``name``."""
    metadata = _read_metadata(str(folder / ".metadata"))
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=name) for k, v in metadata.storage_data.items()}
    meta = getattr(metadata, "storage_meta", None)  # read back as a PurePosixPath: pickle it as DCP wrote it
    if isinstance(getattr(meta, "checkpoint_id", None), pathlib.PurePath):
        meta.checkpoint_id = pathlib.Path(meta.checkpoint_id)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def reseal(folder):
    os.remove(folder / MANIFEST)
    write_manifest(str(folder), FORMAT_DCP)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned",))


def outside(root, evil):
    repoint(evil, os.path.relpath(root / "b" / SHARD, evil))  # "../../dcp0/b/__0_0.distcp"
    os.remove(evil / SHARD)  # a checkpoint with no shard of its own
    reseal(evil)


def absolute(root, evil):
    repoint(evil, str(root / "b" / SHARD))
    os.remove(evil / SHARD)
    reseal(evil)


def symlink(root, evil):
    os.remove(evil / SHARD)
    os.symlink(root / "b" / SHARD, evil / SHARD)
    reseal(evil)  # the manifest's SHA-256 is the linked file's: it would verify


def fifo_by_name(root, evil):
    repoint(evil, "shard.fifo")
    reseal(evil)
    os.mkfifo(evil / "shard.fifo")  # no writer: opening it blocks forever


def fifo_listed(root, evil):
    os.remove(evil / SHARD)
    os.mkfifo(evil / SHARD)  # the manifest still lists the real shard's SHA-256


def evil_pickle(root, evil):
    (evil / ".metadata").write_bytes(pickle.dumps(Evil()))
    reseal(evil)


VARIANTS = {
    "outside": (outside, "b/__0_0.distcp', which is not a shard file of this folder"),
    "absolute": (absolute, "which is not a shard file of this folder"),
    "symlink": (symlink, "checkpoint file __0_0.distcp is a symbolic link; refused"),
    "fifo-by-name": (fifo_by_name, "'shard.fifo', which is not a shard file of this folder"),
    "fifo-listed": (fifo_listed, "checkpoint file __0_0.distcp is not a regular file"),
    "pickle": (evil_pickle, "posix.system is not part of DCP's checkpoint metadata"),
}


def export(capsys, source, out, seconds=30):
    """(exit code, stderr) of ``fastweights export``, failing the test instead of hanging."""

    def timeout(*_):
        raise TimeoutError(f"export of {source} hung for {seconds} s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        code = cli_main(["export", str(source), "--out", str(out)])
    except SystemExit as e:
        code = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, capsys.readouterr().err


def test_an_intact_sharded_checkpoint_exports_its_own_weights(pair, tmp_path, capsys):
    from fastweights.io.checkpoint import load_model

    code, err = export(capsys, pair / "a", tmp_path / "a.safetensors")
    assert code == 0, err
    model, _ = load_model(tmp_path / "a.safetensors")
    assert torch.equal(model.embed.weight, sharded(tmp_path / "again", 1).embed.weight)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_file_outside_the_manifest_is_refused_in_one_line(pair, tmp_path, capsys, monkeypatch, variant):
    make, message = VARIANTS[variant]
    evil = tmp_path / "evil"
    shutil.copytree(pair / "a", evil)
    make(pair, evil)
    monkeypatch.chdir(tmp_path)
    code, err = export(capsys, evil, tmp_path / "m.safetensors")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "does not fit" not in err, err
    assert message in err, err
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "pwned").exists()
