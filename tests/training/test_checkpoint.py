"""Checkpoints: round trip, atomic writes, no code execution on load, clear errors for
corrupt or mismatched files."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import safetensors.torch
import torch

from fastweights.io import checkpoint as ckpt_module
from fastweights.training import train_state
from fastweights.training import CheckpointError, load_checkpoint, load_model, mark_latest, save_checkpoint
from fastweights.models import LM, LMConfig


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def make_model(**kw):
    config = dict(vocab_size=23, d_model=32, n_layers=2, n_heads=2, mixer=["deltanet", "softmax"], chunk_size=8)
    return LM(LMConfig(**{**config, **kw}))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_round_trip_gives_identical_logits(tmp_path, tie, dtype):
    model = make_model(tie_embeddings=tie).to(dtype)
    save_checkpoint(tmp_path / "ckpt", model)
    loaded, ckpt = load_model(tmp_path / "ckpt")
    ids = torch.randint(0, 23, (2, 11))
    assert loaded.config == model.config
    assert next(loaded.parameters()).dtype == dtype
    assert torch.equal(loaded(ids)[0], model(ids)[0])
    assert (loaded.lm_head.weight is loaded.embed.weight) == tie
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "manifest.json", "model.safetensors"]


def test_run_folder_follows_latest(tmp_path):
    a, b = make_model(), make_model()
    for name, model in (("ckpt-000001", a), ("ckpt-000002", b)):
        save_checkpoint(tmp_path / name, model)
        mark_latest(tmp_path, tmp_path / name)
    loaded, ckpt = load_model(tmp_path)
    assert ckpt.path.endswith("ckpt-000002")
    assert torch.equal(loaded.embed.weight, b.embed.weight)


def test_training_state_round_trip(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 23, (2, 5)))[0].sum().backward()
    opt.step()
    tensors, info = train_state.optimizer_to_flat(opt)
    save_checkpoint(tmp_path / "c", model, train={"step": 1, "optimizer": info}, train_tensors=tensors)
    ckpt = load_checkpoint(tmp_path / "c")
    restored = torch.optim.AdamW(make_model().parameters(), lr=1e-3)
    restored.load_state_dict(train_state.optimizer_from_flat(ckpt.train_tensors, ckpt.train["optimizer"]))
    before, after = opt.state_dict()["state"], restored.state_dict()["state"]
    assert sorted(before) == sorted(after) and len(before) > 10
    for i, slots in before.items():
        assert all(torch.equal(slots[k], after[i][k]) for k in slots)


def test_overwrite_is_atomic_when_a_write_fails(tmp_path, monkeypatch):
    good = make_model()
    save_checkpoint(tmp_path / "c", good)
    real = safetensors.torch.save_file

    def fail_on_train_state(tensors, filename, metadata=None):
        if "train_state" in str(filename):
            raise OSError("disk full (simulated)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", fail_on_train_state)
    with pytest.raises(ckpt_module.CheckpointWriteError, match=r"could not write checkpoint .*/c: disk full \(simulated\)"):
        save_checkpoint(tmp_path / "c", make_model(), train={"step": 2}, train_tensors={"x": torch.zeros(2)})
    loaded, ckpt = load_model(tmp_path / "c")  # the old checkpoint, whole
    assert ckpt.train is None and torch.equal(loaded.embed.weight, good.embed.weight)
    assert sorted(os.listdir(tmp_path)) == ["c"], "the failed write left its temp folder behind"


def test_loading_executes_no_code(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "c", make_model())

    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint load must not unpickle")

    for target, name in ((pickle, "load"), (pickle, "loads"), (torch, "load"), (pickle, "Unpickler")):
        monkeypatch.setattr(target, name, forbidden)
    load_model(tmp_path / "c")


def without_manifest(folder):
    """A checkpoint as written before manifests existed (no manifest.json, and weights whose
    metadata does not announce one): only the structural checks apply."""
    os.remove(folder / "manifest.json")
    weights = folder / "model.safetensors"
    with safetensors.safe_open(str(weights), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    metadata.pop("manifest")
    safetensors.torch.save_file(tensors, str(weights), metadata=metadata)


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_weights_file(tmp_path, damage, manifest):
    save_checkpoint(tmp_path / "c", make_model())
    if not manifest:
        without_manifest(tmp_path / "c")
    path = tmp_path / "c" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": os.urandom(300), "empty": b""}[damage])
    message = "model.safetensors fails its SHA-256 check" if manifest else "corrupt or not a safetensors file"
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "c")


@pytest.mark.parametrize("file", ["model.safetensors", "train_state.safetensors", "train.json", "config.json"])
def test_a_flipped_bit_is_refused_naming_the_file(tmp_path, file):
    """A flipped exponent bit in the weights used to load and train silently."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 23, (2, 5)))[0].sum().backward()
    opt.step()
    tensors, info = train_state.optimizer_to_flat(opt)
    save_checkpoint(tmp_path / "c", model, train={"step": 1, "optimizer": info}, train_tensors=tensors)
    path = tmp_path / "c" / file
    data = bytearray(path.read_bytes())
    if file.endswith(".safetensors"):  # the high exponent bit of the last float32: 1e-2 becomes ~3e36
        data[-1] ^= 0x40
    else:
        data[data.index(b"1")] = ord("7")
    path.write_bytes(bytes(data))
    if file == "model.safetensors":  # removing the manifest does not switch the check off
        os.rename(tmp_path / "c" / "manifest.json", tmp_path / "manifest.json")
        with pytest.raises(CheckpointError, match=r"manifest.json is missing, but model.safetensors says the checkpoint was written with one"):
            load_checkpoint(tmp_path / "c")
        os.rename(tmp_path / "manifest.json", tmp_path / "c" / "manifest.json")
    with pytest.raises(CheckpointError, match=rf"checkpoint file {file} fails its SHA-256 check .*the file is corrupt"):
        load_checkpoint(tmp_path / "c")


def test_config_that_does_not_match_the_weights(tmp_path):
    save_checkpoint(tmp_path / "c", make_model())
    without_manifest(tmp_path / "c")
    config_file = tmp_path / "c" / "config.json"
    config = json.loads(config_file.read_text())
    config["d_model"] = 64
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json does not match.*d_model: 32 vs 64"):
        load_model(tmp_path / "c")


def test_weights_swapped_from_another_model(tmp_path):
    save_checkpoint(tmp_path / "a", make_model())
    save_checkpoint(tmp_path / "b", make_model(d_model=48))
    without_manifest(tmp_path / "a")
    without_manifest(tmp_path / "b")
    os.replace(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not match"):
        load_model(tmp_path / "a")


def test_weights_that_do_not_fit_the_model():
    model = make_model()
    weights = {k: v for k, v in ckpt_module._weights_of(make_model(d_model=48)).items()}
    with pytest.raises(CheckpointError, match=r"shape mismatches blocks.0.mixer.b_proj.weight: \[2, 48\] vs model \[2, 32\]"):
        ckpt_module.load_weights(model, weights)
    weights = ckpt_module._weights_of(model)
    weights.pop("norm.weight")
    weights["extra"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"missing tensors \['norm.weight'\], unexpected tensors \['extra'\]"):
        ckpt_module.load_weights(model, weights)


def test_unknown_key_in_config_json(tmp_path):
    save_checkpoint(tmp_path / "c", make_model())
    without_manifest(tmp_path / "c")
    config_file = tmp_path / "c" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "flash": True}))
    with pytest.raises(CheckpointError, match="unknown config key.*'flash'"):
        load_model(tmp_path / "c")


def test_a_lost_manifest_is_refused_but_a_checkpoint_from_before_manifests_loads(tmp_path):
    """A checkpoint that lost its manifest.json (a partial copy) used to load with the checksums
    silently off; its weights say it had one. One from before manifests still loads."""
    model = make_model()
    for name in ("lost", "old"):
        save_checkpoint(tmp_path / name, model)
    os.remove(tmp_path / "lost" / "manifest.json")
    with pytest.raises(CheckpointError, match=r"lost: manifest.json is missing, but model.safetensors says .* incomplete"):
        load_checkpoint(tmp_path / "lost")
    without_manifest(tmp_path / "old")
    assert torch.equal(load_model(tmp_path / "old")[0].embed.weight, model.embed.weight)


def test_a_file_left_out_of_the_manifest_is_refused(tmp_path):
    save_checkpoint(tmp_path / "c", make_model(), train={"step": 0}, train_tensors={"x": torch.zeros(2)})
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    del manifest["files"]["train.json"]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"checkpoint file train.json is not listed in manifest.json"):
        load_checkpoint(tmp_path / "c")


@pytest.mark.parametrize("name", ["../other/ckpt-000001", "..", "/abs/ckpt-000001"], ids=["up-and-in", "parent", "absolute"])
def test_latest_must_name_a_folder_of_the_run(tmp_path, name):
    """``latest`` holds a checkpoint's folder name; a path leading out of the run folder is refused
    rather than followed (it would load another run's checkpoint)."""
    save_checkpoint(tmp_path / "other" / "ckpt-000001", make_model())
    (tmp_path / "run" / "ckpt-000001").mkdir(parents=True)
    if name.startswith("/"):
        name = str(tmp_path / "other" / "ckpt-000001")
    (tmp_path / "run" / "latest").write_text(name + "\n")
    with pytest.raises(CheckpointError, match="which is not a checkpoint folder in"):
        load_checkpoint(tmp_path / "run")


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor a `latest` file"):
        load_model(tmp_path / "empty")


def test_a_run_folder_without_latest_names_its_checkpoints(tmp_path):
    """It used to say "holds neither model.safetensors nor a `latest` file: not a checkpoint or
    run folder", though it holds checkpoints."""
    for step in (1, 2):
        save_checkpoint(tmp_path / f"ckpt-00000{step}", make_model())
    with pytest.raises(CheckpointError, match=r"is a run folder without a `latest` file; it holds ckpt-000001, ckpt-000002: "
                                              r"pass one of them, e\.g\. '.*ckpt-000002'"):
        load_model(tmp_path)
    assert load_model(tmp_path / "ckpt-000002")[1].path.endswith("ckpt-000002")
