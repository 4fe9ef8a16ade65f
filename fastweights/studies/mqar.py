"""MQAR sweep: which memory recalls many keys at once (Arora et al. 2023, "Zoology").

Trains one :class:`fastweights.models.LM` per mixer (DeltaNet, linear attention,
Gated DeltaNet, softmax attention) of the same width on
:class:`fastweights.tasks.mqar.MQAR` and reports each model's accuracy on the
asked keys of a held-out batch (a query counts when the argmax of the logits at
the asked key is its value).

Training: AdamW (β = 0.9, 0.98; weight decay 0.1 on matrices), linear warmup over
10% of the steps then cosine decay, cross-entropy on the answer tokens only.
Every model of a cell sees the same batches (the batch of step s is drawn from
its own generator keyed by the root seed, the cell and s) and the same held-out
batch.

The quick default is a CPU-sized cell (vocabulary 64, T = 32, D = 4 pairs,
d_model = 64, two layers, 1500 steps, a few CPU minutes): it shows the machinery
and a first ranking on one seed, not the paper's numbers. ``full`` sweeps the
paper's regime: vocabulary 8192, T = 256, D ∈ {16, 32, 64}, d_model ∈ {64, 128,
256}, longer training (a GPU job).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..tasks.mqar import MQAR
from ..tasks.recall import IGNORE
from ._report import CellCache, format_table, keyed_seed, pyplot, save_figure, save_result, torch_threads

MIXERS = ("deltanet", "linear", "gated_deltanet", "softmax")
TABLE_COLUMNS = ("mixer", "d_model", "num_kv_pairs", "seq_len", "vocab_size", "accuracy", "loss", "steps",
                 "parameters", "seconds")


@dataclass
class MQARConfig:
    """The sweep: every mixer × every ``d_models`` × every ``num_kv_pairs`` cell."""

    root_seed: int = 0
    mixers: Tuple[str, ...] = MIXERS
    d_models: Tuple[int, ...] = (64,)
    num_kv_pairs: Tuple[int, ...] = (4,)
    n_layers: int = 2
    n_heads: int = 1
    vocab_size: int = 64
    seq_len: int = 32
    power_a: float = 0.01
    steps: int = 1500
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.1
    eval_batch: int = 256
    threads: Optional[int] = 1

    def __post_init__(self) -> None:
        if isinstance(self.root_seed, bool) or not isinstance(self.root_seed, int) or self.root_seed < 0:
            raise ValueError(f"MQARConfig: `root_seed` must be a non-negative int, got {self.root_seed!r}")
        unknown = [m for m in self.mixers if m not in MIXERS]
        if unknown or not self.mixers:
            raise ValueError(f"MQARConfig: unknown `mixers` {unknown}; expected a subset of {MIXERS}")
        for name in ("n_layers", "n_heads", "steps", "batch_size", "eval_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MQARConfig: `{name}` must be a positive int, got {value!r}")
        for d in self.d_models:
            if d % self.n_heads:
                raise ValueError(f"MQARConfig: `d_models` entry {d} is not divisible by `n_heads`={self.n_heads}")
        for d in self.num_kv_pairs:  # every cell must be a valid task
            MQAR(self.vocab_size, self.seq_len, d, self.power_a)
        if not self.lr > 0:
            raise ValueError(f"MQARConfig: `lr` must be > 0, got {self.lr!r}")

    @classmethod
    def full(cls, **overrides) -> "MQARConfig":
        settings = dict(d_models=(64, 128, 256), num_kv_pairs=(16, 32, 64), vocab_size=8192, seq_len=256,
                        steps=4000, batch_size=64, lr=1e-3, eval_batch=1000, threads=None)
        settings.update(overrides)
        return cls(**settings)


def learning_rate(step: int, steps: int, lr: float) -> float:
    """Linear warmup over the first 10% of the steps, then cosine decay to 0.1·lr."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_mqar_model(mixer: str, d_model: int, task: MQAR, config: MQARConfig, seed: int) -> Dict:
    """Train one LM on ``task``; return held-out accuracy and loss, steps, parameters, wall time."""
    from ..models import LM, LMConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LM(LMConfig(vocab_size=task.vocab_size, d_model=d_model, n_layers=config.n_layers,
                            n_heads=config.n_heads, mixer=mixer, max_seq_len=task.seq_len))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.98))
    held_out = task.sample(config.eval_batch, torch.Generator().manual_seed(seed ^ 0x5EED))
    start = time.perf_counter()
    model.train()
    history = []
    for step in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, config.steps, config.lr)
        batch = task.sample(config.batch_size, torch.Generator().manual_seed(seed + 1 + step))
        logits, _ = model(batch.inputs, return_cache=False)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits, _ = model(held_out.inputs, return_cache=False)
        asked = held_out.targets != IGNORE
        loss = F.cross_entropy(logits[asked], held_out.targets[asked]).item()
        accuracy = (logits[asked].argmax(-1) == held_out.targets[asked]).float().mean().item()
    return {"accuracy": accuracy, "loss": loss, "steps": config.steps, "parameters": model.num_parameters(),
            "seconds": round(time.perf_counter() - start, 3), "train_loss": history}


def run_mqar(config: Optional[MQARConfig] = None, out_dir: Optional[str] = None, progress: bool = True,
             plots: bool = True, resume: bool = False) -> Dict:
    """Train every cell; with ``out_dir`` write ``mqar.json``, ``mqar.csv`` and ``mqar.png``
    (each finished cell goes to ``mqar.partial.json`` first; ``resume`` continues from it)."""
    from tqdm.auto import tqdm

    config = MQARConfig() if config is None else config
    start = time.perf_counter()
    rows: List[Dict] = []
    curves: Dict[str, List[float]] = {}
    cache = CellCache(out_dir, "mqar", asdict(config), resume)
    with torch_threads(config.threads):
        cells = [(d, kv, m) for d in config.d_models for kv in config.num_kv_pairs for m in config.mixers]
        for d_model, kv, mixer in tqdm(cells, desc="mqar", disable=not progress, leave=False):
            task = MQAR(config.vocab_size, config.seq_len, kv, config.power_a)
            seed = keyed_seed(config.root_seed, 4, d_model, kv)  # shared by the mixers of a cell
            r = cache.get((d_model, kv, mixer), lambda: train_mqar_model(mixer, d_model, task, config, seed))
            rows.append({"mixer": mixer, "d_model": d_model, "num_kv_pairs": kv, "seq_len": config.seq_len,
                         "vocab_size": config.vocab_size, **{k: r[k] for k in ("accuracy", "loss", "steps",
                                                                                 "parameters", "seconds")}})
            curves[f"{mixer}/d{d_model}/kv{kv}"] = r["train_loss"]
    result = {
        "study": "mqar",
        "paper": "Arora et al. 2023, Zoology: multi-query associative recall",
        "config": asdict(config),
        "table": rows,
        "train_loss": curves,
        "files": [],
    }
    result["runtime_s"] = round(time.perf_counter() - start, 3)
    save_result(result, out_dir, "mqar", rows, TABLE_COLUMNS, plot_mqar if plots else None)
    cache.finish()
    return result


def plot_mqar(result: Dict, out: Path) -> List[str]:
    plt = pyplot()
    cfg = result["config"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = result["table"]
    single_width = len(cfg["d_models"]) == 1
    for i, mixer in enumerate(cfg["mixers"]):
        mine = [r for r in rows if r["mixer"] == mixer]
        for j, kv in enumerate(cfg["num_kv_pairs"]):
            pts = sorted((r["d_model"], r["accuracy"]) for r in mine if r["num_kv_pairs"] == kv)
            if single_width:  # one bar per mixer (and per D)
                width = 0.8 / len(cfg["num_kv_pairs"])
                axes[0].bar(i + j * width, pts[0][1], width=width, color=f"C{i}", alpha=1.0 - 0.25 * j,
                            label=f"D={kv}" if i == 0 and len(cfg["num_kv_pairs"]) > 1 else None)
            else:
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                             ls=["-", "--", ":", "-."][j % 4], label=f"{mixer}, D={kv}")
        key = f"{mixer}/d{cfg['d_models'][0]}/kv{cfg['num_kv_pairs'][0]}"
        loss = result["train_loss"][key]
        window = max(1, len(loss) // 50)
        smooth = [sum(loss[max(0, k - window + 1):k + 1]) / len(loss[max(0, k - window + 1):k + 1]) for k in range(len(loss))]
        axes[1].plot(range(1, len(loss) + 1), smooth, color=f"C{i}", label=mixer)
    if single_width:
        axes[0].set_xticks(range(len(cfg["mixers"])))
        axes[0].set_xticklabels(cfg["mixers"], fontsize=8)
        axes[0].set_xlabel(f"mixer (d_model = {cfg['d_models'][0]})")
        axes[0].axhline(1.0 / (cfg["vocab_size"] - cfg["vocab_size"] // 2), color="gray", ls=":", lw=1,
                        label="chance")
    else:
        axes[0].set_xscale("log", base=2)
        axes[0].set_xlabel("model width d_model")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel(f"training loss (d={cfg['d_models'][0]}, D={cfg['num_kv_pairs'][0]})")
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.subplots_adjust(wspace=0.3)
    fig.suptitle(f"MQAR: vocab {cfg['vocab_size']}, T = {cfg['seq_len']}, α = {cfg['power_a']}, "
                 f"{cfg['n_layers']} layers, {cfg['steps']} steps", fontsize=9)
    return [save_figure(fig, out / "mqar.png", dpi=80)]


def report(result: Dict) -> str:
    cfg = result["config"]
    lines = [f"MQAR study (Arora et al. 2023): vocab {cfg['vocab_size']}, T = {cfg['seq_len']}, power-law α = "
             f"{cfg['power_a']}, {cfg['n_layers']} layers × {cfg['n_heads']} head(s), {cfg['steps']} steps of "
             f"{cfg['batch_size']}, AdamW lr {cfg['lr']}"]
    lines.append(format_table(result["table"], ("mixer", "d_model", "num_kv_pairs", "accuracy", "loss", "parameters",
                                                "seconds"), title="held-out accuracy on the asked keys"))
    lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# command line (``fastweights study mqar``)

HELP = "multi-query associative recall (Arora et al. 2023): DeltaNet, linear, Gated DeltaNet and softmax LMs"
Config = MQARConfig
run = run_mqar


def add_arguments(parser) -> None:
    parser.add_argument("--d-model", type=int, nargs="+", default=None, help="model widths (default 64)")
    parser.add_argument("--kv-pairs", type=int, nargs="+", default=None, help="key-value pairs D (default 4)")
    parser.add_argument("--mixers", nargs="+", default=None, choices=MIXERS, help="which models to train")
    parser.add_argument("--steps", type=int, default=None, help="training steps per model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads while training (default 1)")


def config_from_args(args) -> MQARConfig:
    overrides = {"root_seed": args.root_seed}
    for name, value in (("d_models", args.d_model), ("num_kv_pairs", args.kv_pairs), ("mixers", args.mixers)):
        if value is not None:
            overrides[name] = tuple(value)
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.threads is not None:
        overrides["threads"] = args.threads
    return MQARConfig.full(**overrides) if args.full else MQARConfig(**overrides)
