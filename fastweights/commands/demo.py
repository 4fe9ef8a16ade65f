"""``fastweights demo``: the main job, on an embedded default, in a few CPU minutes.

It trains two language models of equal width and depth -- DeltaNet and linear
attention -- on the built-in associative recall with overwrites (the latest value
written to a key must be returned), prints their accuracies side by side, split
into keys written once and keys overwritten, shows that their decode state does
not grow with the context, and generates answers from the trained models.

The sum rule can only add: an overwritten key reads back a blend of its old and
new values. The delta rule retrieves the old value and replaces it (Schlag et al. 2021).
"""

from __future__ import annotations

import argparse
import os
import time

# The embedded default: about a minute of CPU per model.
DEMO_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "max_seq_len": 1024}
DEMO_TRAIN = {"data": "recall", "steps": 700, "batch_size": 32, "lr": 3e-3, "warmup_steps": 30,
              "eval_every": 100, "eval_batches": 2, "save_every": 0, "seed": 0,
              "threads": 1}  # one thread: these matrices are too small to share, and cores may be busy
MIXERS = ("deltanet", "linear")
FINAL_EVAL_BATCHES = 16


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train DeltaNet and linear attention on recall with overwrites; compare; generate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=DEMO_TRAIN["steps"], help="training steps per model")
    p.add_argument("--out", metavar="DIR", help="also save each trained model under DIR/<mixer> (for `fastweights generate`)")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bars (auto: on a terminal and not under CI)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(DEMO_TRAIN["threads"])
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> int:
    import torch

    from ..models import LM, LMConfig
    from ..tasks import RecallData, step_generator
    from ..training import TrainConfig, save_checkpoint, split_accuracy, train

    start = time.perf_counter()
    train_config = TrainConfig.from_dict({**DEMO_TRAIN, "steps": args.steps})
    data = RecallData(train_config)
    progress = {"auto": None, "on": True, "off": False}[args.progress]
    example = data.task.sample(1, step_generator(99, 0, stream=3)).tokens[0]
    print("fastweights demo: associative recall with overwrites -- the latest value written to a key must be returned")
    print(f"  {train_config.recall_pairs} writes over {train_config.recall_active_keys} keys, then "
          f"{train_config.recall_queries} queries; e.g.\n    {data.decode(example)}")
    print(f"  two LMs, d_model={DEMO_MODEL['d_model']}, {DEMO_MODEL['n_layers']} layers, {DEMO_MODEL['n_heads']} heads, "
          f"{train_config.steps} steps of {train_config.batch_size} sequences each\n")

    results = {}
    for mixer in MIXERS:
        config = LMConfig.from_dict({**DEMO_MODEL, "vocab_size": data.vocab_size, "mixer": mixer})
        result = train(config, train_config, None, progress=progress, desc=f"{mixer:>8}",
                       log=lambda m, mixer=mixer: print(f"  [{mixer}] {m}"))
        model = result.model.eval()
        accuracy, n = split_accuracy(model, data, FINAL_EVAL_BATCHES, seed=1234)
        results[mixer] = (model, accuracy, result)
        if args.out:  # the model and how its tokens are made; no optimizer state (not resumable)
            save_checkpoint(os.path.join(args.out, mixer), model, train={
                "step": train_config.steps, "train_config": train_config.to_dict(), "tokenizer": "recall",
                "evals": result.evals})

    print(f"\nrecall accuracy on {n} fresh queries (argmax of the answer token; chance is 1/{train_config.recall_values}):")
    header = f"  {'mixer':<10}{'params':>9}{'all':>9}{'overwritten':>13}{'written once':>14}{'train s':>9}"
    print(header)
    print("  " + "-" * (len(header) - 2))
    for mixer, (model, acc, result) in results.items():
        print(f"  {mixer:<10}{model.num_parameters():>9,}{acc['all']:>9.3f}{acc['overwritten']:>13.3f}"
              f"{acc['once']:>14.3f}{result.seconds:>9.1f}")
    # the run stops before convergence, so rounding that differs per CPU moves these figures
    print("  (the figures vary between machines by several points: training stops before it converges, and the\n"
          "   compiled kernels round differently per CPU; DeltaNet far above linear attention is the result)")

    print("\ndecode state (bytes) after prefilling a prompt of a given length:")
    softmax = LM(LMConfig.from_dict({**DEMO_MODEL, "vocab_size": data.vocab_size, "mixer": "softmax"})).eval()
    lengths = (40, 1000)
    rows = [(m, results[m][0]) for m in MIXERS] + [("softmax", softmax)]
    with torch.no_grad():
        for name, model in rows:
            sizes = []
            for length in lengths:
                ids = torch.randint(1, data.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
                sizes.append(model(ids)[1].nbytes)
            note = "constant" if sizes[0] == sizes[1] else "grows with the context"
            print(f"  {name:<10}" + "".join(f"{s:>10,} @ {L:<5}" for s, L in zip(sizes, lengths)) + f" {note}")

    print("\ngenerated answers (greedy; prefill with the chunk form, then one recurrent step):")
    batch = data.task.sample(4, step_generator(4321, 0, stream=3))
    cut = 2 * train_config.recall_pairs + 2  # writes, '?', the first queried key
    for i in range(batch.tokens.shape[0]):
        prompt = batch.tokens[i, :cut]
        expected = data.decode(batch.tokens[i, cut:cut + 1])
        answers = []
        for mixer in MIXERS:
            out = results[mixer][0].generate(prompt, 1, temperature=0)
            got = data.decode(out[cut:])
            answers.append(f"{mixer} {got:>2} {'ok' if got == expected else 'x '}")
        print(f"  {data.decode(prompt)} -> expected {expected:>2} | " + " | ".join(answers))
    print(f"\ndemo done in {time.perf_counter() - start:.0f} s")
    return 0
