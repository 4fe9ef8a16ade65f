"""Benchmarks: one module per measurement, each runnable as ``python -m fastweights.bench.<name>``.

=======================  ==================================================================
module                   what it measures
=======================  ==================================================================
``chunk_speed``          the delta rule's chunk path: recurrent vs textbook chunk vs fast chunk
                         (``fastweights bench``)
``roofline``             the machine's matmul and copy limits, and the chunk ops' and a decode
                         step's share of them (the end of ``fastweights bench``)
``lm_speed``             the LM per mixer: a training step and a decoding step
                         (``fastweights bench --lm``)
``compile_speed``        ``torch.compile`` against eager, and its graph breaks
``grad_checkpointing``   memory and time of a training step with and without checkpointing
``form_errors``          how far each fast form is from the float64 recurrence
``kda_speed``            Kimi Delta Attention: chunk vs recurrent speed, every form's errors
``gpu_chunk_delta``      the Triton chunk kernels and decode step on a GPU
``triton_resources``     every Triton kernel config compiled for sm_90 fits the hardware
``speculative``          verify windows: the chunk/recurrent crossover k; prompt lookup vs greedy
``check_cost``           the ops' input checks per call, eager and under ``torch.compile``
``data_memory``          peak RSS of ``eval --tokens N`` and ``train --data`` against the file size
``cp_communication``     bytes per layer under context parallelism against all-gathering K, V
=======================  ==================================================================

Recorded results are in ``docs/results/``; BENCHMARKS.md reads them.

Before the benchmarks had this package, ``fastweights.bench`` was the chunk-speed module;
its names still resolve here (with a DeprecationWarning) to :mod:`.chunk_speed`.
"""

import importlib as _importlib
import warnings as _warnings


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    module = _importlib.import_module(".chunk_speed", __name__)
    if not hasattr(module, name):
        raise AttributeError(f"module 'fastweights.bench' has no attribute {name!r}")
    _warnings.warn(f"`fastweights.bench.{name}` moved to `fastweights.bench.chunk_speed.{name}`",
                   DeprecationWarning, stacklevel=2)
    return getattr(module, name)
