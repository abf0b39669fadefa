"""Megatron-core backend: Qwen3 as a ``GPTModel`` under tensor (and data) parallelism.

Shaped like Megatron-Bridge: ``provider`` turns an HF ``config.json`` into a ``TransformerConfig``
and builds the model, ``mapping`` converts weights between HF and Megatron layouts per TP rank,
``logprobs`` computes token log-probs from vocab-parallel logits, and ``policy.MegatronPolicy``
implements the same ``Policy`` protocol as ``HFPolicy``.

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
}

__all__ = [*_LAZY_EXPORTS, "transformer_engine_usable"]


@functools.cache
def transformer_engine_usable() -> bool:
    """Whether TE imports; call before importing megatron.core.

    A broken TE install (a CUDA or ABI mismatch) raises ``RuntimeError`` rather than
    ``ImportError``, and megatron.core's optional ``import transformer_engine`` only catches the
    latter, so ``import megatron.core`` itself would fail. In that case TE is marked unimportable
    in ``sys.modules``, which makes megatron.core take its TE-free fallbacks, and a warning says why.
    """
    try:
        importlib.import_module("transformer_engine")
        return True
    except ImportError:
        return False
    except RuntimeError as err:
        warnings.warn(f"Transformer Engine is installed but fails to import ({err}); using megatron-core's local modules")
        for name in ("transformer_engine", "transformer_engine_torch"):
            sys.modules[name] = None  # later imports raise ImportError, which megatron.core handles
        return False


def __getattr__(name: str):
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_LAZY_EXPORTS[name]}")
    return getattr(module, name)
