"""Hugging Face transformers integration (optional extra: ``pip install fastweights[hf]``).

Importing this module needs transformers (nothing else in fastweights does) and
registers the ``"fastweights"`` model type with ``AutoConfig`` and
``AutoModelForCausalLM``::

    import fastweights.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(fastweights.hf.FastWeightsConfig(mixer="deltanet"))
    model.generate(...); Trainer(model=model, ...); model.save_pretrained(path)

- :class:`FastWeightsConfig`, :class:`FastWeightsForCausalLM`, :class:`FastWeightsCache`
  (``modeling.py``);
- :func:`checkpoint_to_hf` / :func:`hf_to_checkpoint`, :func:`lm_to_hf` / :func:`hf_to_lm`
  (``convert.py``; CLI ``fastweights hf export|import``);
- :func:`use_fastweights_kernels` (``kernels.py``): run transformers models that call
  fla's gated delta rule or Kimi Delta Attention (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi
  Linear) and the causal-conv1d kernels on fastweights' ops.
"""

try:
    import transformers  # noqa: F401 -- imported only to fail here, with the install command, when it is missing
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastweights.hf needs the transformers package: pip install 'fastweights[hf]'"
    ) from e

from transformers import AutoConfig, AutoModelForCausalLM

from .convert import checkpoint_to_hf, hf_to_checkpoint, hf_to_lm, lm_to_hf
from .kernels import KERNELS, causal_conv1d_fn, causal_conv1d_update, use_fastweights_kernels
from .modeling import MODEL_TYPE, FastWeightsCache, FastWeightsConfig, FastWeightsForCausalLM, WeightsMismatchError

AutoConfig.register(MODEL_TYPE, FastWeightsConfig, exist_ok=True)
AutoModelForCausalLM.register(FastWeightsConfig, FastWeightsForCausalLM, exist_ok=True)

__all__ = [
    "FastWeightsConfig", "FastWeightsForCausalLM", "FastWeightsCache", "MODEL_TYPE", "WeightsMismatchError",
    "lm_to_hf", "hf_to_lm", "checkpoint_to_hf", "hf_to_checkpoint", "use_fastweights_kernels", "KERNELS",
    "causal_conv1d_fn", "causal_conv1d_update",
]
