"""Continuous batching on the CPU: sessions in a pool of fixed-size states, measured.

Usage (repository root)::

    python -m benchmarks.run serving                 # the full run (a few minutes on 2 cores)
    python -m benchmarks.run serving --quick         # tiny sizes (the test suite runs this)

A DeltaNet LM and a softmax LM of the same size (``--d-model`` 256, 4 layers, 4 heads,
vocabulary 256, fp32, random weights: serving cost does not depend on what was learnt):

1. **throughput**: a :class:`~fastweights.models.pool.SessionPool` of 256 slots; N live
   sessions (N = 1 … 256, at random slots) decode ``--steps`` tokens together, one batched
   step per token. tokens/s = N · steps / time (median of ``--repeats``).
2. **arrivals**: sessions arrive (Poisson, ``--rate`` per step), each prefilled from a stored
   system prompt (fork + its own turn) into a free slot, decode a random number of tokens
   and leave; tokens/s over the run, and the most sessions live at once.
3. **memory**: bytes for S sessions at context T: the DeltaNet pool (measured:
   ``SessionPool.nbytes`` holding sessions that read T tokens) and the softmax LM's KV cache
   for one session that read T tokens (measured: ``LMCache.nbytes`` after the prefill), each
   beside the calculator's prediction (:func:`fastweights.studies.costs.predicted_lm_cache_bytes`).
4. **TTFT**: time to the first token of a turn of ``--turn`` tokens after a ``--prefix``-token
   system prompt: cold (prefill prompt + turn) and warm (fork the stored prompt's cache, prefill
   the turn); the two first tokens are checked to be the same.
5. **the pool step of the op**: ``gated_delta_rule_step(..., state_indices=slots)`` on a pool of 256
   states (H 4, K = V = 128, fp32), N sessions at random slots, in place at the slots (the compiled
   kernel on the CPU) against gathering the N states, stepping them and scattering them back
   (what a layer that takes one state per row needs); best of 30.
6. **prompt lookup on transformers' Qwen3-Next** routed onto our ops (``use_fastweights_kernels``;
   needs transformers): a Qwen3-Next (hidden 256, 3 linear-attention layers and 1 full,
   vocabulary 1024, 4 experts) trained for ``--lookup-train-steps`` steps (about a CPU minute)
   on a repetitive text (8 "verses" of 24 tokens in random order), so that its greedy
   continuation follows the text it has read, greedily generates ``--lookup-new`` tokens after a
   repetitive prompt (three verses, the model's own greedy continuation of them, the three verses
   again), plainly and with ``prompt_lookup_num_tokens`` = ``--lookup-k``; tokens/s of both, the
   speed-up, the share of drafted tokens accepted and whether the tokens are identical. The same
   with random weights, whose continuation does not follow its prompt, beside it.

Timing: ``--clock cpu`` (the default) is time.process_time, the CPU seconds of the process,
with one thread (``--threads 1``): on a shared, oversubscribed machine wall time mostly
measures the scheduler; ``--clock wall`` is time.perf_counter (on an idle machine, with
more threads). Writes ``docs/results/serving.json`` (atomic).
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn.functional as F

from fastweights.config import atomic_write_text, flag
from fastweights.models import LM, LMConfig, fork_cache, store_prefix
from fastweights.models.pool import SessionPool
from fastweights.studies.costs import predicted_lm_cache_bytes

DEFAULT_JSON = "docs/results/serving.json"
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["cpu"]
SESSIONS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _config(mixer: str, d_model: int, vocab: int, max_seq_len: int) -> LMConfig:
    return LMConfig(vocab_size=vocab, d_model=d_model, n_layers=4, n_heads=4, mixer=mixer, max_seq_len=max_seq_len)


def _model(config: LMConfig, seed: int = 0) -> LM:
    torch.manual_seed(seed)
    return LM(config).eval()


def throughput(model: LM, sessions, slots: int, steps: int, repeats: int, seed: int = 0) -> List[Dict]:
    """tokens/s of N sessions decoding together from random slots of a ``slots``-slot pool."""
    gen = torch.Generator().manual_seed(seed)
    pool = SessionPool(model, slots)
    vocab = model.config.vocab_size
    with torch.no_grad():
        _, cache = model(torch.randint(0, vocab, (1, 16), generator=gen))
    for _ in range(slots):
        pool.admit(cache)
    rows = []
    for n in sessions:
        if n > slots:
            continue
        idx = torch.randperm(slots, generator=gen)[:n]
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        pool.step(tokens, idx)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = _clock()
            for _ in range(steps):
                tokens = pool.step(tokens, idx).argmax(-1)
            times.append(_clock() - t0)
        t = statistics.median(times)
        rows.append({"sessions": n, "steps": steps, "seconds": t, "tokens_per_s": n * steps / t,
                     "ms_per_step": 1e3 * t / steps})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_one_session"] = r["tokens_per_s"] / base
    return rows


def arrivals(model: LM, slots: int, steps: int, rate: float, prefix_len: int, turn: int, max_new: int,
             seed: int = 0) -> Dict:
    """Sessions arrive, decode and leave; each starts from the stored system prompt."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    pool = SessionPool(model, slots)
    with torch.no_grad():
        _, prefix = model(torch.randint(0, vocab, (1, prefix_len), generator=gen))
    stored = store_prefix(prefix)
    live: Dict[int, List[int]] = {}  # slot -> [tokens left, last token]
    decoded = admitted = peak = 0
    t0 = _clock()
    for _ in range(steps):
        arriving = sum(1 for _ in range(8) if rng.random() < rate / 8)
        for _ in range(arriving):
            if not pool.free:
                break
            with torch.no_grad():
                logits, cache = model(torch.randint(0, vocab, (1, turn), generator=gen), fork_cache(stored))
            slot = pool.admit(cache)
            live[slot] = [rng.randint(1, max_new), int(logits[0, -1].argmax())]
            admitted += 1
        if not live:
            continue
        peak = max(peak, len(live))
        slots_now = torch.tensor(sorted(live))
        tokens = torch.tensor([live[s][1] for s in slots_now.tolist()])
        nxt = pool.step(tokens, slots_now).argmax(-1)
        decoded += len(slots_now)
        for s, t in zip(slots_now.tolist(), nxt.tolist()):
            live[s][0] -= 1
            live[s][1] = t
            if live[s][0] == 0:
                del live[s]
                pool.release(s)
    seconds = _clock() - t0
    return {"steps": steps, "rate_per_step": rate, "admitted": admitted, "decoded_tokens": decoded,
            "peak_live_sessions": peak, "seconds": seconds, "tokens_per_s": decoded / seconds}


def memory(delta: LM, softmax: LM, contexts, sessions: int, seed: int = 0) -> List[Dict]:
    """Measured bytes: the DeltaNet pool holding ``sessions`` sessions that read T tokens, and one
    softmax session's cache after T tokens; each beside the calculator."""
    gen = torch.Generator().manual_seed(seed)
    vocab = delta.config.vocab_size
    rows = []
    for t in contexts:
        ids = torch.randint(0, vocab, (1, t), generator=gen)
        with torch.no_grad():
            _, d_cache = delta(ids)
            _, s_cache = softmax(ids)
        pool = SessionPool(delta, sessions)
        for _ in range(sessions):
            pool.admit(fork_cache(d_cache))
        rows.append({
            "context": t, "sessions": sessions,
            "deltanet_pool_bytes": pool.nbytes,
            "deltanet_pool_bytes_calculator": predicted_lm_cache_bytes(delta.config, sessions, t),
            "softmax_one_session_bytes": s_cache.nbytes,
            "softmax_one_session_bytes_calculator": predicted_lm_cache_bytes(softmax.config, 1, t),
            "softmax_sessions_bytes_calculator": predicted_lm_cache_bytes(softmax.config, sessions, t),
        })
        rows[-1]["pool_below_one_softmax_session"] = pool.nbytes < s_cache.nbytes
    return rows


def ttft(model: LM, prefix_len: int, turn: int, repeats: int, seed: int = 0) -> Dict:
    """Time to first token: cold (prompt + turn prefilled) and warm (stored prompt forked, turn prefilled)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prefix_len), generator=gen)
    user = torch.randint(0, vocab, (1, turn), generator=gen)
    with torch.no_grad():
        _, prefix = model(prompt)
        stored = store_prefix(prefix)

        def cold():
            return model(torch.cat([prompt, user], dim=1), return_cache=False)[0][0, -1].argmax()

        def warm():
            return model(user, fork_cache(stored))[0][0, -1].argmax()

        first = (int(cold()), int(warm()))
        times = {"cold": [], "warm": []}
        for _ in range(repeats):  # interleaved
            for name, fn in (("cold", cold), ("warm", warm)):
                t0 = _clock()
                fn()
                times[name].append(_clock() - t0)
    cold_s, warm_s = (statistics.median(times[k]) for k in ("cold", "warm"))
    return {"prefix_tokens": prefix_len, "turn_tokens": turn, "cold_ms": 1e3 * cold_s, "warm_ms": 1e3 * warm_s,
            "speedup": cold_s / warm_s, "same_first_token": first[0] == first[1],
            "stored_prefix_bytes": stored.nbytes}


def pool_step(sessions, slots: int = 256, heads: int = 4, dim: int = 128, repeats: int = 30) -> List[Dict]:
    """The op's pool step in place at the slots against gather + step + scatter, per N sessions."""
    from fastweights.ops import gated_delta_rule_step
    from fastweights.ops.state_pool import gather_states, scatter_states

    pool = torch.randn(slots, heads, dim, dim, generator=torch.Generator().manual_seed(0))

    def best(fn):
        times = []
        for _ in range(repeats):
            t0 = _clock()
            fn()
            times.append(_clock() - t0)
        return min(times)

    rows = []
    for n in sessions:
        gen = torch.Generator().manual_seed(n)
        q, k = torch.randn(n, heads, dim, generator=gen), F.normalize(torch.randn(n, heads, dim, generator=gen), dim=-1)
        v, beta, g = torch.randn(n, heads, dim, generator=gen), torch.rand(n, heads, generator=gen), -torch.rand(n, heads, generator=gen)
        idx = torch.randperm(slots, generator=gen)[:n]

        def gathered():
            h = gather_states(pool, idx)
            _, h = gated_delta_rule_step(q, k, v, beta, g, h, inplace=True)
            scatter_states(pool, idx, h)

        in_place = best(lambda: gated_delta_rule_step(q, k, v, beta, g, pool, state_indices=idx))
        copied = best(gathered)
        rows.append({"sessions": n, "state_mib": n * heads * dim * dim * 4 / 2**20, "in_place_us": 1e6 * in_place,
                     "gather_step_scatter_us": 1e6 * copied, "ratio": copied / in_place})
    return rows


def _repeat_corpus(vocab: int, verses: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``[verses, length]`` distinct token ids: the "verses" of a repetitive text (a text made of
    whole verses in any order: within a verse every token follows from the one before)."""
    return torch.randperm(vocab - 1, generator=gen)[: verses * length].add(1).view(verses, length)


def _train_to_repeat(model, corpus: torch.Tensor, steps: int, gen: torch.Generator, batch: int = 8,
                     per_row: int = 6, lr: float = 3e-3) -> Dict:
    """Train ``model`` (a transformers causal LM) for ``steps`` AdamW steps on rows of ``per_row``
    random verses of ``corpus``: a minute's training that makes its greedy continuation follow
    the text it has read (within a verse; the next verse is a guess). Returns the last loss and
    the CPU seconds spent."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    t0, loss = time.process_time(), None
    for _ in range(steps):
        rows = corpus[torch.randint(0, corpus.shape[0], (batch, per_row), generator=gen)].reshape(batch, -1)
        loss = model(input_ids=rows, labels=rows).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return {"train_steps": steps, "train_loss": None if loss is None else loss.item(),
            "train_cpu_s": time.process_time() - t0}


def routed_lookup(new_tokens: int, k: int, repeats: int, train_steps: int = 0, seed: int = 0) -> Dict:
    """Greedy vs prompt lookup on a routed Qwen3-Next, on a prompt whose continuation repeats.

    With ``train_steps`` the model is first trained on a repetitive text (:func:`_train_to_repeat`),
    so that its greedy continuation of a prompt made of that text follows the text, as a model
    quoting its context does; with 0 its weights are random. The prompt is a seed (three verses),
    the model's own greedy continuation of it, and the seed again. The acceptance rate is the
    share of the drafted tokens the model kept: (new tokens − forwards) / drafted tokens, counted
    from the forwards' inputs (every forward keeps one token of its own beyond the accepted ones).
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from fastweights.hf import use_fastweights_kernels

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, max_position_embeddings=1024,
    )
    use_fastweights_kernels()
    try:
        model = Qwen3NextForCausalLM(cfg).eval()
        gen = torch.Generator().manual_seed(seed)
        corpus = _repeat_corpus(cfg.vocab_size, 8, 24, gen)
        trained = _train_to_repeat(model, corpus, train_steps, gen) if train_steps else {"train_steps": 0}
        greedy = dict(do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
        seed_ids = corpus[torch.randint(0, corpus.shape[0], (3,), generator=gen)].reshape(1, -1)
        inputs: List[int] = []  # the length of every forward's input_ids (a verify: 1 + its drafts)
        hook = model.register_forward_pre_hook(
            lambda module, args, kwargs: inputs.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
        with torch.no_grad():
            continuation = model.generate(seed_ids, **greedy)[:, seed_ids.shape[1]:]
            prompt = torch.cat([seed_ids, continuation, seed_ids], dim=1)
            out, times = {}, {"greedy": [], "lookup": []}
            for _ in range(repeats):  # interleaved
                for name, extra in (("greedy", {}), ("lookup", {"prompt_lookup_num_tokens": k})):
                    inputs.clear()
                    t0 = _clock()
                    out[name] = model.generate(prompt, **greedy, **extra)
                    times[name].append(_clock() - t0)
        hook.remove()
    finally:
        use_fastweights_kernels(False)
    g, lk = (statistics.median(times[n]) for n in ("greedy", "lookup"))
    made = out["greedy"].shape[1] - prompt.shape[1]
    forwards = len(inputs)  # of the last lookup run
    drafted = (inputs[0] - prompt.shape[1]) + sum(n - 1 for n in inputs[1:]) if inputs else 0
    accepted = out["lookup"].shape[1] - prompt.shape[1] - forwards
    weights = f"trained {train_steps} steps on a repetitive text" if train_steps else "random"
    return {"model": f"Qwen3-Next ({weights}; hidden 256, 3 linear + 1 full attention layers)", "prompt_tokens":
            prompt.shape[1], "new_tokens": made, "k": k, "greedy_tokens_per_s": made / g,
            "lookup_tokens_per_s": made / lk, "speedup": g / lk, "identical": bool(torch.equal(out["greedy"], out["lookup"])),
            "lookup_forwards": forwards, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, **trained}


def run(args) -> Dict:
    global _clock
    _clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    sessions = [n for n in SESSIONS if n <= args.slots]
    delta = _model(_config("deltanet", args.d_model, args.vocab, max(contexts) + 8))
    softmax = _model(_config("softmax", args.d_model, args.vocab, max(contexts) + 8))
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "clock": args.clock, "torch": torch.__version__, "python": sys.version.split()[0]},
        "model": {"d_model": args.d_model, "n_layers": 4, "n_heads": 4, "vocab_size": args.vocab, "dtype": "float32",
                  "deltanet_params": delta.num_parameters(), "softmax_params": softmax.num_parameters()},
        "throughput": throughput(delta, sessions, args.slots, args.steps, args.repeats),
        "arrivals": arrivals(delta, args.slots, args.arrival_steps, args.rate, args.prefix, args.turn, args.max_new),
        "memory": memory(delta, softmax, contexts, args.memory_sessions),
        "ttft": ttft(delta, args.prefix, args.turn, args.repeats),
        "pool_step": pool_step([n for n in (1, 16, 64) if n <= args.slots], slots=args.slots),
    }
    if args.lookup_new:
        try:
            import transformers  # noqa: F401
        except ImportError:
            result["prompt_lookup"] = result["prompt_lookup_random_weights"] = None
        else:
            result["prompt_lookup"] = routed_lookup(args.lookup_new, args.lookup_k, args.repeats, args.lookup_train_steps)
            result["prompt_lookup_random_weights"] = routed_lookup(args.lookup_new, args.lookup_k, args.repeats)
    return result


def table(result: Dict) -> str:
    """Markdown tables of a result (BENCHMARKS.md)."""
    lines = ["| live sessions | ms / step | tokens/s | vs 1 session |", "|---:|---:|---:|---:|"]
    for r in result["throughput"]:
        lines.append(f"| {r['sessions']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | {r['vs_one_session']:.1f}× |")
    lines += ["", "| context | DeltaNet pool, S sessions (measured / calculator) | softmax, 1 session (measured / "
              "calculator) | softmax, S sessions (calculator) |", "|---:|---:|---:|---:|"]
    for r in result["memory"]:
        lines.append(f"| {r['context']} | {r['sessions']} × : {r['deltanet_pool_bytes'] / 2**20:.2f} / "
                     f"{r['deltanet_pool_bytes_calculator'] / 2**20:.2f} MiB | {r['softmax_one_session_bytes'] / 2**20:.2f} / "
                     f"{r['softmax_one_session_bytes_calculator'] / 2**20:.2f} MiB | "
                     f"{r['softmax_sessions_bytes_calculator'] / 2**20:.1f} MiB |")
    t, a = result["ttft"], result["arrivals"]
    lines += ["", f"TTFT, {t['prefix_tokens']}-token system prompt + {t['turn_tokens']}-token turn: cold "
              f"{t['cold_ms']:.1f} ms, from the cached prefix {t['warm_ms']:.1f} ms ({t['speedup']:.1f}×; same first "
              f"token: {t['same_first_token']}).",
              f"Arrivals: {a['admitted']} sessions over {a['steps']} steps, at most {a['peak_live_sessions']} live, "
              f"{a['tokens_per_s']:.0f} decoded tokens/s (prefills included in the time)."]
    if result.get("pool_step"):
        lines += ["", "| sessions (state) | pool step in place at the slots | gather + step + scatter | ratio |",
                  "|---:|---:|---:|---:|"]
        for r in result["pool_step"]:
            lines.append(f"| {r['sessions']} ({r['state_mib']:.1f} MiB) | {r['in_place_us']:.0f} µs | "
                         f"{r['gather_step_scatter_us']:.0f} µs | {r['ratio']:.1f}× |")
    for key in ("prompt_lookup", "prompt_lookup_random_weights"):
        lk = result.get(key)
        if lk:
            rate = "n/a" if lk.get("acceptance_rate") is None else f"{100 * lk['acceptance_rate']:.0f}%"
            lines += ["", f"Prompt lookup (k = {lk['k']}) on {lk['model']}, routed onto fastweights' ops, "
                      f"{lk['new_tokens']} tokens after a {lk['prompt_tokens']}-token repetitive prompt: greedy "
                      f"{lk['greedy_tokens_per_s']:.1f} tokens/s, prompt lookup {lk['lookup_tokens_per_s']:.1f} tokens/s "
                      f"({lk['speedup']:.2f}×; {lk.get('lookup_forwards', '?')} forwards, {rate} of "
                      f"{lk.get('drafted_tokens', '?')} drafted tokens accepted; identical tokens: {lk['identical']})."]
    return "\n".join(lines)


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run serving``."""

    quick: bool = field(default=False, metadata=flag(action="store_true", help="tiny sizes (seconds): what the test suite runs"))
    d_model: int = field(default=256, metadata=flag(type=int, help="default 256"))
    vocab: int = field(default=256, metadata=flag(type=int, help="default 256"))
    slots: int = field(default=256, metadata=flag(type=int, help="default 256"))
    steps: int = field(default=16, metadata=flag(type=int, help="decode steps per throughput measurement"))
    repeats: int = field(default=3, metadata=flag(type=int, help="default 3"))
    contexts: str = field(default="512,1024,2048,4096", metadata=flag(help="default 512,1024,2048,4096"))
    memory_sessions: int = field(default=64, metadata=flag(type=int, help="default 64"))
    arrival_steps: int = field(default=200, metadata=flag(type=int, help="default 200"))
    rate: float = field(default=1.0, metadata=flag(type=float, help="sessions arriving per decode step, on average"))
    max_new: int = field(default=64, metadata=flag(type=int, help="default 64"))
    prefix: int = field(default=1024, metadata=flag(type=int, help="system prompt tokens"))
    turn: int = field(default=32, metadata=flag(type=int, help="user turn tokens"))
    lookup_new: int = field(default=64, metadata=flag(type=int, help="prompt lookup: new tokens (0: skip it)"))
    lookup_k: int = field(default=8, metadata=flag(type=int, help="prompt lookup: proposals per round"))
    lookup_train_steps: int = field(default=40, metadata=flag(
        type=int, help="prompt lookup: training steps on a repetitive text before measuring (about a CPU minute)"))
    threads: int = field(default=1, metadata=flag(type=int, help="torch threads (0: as torch has them)"))
    clock: str = field(default="cpu", metadata=flag(choices=sorted(CLOCKS), help="default cpu"))
    json: str = field(default=DEFAULT_JSON, metadata=flag(help=f"where to write the result (default {DEFAULT_JSON}; empty: nowhere)"))


def main(args: Config) -> int:
    if args.quick:
        args.d_model, args.vocab, args.slots, args.steps, args.repeats = 32, 64, 8, 2, 1
        args.contexts, args.memory_sessions, args.arrival_steps, args.max_new = "64,128", 4, 10, 4
        args.prefix, args.turn, args.lookup_new = 40, 5, 0
    result = run(args)
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0

