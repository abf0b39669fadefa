"""HF transformers backend: a Policy over any causal LM (Qwen3 first) in one process."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch

from nemo_jq.models.common import (
    ACCELERATORS,
    WEIGHTS_FILE,
    autocast_context,
    build_optimizer,
    check_precision,
    quiet_weight_files,
)
from nemo_jq.models.export import export_hf_model
from nemo_jq.models.interfaces import LossFn, TokenBatch, backward_each
from nemo_jq.models.logprobs import chunked_token_logprobs
from nemo_jq.precision import recompute_contexts
from nemo_jq.runtime.checkpoint import damaged, load_torch_file, require_files
from nemo_jq.runtime.distributed import DataParallel
from nemo_jq.typed import first_few


def tiny_qwen3(vocab_size: int, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
               intermediate_size: int, max_position_embeddings: int, seed: int) -> Any:
    """A randomly initialised Qwen3 (tied embeddings), for tests and the CPU demo."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config)


def load_causal_lm(folder: Path) -> Any:
    """An HF causal LM from a local folder, in fp32. A weight its ``config.json`` builds that the folder lacks (a layer
    more, an MLP where the weights hold experts) would start random, and one of another shape fails inside
    transformers: either is one ``ValueError`` naming the weights."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    fix = "use the config.json that came with these weights"
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report: what it says is said below, in a line
    with quiet_weight_files():
        try:
            model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
        except RuntimeError as err:  # a shape the name check before loading could not compare (fused experts)
            if "size mismatch" not in str(err) and "mismatched_sizes" not in str(err):
                raise
            raise ValueError(f"model folder {folder}: its config.json does not match its weights "
                             f"({' '.join(str(err).split())[:300]}): {fix}") from None
        finally:
            logging.set_verbosity(verbosity)
    missing, unused = info["missing_keys"], info["unexpected_keys"]
    if unused and not missing:
        print(f"nemo-jq: warning: model folder {folder}: {len(unused)} of its weights are not used by its config.json "
              f"({first_few(sorted(unused))})", file=sys.stderr)
    if missing:
        raise ValueError(f"model folder {folder}: its config.json builds {len(missing)} weight{'s' * (len(missing) > 1)} "
                         f"its weight files lack ({first_few(sorted(missing))}), which "
                         f"would start random: {fix}")
    return model


#: The optimizer state of an HF policy's checkpoint (its weights are ``WEIGHTS_FILE``, in HF layout).
OPTIMIZER_FILE = "optimizer.pt"


def enable_activation_checkpointing(model: Any) -> None:
    """Every decoder layer recomputed in backward from its saved input (non-reentrant ``torch.utils.checkpoint``;
    transformers 5.23 renamed ``gradient_checkpointing_enable``). Without the hook transformers 5 adds that makes the
    embeddings' output require grad (for reentrant checkpoints over frozen embeddings), which would also mark the
    samplers' no-grad forwards of the same model."""
    options = {"use_reentrant": False, "context_fn": recompute_contexts}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    if hasattr(model, "_require_grads_hook"):
        model.disable_input_require_grads()


def hf_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """An HF model's tensors under their names, each once: a tied head once, as the embedding (engines take it from
    there; sent twice, it was a fifth of what Qwen3-0.6B sent)."""
    seen = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor.detach()


class CompiledLayers:
    """While entered, each decoder layer's attention, MLP and norms run compiled (``torch.compile``, shapes dynamic:
    their code is the same in every layer, so one compile serves all). Only the policy's own scoring and training
    enter it: a sampler decoding the same model in place keeps the plain modules (its cache is not the compiler's).
    The layers stay plain, so activation checkpointing wraps them as before; backward is inside it too, so that their
    recomputation runs the compiled code. Re-entrant (scoring inside a training pass)."""

    PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")

    def __init__(self, model: Any):
        self.parts = [(part, torch.compile(part.forward, dynamic=True))
                      for layer in model.get_decoder().layers for part in (getattr(layer, name) for name in self.PARTS)]
        self.depth = 0

    def __enter__(self) -> "CompiledLayers":
        if self.depth == 0:
            for module, forward in self.parts:
                module.forward = forward
        self.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0:
            for module, _ in self.parts:
                del module.forward  # the class's own again


class HFPolicy:
    """Trains an HF causal LM in one process: chunked log-probs, AdamW (or SGD), gradient clipping, bf16 autocast on
    GPU."""

    data_parallel = DataParallel()
    #: One process holds the whole model (a refitted rollout engine samples here).
    model_parallel_group = None
    gathers_over_replicas = False

    def __init__(self, model: Any, *, device: torch.device, precision: str = "auto", lr: float = 1e-6,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 grad_clip: float = 1.0, logprob_chunk_size: int = 256, optimizer: str = "adamw", momentum: float = 0.0,
                 activation_checkpointing: bool = False, compiled: bool = False):
        """``activation_checkpointing``: keep each decoder layer's input only, and run the layer again in backward;
        ``compiled``: score and train with each layer's attention, MLP and norms under ``torch.compile``."""
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            raise ValueError("LM heads with a bias are not supported by the chunked log-prob kernel")
        self.model = model.to(device)
        if activation_checkpointing:
            enable_activation_checkpointing(self.model)
        self.device = device
        self.precision = check_precision(precision)
        self.grad_clip = grad_clip
        self.logprob_chunk_size = logprob_chunk_size
        self.optimizer = build_optimizer(self.model.parameters(), optimizer, lr=lr, weight_decay=weight_decay, betas=betas,
                                         eps=eps, momentum=momentum)
        #: Moves whenever the weights change, so an engine with its own copy knows to refit.
        self.weights_version = 0
        self.compiled = CompiledLayers(self.model) if compiled else None

    def iter_hf(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights under their HF names, one tensor at a time (what a refitted engine loads, or the weight sync
        sends): :func:`hf_tensors`."""
        return hf_tensors(self.model)

    def autocast(self):
        return autocast_context(self.device, self.precision)

    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        batch = batch.to(self.device)
        targets = batch.target_mask
        # Rows are right-padded, so causality alone keeps every real token from the padding: on a GPU the forward
        # takes no padding mask, and attention runs FlashAttention's causal kernel instead of a masked one.
        mask = None if self.device.type in ACCELERATORS else batch.attention_mask
        with self.autocast(), self.compiled or contextlib.nullcontext():
            hidden = self.model.get_decoder()(input_ids=batch.input_ids, attention_mask=mask,
                                              use_cache=False).last_hidden_state  # a cache would hold every layer's K, V
            picked = chunked_token_logprobs(
                hidden[:, :-1][targets],
                self.model.get_output_embeddings().weight,
                batch.input_ids[:, 1:][targets],
                self.logprob_chunk_size,
            )
        out = torch.zeros(targets.shape, dtype=torch.float32, device=self.device)
        return out.index_put((targets,), picked.float())

    def forward_backward(self, micro_batches: Sequence[TokenBatch], loss_fn: LossFn) -> list[dict[str, Any]]:
        self.model.train()
        with self.compiled or contextlib.nullcontext():
            return backward_each(self, micro_batches, loss_fn)

    def optimizer_step(self) -> dict[str, float]:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_version += 1
        return {"grad_norm": float(grad_norm)}

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def save(self, directory: Path) -> None:
        """``model.safetensors`` and ``optimizer.pt``."""
        from safetensors.torch import save_model

        save_model(self.model, str(Path(directory) / WEIGHTS_FILE))
        torch.save(self.optimizer.state_dict(), Path(directory) / OPTIMIZER_FILE)

    def load(self, directory: Path, *, with_optimizer: bool = True) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_model

        directory = Path(directory)
        require_files(directory, [WEIGHTS_FILE, *([OPTIMIZER_FILE] if with_optimizer else [])])
        try:
            load_model(self.model, str(directory / WEIGHTS_FILE), device=str(self.device))
        except SafetensorError as err:  # a file cut short or overwritten: its header does not describe its bytes
            raise damaged(directory / WEIGHTS_FILE, f"truncated or corrupt: {err}") from None
        self.weights_version += 1
        if with_optimizer:
            self.optimizer.load_state_dict(load_torch_file(directory / OPTIMIZER_FILE, weights_only=True))

    def export(self, out_dir: Path, tokenizer: Any) -> None:
        """Write the model as an HF folder that plain ``transformers`` code uses as training did (:func:`export_hf_model`)."""
        export_hf_model(self.model, out_dir, tokenizer)
