"""transformers' Qwen3-Next prefill on its own torch path and on fastweights' ops, side by side.

``python -m benchmarks.run hf_prefill`` builds ``Qwen3NextForCausalLM`` with random weights
(no download: the config is written here) and times, interleaved round by round in one
process (best of the rounds):

- the prefill of ``--tokens`` tokens (one forward, no cache, the logits of the last token),
  once on transformers' torch fallbacks and once after
  :func:`fastweights.hf.use_fastweights_kernels` (undone between rounds);
- the gated delta rule alone at the model's shape, transformers' ``torch_chunk_gated_delta_rule``
  against :func:`fastweights.ops.chunk_gated_delta_rule` (the call the routed model makes).

It reports the speed-up of the prefill and the bound Amdahl's law puts on it: with the op's
share of transformers' prefill and our op's speed-up, the best the whole model can gain by
changing the op alone. Needs ``pip install 'fastweights[hf]'``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from fastweights.config import atomic_write_text, flag

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def qwen3_next_config(layers: int = 4, hidden: int = 2048, experts: int = 8, vocab: int = 4096):
    """Qwen3-Next's layer shapes (16 key and 32 value heads of 128, one full-attention layer in
    four, MoE of 512-wide experts), ``layers`` deep, with a small vocabulary (random weights)."""
    from transformers import Qwen3NextConfig

    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, layer_types=kinds,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=experts,
        num_experts_per_tok=min(2, experts), moe_intermediate_size=512, shared_expert_intermediate_size=512,
        intermediate_size=5632,
    )


def run(tokens: int = 2048, layers: int = 4, repeats: int = 3, threads: int = 1, clock: str = "cpu",
        seed: int = 0) -> Dict:
    """Time both paths (module docstring); returns the JSON-ready result."""
    from transformers import Qwen3NextForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen

    from fastweights import ops
    from fastweights.hf import use_fastweights_kernels
    from fastweights.hf.kernels import torch_fallbacks
    from fastweights.ops import cpu as cpu_kernels

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = qwen3_next_config(layers)
    model = Qwen3NextForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens))
    gen = torch.Generator().manual_seed(seed)
    h_k, h_v, d = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    # the gated op's inputs at the model's shape (k and q repeated to the value heads, as the model does)
    q = torch.nn.functional.normalize(rand(1, tokens, h_v, d), dim=-1)
    k = torch.nn.functional.normalize(rand(1, tokens, h_v, d), dim=-1)
    v, beta = rand(1, tokens, h_v, d), torch.sigmoid(rand(1, tokens, h_v))
    g = torch.nn.functional.logsigmoid(rand(1, tokens, h_v) + 3.0)
    torch_op = qwen.torch_chunk_gated_delta_rule
    torch_op = getattr(torch_op, "__wrapped__", torch_op)

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")

    def prefill(routed: bool):
        """``routed``: our ops; else transformers' own torch fallbacks (what the decorator would bind
        without fla installed; with fla installed it binds fla's GPU kernels)."""
        with contextlib.ExitStack() as stack, torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if routed:
                use_fastweights_kernels(True)
                stack.callback(use_fastweights_kernels, False)
            else:
                stack.enter_context(torch_fallbacks(qwen, names))
            model(ids, use_cache=False, logits_to_keep=1)

    def op(ours: bool):
        with torch.no_grad():
            if ours:
                ops.chunk_gated_delta_rule(q, k, v, g, beta, scale=d ** -0.5, use_qk_l2norm_in_kernel=False)
            else:
                torch_op(q, k, v, g=g, beta=beta, chunk_size=64, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False)

    cases = {"prefill, transformers' torch path": lambda: prefill(False),
             "prefill, use_fastweights_kernels()": lambda: prefill(True),
             "gated delta op, transformers' torch_chunk_gated_delta_rule": lambda: op(False),
             "gated delta op, fastweights chunk_gated_delta_rule": lambda: op(True)}
    timer = CLOCKS[clock]
    times: Dict[str, List[float]] = {n: [] for n in cases}
    for fn in cases.values():  # warm-up (and the kernels' build, if any)
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = timer()
            fn()
            times[name].append(timer() - t0)
    best = {n: min(ts) for n, ts in times.items()}
    names = list(cases)
    total_torch, total_ours, op_torch, op_ours = (best[n] for n in names)
    layers_linear = sum(t == "linear_attention" for t in cfg.layer_types)
    op_in_prefill = layers_linear * op_torch  # the op runs once per linear-attention layer
    share = op_in_prefill / total_torch
    bound = total_torch / (total_torch - op_in_prefill + layers_linear * op_ours)
    return {
        "model": "Qwen3NextForCausalLM (random weights)", "config": {
            "layers": layers, "layer_types": cfg.layer_types, "hidden_size": cfg.hidden_size,
            "linear_key_heads": h_k, "linear_value_heads": h_v, "head_dim": d, "num_experts": cfg.num_experts,
            "experts_per_token": cfg.num_experts_per_tok, "vocab_size": cfg.vocab_size},
        "tokens": tokens, "threads": threads, "clock": clock, "repeats": repeats, "cpu_path": cpu_kernels.status(),
        "seconds_min": best, "prefill_speedup": total_torch / total_ours, "op_speedup": op_torch / op_ours,
        "op_share_of_torch_prefill": share, "amdahl_bound_from_the_op": bound,
        "load_average": os.getloadavg(),
    }


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run hf_prefill``."""

    tokens: int = field(default=2048, metadata=flag(type=int, help="default 2048"))
    layers: int = field(default=4, metadata=flag(type=int, help="default 4"))
    repeats: int = field(default=3, metadata=flag(type=int, help="default 3"))
    threads: int = field(default=1, metadata=flag(type=int, help="default 1"))
    clock: str = field(default="cpu", metadata=flag(choices=sorted(CLOCKS), help="default cpu"))
    json: Optional[str] = field(default=None, metadata=flag(help="where to write the result (default: print only)"))


def main(args: Config) -> int:
    result = run(args.tokens, args.layers, args.repeats, args.threads, args.clock)
    for name, s in result["seconds_min"].items():
        print(f"{name:60s} {s:8.3f} s")
    print(f"prefill speed-up {result['prefill_speedup']:.2f}x; op speed-up {result['op_speedup']:.2f}x; "
          f"op share of the torch prefill {result['op_share_of_torch_prefill']:.2f}; "
          f"bound from the op alone {result['amdahl_bound_from_the_op']:.2f}x ({result['cpu_path']})")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1))
    return 0

