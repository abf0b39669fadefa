"""Megatron-core backend: Qwen3 as a ``GPTModel`` under tensor (and data) parallelism.

Shaped like Megatron-Bridge: ``provider`` turns an HF ``config.json`` into a ``TransformerConfig``
and builds the model, ``mapping`` converts weights between HF and Megatron layouts per TP rank,
``logprobs`` computes token log-probs under the vocab-parallel LM head (a chunk of positions at a time),
and ``policy.MegatronPolicy`` implements the same ``Policy`` protocol as ``HFPolicy``.

Importing this package imports neither megatron.core nor Transformer Engine (TE): the names below
load on first use, so ``nemo_jq`` works without the ``megatron`` extra installed.
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings

#: Public names and the submodule that defines each; loaded on first attribute access.
_LAZY_EXPORTS = {
    "MegatronPolicy": "policy",
    "Qwen3Architecture": "provider",
    "read_qwen3_config": "provider",
    "transformer_config": "provider",
    "build_gpt_model": "provider",
    "hf_to_megatron": "mapping",
    "megatron_to_hf": "mapping",
    "vocab_parallel_token_logprobs": "logprobs",
    "vocab_parallel_head_logprobs": "logprobs",
}

__all__ = [*_LAZY_EXPORTS, "transformer_engine_status", "transformer_engine_usable"]

# megatron-core warns at import, module by module, that it falls back from Transformer Engine and Apex to its
# own modules: noise in every run's log. What a person needs is said once elsewhere: `nemo-jq doctor` names the
# TE status, and an installed but unusable TE is warned about below.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed", category=UserWarning)


@functools.cache
def transformer_engine_status() -> str:
    """``"usable"``, ``"not installed"``, or ``"unusable (why)"``; call before importing megatron.core.

    Imports ``transformer_engine.pytorch`` itself, what megatron-core's TE layers need: TE's top-level
    package swallows an ``ImportError`` from it (an extension built against another torch: a typical
    result of ``pip install vllm`` into an NGC image), so importing ``transformer_engine`` alone would call
    a broken TE usable. A broken TE can also raise ``OSError`` (a CUDA library ctypes cannot load),
    ``RuntimeError`` or ``AssertionError`` (a version check). In every such case TE is blocked in
    ``sys.modules`` (importing it raises ``ModuleNotFoundError``, which every megatron-core module catches,
    ``tensor_parallel/random.py`` included), so megatron-core takes its TE-free paths and the policy the
    local layer spec: TE is never half-used. A warning says why.
    """
    try:
        importlib.import_module("transformer_engine.pytorch")
        return "usable"
    except ModuleNotFoundError as err:
        if err.name == "transformer_engine":
            return "not installed"
        reason: BaseException = err
    except (ImportError, OSError, RuntimeError, AssertionError) as err:
        reason = err
    why = f"{type(reason).__name__}: {' '.join(str(reason).split())[:200]}"
    warnings.warn(f"Transformer Engine is installed but unusable ({why}); using megatron-core's local modules")
    for name in [name for name in sys.modules if name.split(".")[0] in ("transformer_engine", "transformer_engine_torch")]:
        del sys.modules[name]
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch"):
        sys.modules[name] = None  # later imports raise ModuleNotFoundError
    return f"unusable ({why})"


def transformer_engine_usable() -> bool:
    """Whether TE's PyTorch layers import (see :func:`transformer_engine_status`)."""
    return transformer_engine_status() == "usable"


def __getattr__(name: str):
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_LAZY_EXPORTS[name]}")
    return getattr(module, name)
