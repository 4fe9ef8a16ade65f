"""The lab's state-tracking panel: small parity models trained by the state-tracking study, read
token by token.

Two one-layer DeltaNet LMs (d_model 32, one head of 32, no short convolution) are trained on
parity at length 64 with the study's protocol (:mod:`fastweights.studies.state_tracking`), one
with β ∈ [0, 1] and one with β ∈ [0, 2]. They ship with the package (``models/*.safetensors``,
about 60 KB each; regenerate with ``python -m fastweights.lab.tracking``: under a minute on one
core). :func:`track` runs one of them on a bit string the user types and reports, at every
token, the write strength β_t, the eigenvalue 1 − β_t of the token's transition I − β_t k̂_t k̂_tᵀ
along its key (k̂ is L2-normalized, so every other eigenvalue is 1), the sign of the product of
those eigenvalues so far (the determinant of the memory's accumulated transition), and the
model's running answer against the true parity. With β ≤ 1 no eigenvalue can be negative and
the sign never flips; with β up to 2, a 1-bit can be a reflection (eigenvalue −1) and the sign
*is* the parity (Grazzi et al. 2025, arXiv 2411.12537).

Files are read with safetensors (no code runs on load); the config rides in the file's metadata.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Dict, Tuple

import torch

MODEL_DIR = Path(__file__).resolve().parent / "models"
#: arm -> the file of its parity model
MODELS = {"deltanet[0,2]": "parity-deltanet-beta02.safetensors", "deltanet[0,1]": "parity-deltanet-beta01.safetensors"}
TRAIN_LENGTH = 64
_loaded: Dict[str, Tuple[torch.nn.Module, Dict]] = {}
_lock = threading.Lock()


def study_config():
    """The study settings the shipped models were trained with."""
    from ..studies.state_tracking import StateTrackingConfig

    return StateTrackingConfig(tasks=("parity",), arms=tuple(MODELS), train_max_length=TRAIN_LENGTH, d_model=32,
                               n_layers=1, max_steps=800, seeds=1, workers=1)


def train_models(folder: Path = MODEL_DIR, seed: int = 0) -> Dict[str, Path]:
    """Train every :data:`MODELS` arm on parity and write it to ``folder`` (atomically); returns the paths."""
    from safetensors.torch import save_model

    from ..studies.state_tracking import fit_state_tracking_model

    folder.mkdir(parents=True, exist_ok=True)
    config = study_config()
    out = {}
    for arm, name in MODELS.items():
        with torch.random.fork_rng(devices=[]):
            model, loss = fit_state_tracking_model("parity", arm, config, seed)
        meta = {"lm_config": json.dumps(model.config.to_dict()), "task": "parity", "arm": arm,
                "train_length": str(TRAIN_LENGTH), "train_loss": f"{loss:.6g}", "seed": str(seed)}
        tmp = folder / (name + ".tmp")
        save_model(model, str(tmp), metadata=meta)
        tmp.replace(folder / name)
        out[arm] = folder / name
    return out


def load_model(arm: str):
    """``(model, metadata)`` of the shipped parity model of ``arm`` (loaded once, then cached)."""
    from safetensors import safe_open
    from safetensors.torch import load_model as load_into

    from ..models import LM, LMConfig

    with _lock:
        if arm not in _loaded:
            path = MODEL_DIR / MODELS[arm]
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
            model = LM(LMConfig.from_dict(json.loads(meta["lm_config"])))
            load_into(model, str(path), strict=True)
            _loaded[arm] = (model.eval(), meta)
        return _loaded[arm]


def track(arm: str, bits: str) -> Dict:
    """Run the parity model of ``arm`` on ``bits`` (a string of 0s and 1s) and report every token."""
    model, meta = load_model(arm)
    inputs = torch.tensor([[int(b) for b in bits]])
    layer = model.blocks[0].mixer
    seen = {}
    run_memory = layer.memory

    def capture(q, k, v, extra, *args, **kwargs):  # the write strengths the op is given
        seen["beta"] = layer.write_and_decay(extra)[0]
        return run_memory(q, k, v, extra, *args, **kwargs)

    layer.memory = capture
    try:
        with torch.no_grad():
            logits, _ = model(inputs, return_cache=False)
    finally:
        del layer.memory  # back to the class's method
    beta = seen["beta"][0, :, 0].double()          # [T]: one head
    eig = 1 - beta                                  # the eigenvalue along k̂ of I − β k̂ k̂ᵀ
    sign = torch.cumprod(torch.sign(eig), 0)        # sign of det(accumulated transition)
    prob = logits[0].double().softmax(-1)
    answer = prob.argmax(-1)
    truth = inputs[0].cumsum(0) % 2
    right = answer == truth
    return {
        "arm": arm, "bits": bits, "train_length": int(meta.get("train_length", TRAIN_LENGTH)),
        "beta": beta.tolist(), "eigenvalue": eig.tolist(), "sign": sign.tolist(),
        "answer": answer.tolist(), "p_answer": prob.gather(-1, answer[:, None])[:, 0].tolist(),
        "truth": truth.tolist(), "right": right.tolist(),
        "token_accuracy": float(right.double().mean()), "all_right": bool(right.all()),
        "sign_is_parity": bool((sign == 1 - 2 * truth.double()).all()),
    }


if __name__ == "__main__":
    import time

    torch.set_num_threads(1)
    start = time.perf_counter()
    for arm, path in train_models().items():
        print(f"{arm}: wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    print(f"{time.perf_counter() - start:.0f} s")
