"""The benchmarks of fastweights: one module per question, one registry, one runner.

Run from the repository root (they are not part of the installed package)::

    python -m benchmarks.run --list                      # every benchmark and what it measures
    python -m benchmarks.run chunk_speed --T 2048        # one, with its flags
    python -m benchmarks.run form_errors family_speed    # several, each with its defaults
    make bench                                           # fastweights bench: chunk_speed + roofline

Every benchmark module declares its flags the way the studies do (:mod:`fastweights.config`):
a ``Config`` dataclass whose fields carry :func:`~fastweights.config.flag` metadata, and a
``main(config)`` that runs it and returns an exit code. The runner builds the command line from
the ``Config``; ``fastweights bench`` calls the same modules through :data:`REGISTRY`.

Results are written as JSON (``docs/results/*.json`` by default, or ``--json PATH``);
BENCHMARKS.md shows the newest figures, one table per question, each with its command and machine.
"""

#: name -> what it measures. The module is ``benchmarks.<name>``.
REGISTRY = {
    "chunk_speed": "the delta rule's chunk path: recurrent vs textbook chunk vs fast chunk, then the roofline: the "
                   "machine's matmul and copy limits and the chunk ops' share of them (fastweights bench; --roofline-only)",
    "lm_speed": "the LM per mixer: a training step and a decoding step (fastweights bench --lm)",
    "cpu_table": "the CPU speed table: chunk ops against the fp32 matmul rate and other implementations",
    "cpu_peers": "the gated delta rule against what a CPU user would otherwise run (fastweights bench --cpu-peers)",
    "compile_speed": "torch.compile against eager, and its graph breaks",
    "grad_checkpointing": "memory and time of a training step with and without checkpointing",
    "form_errors": "how far each fast form is from the float64 recurrence",
    "kda_speed": "Kimi Delta Attention: chunk vs recurrent speed, every form's errors",
    "family_speed": "GDN-2, DeltaProduct and the DPLR rule: chunk vs recurrent speed",
    "gdn2_speed": "GDN-2's compiled CPU chunk forward against the recurrence, the PyTorch chunk form and the fp32 "
                  "matmul rate",
    "gpu_chunk_delta": "the Triton chunk kernels and decode step on a GPU",
    "triton_resources": "every Triton kernel config compiled for sm_90 fits the hardware",
    "speculative": "verify windows: the chunk/recurrent crossover k; prompt lookup vs greedy",
    "serving": "continuous batching: sessions in a pool of fixed-size states",
    "hf_prefill": "a transformers hybrid model's prefill on our kernels against its own fallbacks",
    "check_cost": "the ops' input checks per call, eager and under torch.compile",
    "data_memory": "peak RSS of eval --tokens N and train --data against the file size",
    "context_parallel": "an LM training step under context parallelism, by tokens and processes",
    "cp_communication": "bytes per layer under context parallelism against all-gathering K, V",
}

#: Modules that are not benchmarks of their own: the measuring code others share.
#: ``roofline``: the FLOP counts, the machine's limits and the interleaved timer (``chunk_speed --roofline-only``).
SHARED = ("roofline",)

#: Marks this folder as fastweights' benchmarks (``fastweights bench`` checks it before using it).
FASTWEIGHTS_BENCHMARKS = True
