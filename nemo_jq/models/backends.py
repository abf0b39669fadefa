"""Backends by name: each builds the policy and the rollout engine the recipe trains with.

The recipe (``nemo_jq.trainer``) asks for ``model.backend`` here and never branches on which one
it got, as the estimators come from ``nemo_jq.objectives``' registry.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_jq import distributed
from nemo_jq.chat import ChatFormat
from nemo_jq.models.hf import HFPolicy
from nemo_jq.models.interfaces import Policy, RolloutEngine
from nemo_jq.rollouts import IN_PLACE, BudgetedRollouts, build_rollouts


@dataclasses.dataclass(frozen=True)
class BackendRequest:
    """What every backend builds from: the HF causal LM the run starts from, and the run's settings.

    ``load_model()`` builds that model whole in this process; ``model_dir`` is its local HF folder,
    when it has one, which a backend may read shard by shard instead.
    """

    load_model: Callable[[], Any]
    model_dir: Path | None
    config: Any  # nemo_jq.config.Config
    chat: ChatFormat
    device: torch.device


#: Set to 1 by code that has patched megatron-core's CUDA calls for CPU (the tests do, in ``tests/megatron_cpu.py``).
MEGATRON_ON_CPU = "NEMO_JQ_MEGATRON_ON_CPU"

BackendBuilder = Callable[[BackendRequest], "tuple[Policy, RolloutEngine]"]
BACKENDS: dict[str, BackendBuilder] = {}


def register_backend(name: str) -> Callable[[BackendBuilder], BackendBuilder]:
    def register(builder: BackendBuilder) -> BackendBuilder:
        BACKENDS[name] = builder
        return builder

    return register


def build_backend(name: str, request: BackendRequest) -> tuple[Policy, RolloutEngine]:
    if name not in BACKENDS:
        raise ValueError(f"unknown model.backend {name!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[name](request)


def _policy_options(config: Any) -> dict[str, Any]:
    optim = config.optim
    return {"precision": config.model.precision, "lr": optim.lr, "weight_decay": optim.weight_decay,
            "betas": tuple(optim.betas), "eps": optim.eps, "grad_clip": optim.grad_clip,
            "logprob_chunk_size": config.model.logprob_chunk_size}


@register_backend("hf")
def hf_backend(request: BackendRequest) -> tuple[Policy, RolloutEngine]:
    """One process, one device: the policy trains the HF model in place; the native and hf samplers
    decode that same model, vLLM a copy refitted after each step."""
    if distributed.world_size() > 1:
        raise ValueError(f"model.backend=hf trains in one process, but this run has {distributed.world_size()}: "
                         "use model.backend=megatron under torchrun")
    policy = HFPolicy(request.load_model(), device=request.device, **_policy_options(request.config))
    engine = build_rollouts(policy.model, request.config, request.chat, request.device)
    return policy, engine if request.config.rollout.engine in IN_PLACE else RefittedRolloutEngine(engine, policy)


class RefittedRolloutEngine:
    """A rollout engine over its own copy of a policy's weights, refitted from ``policy.iter_hf()``
    whenever ``policy.weights_version`` has moved (after an optimizer step or a weight load).

    The ranks of one model replica (``policy.model_parallel_group``; None in one process) must train
    on the same rollouts: the group's first ``engine.tensor_parallel`` ranks (consecutive: the first
    stage's first tensor-parallel ranks) refit and sample together, in step, and the first of them
    sends the rollouts to the others.
    """

    def __init__(self, engine: BudgetedRollouts, policy: Any):
        self.engine, self.policy, self._version = engine, policy, None

    @property
    def tokens_generated(self) -> int:
        return self.engine.tokens_generated

    def generate(self, prompts, num_samples, *, sample_answers, generator, greedy=False):
        import torch.distributed as dist

        group = self.policy.model_parallel_group
        samplers = [dist.get_global_rank(group, index) for index in range(self.engine.tensor_parallel)] if group is not None else []
        source = samplers[0] if samplers else None
        samples = group is None or dist.get_rank() in samplers
        if self._version != self.policy.weights_version:
            tensors = self.policy.iter_hf()  # a collective over the replica's ranks: all of them consume it
            if samples:
                self.engine.load_weights(tensors)
            for _ in tensors:
                pass
            self._version = self.policy.weights_version
        rollouts = [self.engine.generate(prompts, num_samples, sample_answers=sample_answers, generator=generator,
                                         greedy=greedy) if samples else None]
        if group is not None and dist.get_world_size(group) > 1:
            dist.broadcast_object_list(rollouts, src=source, group=group)
        return rollouts[0]


@register_backend("megatron")
def megatron_backend(request: BackendRequest) -> tuple[Policy, RolloutEngine]:
    """megatron-core's GPTModel on every rank of the world (one rank without torchrun), tensor-, pipeline- and
    data-parallel. From a local HF folder each rank reads only its shard; the rollouts come from the first rank
    of each replica, whose sampler holds the one HF copy (refitted after each step; other ranks hold none).
    """
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_jq.models.megatron import MegatronPolicy
    from nemo_jq.models.megatron.provider import check_parallel_layout, read_qwen3_config

    model = request.config.model
    in_memory = request.load_model() if request.model_dir is None else None
    hf_config = in_memory.config if in_memory is not None else AutoConfig.from_pretrained(request.model_dir)
    check_parallel_layout(read_qwen3_config(hf_config), model.tensor_parallel, model.sequence_parallel,
                          model.pipeline_parallel, model.context_parallel)
    if request.device.type != "cuda" and os.environ.get(MEGATRON_ON_CPU) != "1":
        raise ValueError(
            "model.backend=megatron needs a CUDA device (train.device): megatron-core 0.16.1 calls CUDA in its "
            "rotary embeddings and RNG tracker; on CPU it runs only under the test suite's patches"
        )
    if not dist.is_initialized():  # one process, not started by torchrun
        store = tempfile.NamedTemporaryFile(prefix="nemo_jq_pg_", delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    replica = model.tensor_parallel * model.pipeline_parallel * model.context_parallel
    if dist.get_world_size() % replica:
        raise ValueError(f"model.tensor_parallel={model.tensor_parallel} x model.pipeline_parallel={model.pipeline_parallel} "
                         f"x model.context_parallel={model.context_parallel} does not divide the {dist.get_world_size()} "
                         f"processes: start a multiple of {replica} (torchrun --nproc-per-node)")
    layout = dict(device=request.device, tensor_parallel=model.tensor_parallel, pipeline_parallel=model.pipeline_parallel,
                  context_parallel=model.context_parallel,
                  sequence_parallel=model.sequence_parallel, recompute_activations=model.recompute_activations,
                  distributed_optimizer=model.distributed_optimizer, bf16_weights=model.bf16_weights,
                  **_policy_options(request.config))
    if in_memory is not None:
        policy = MegatronPolicy.from_hf_model(in_memory, **layout)
        sampler_model = in_memory
    else:
        policy = MegatronPolicy.from_hf_folder(request.model_dir, **layout)
        samples = dist.get_rank() == dist.get_global_rank(policy.model_parallel_group, 0)
        with torch.device(request.device if samples else "meta"):  # its weights arrive with the first refit
            sampler_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return policy, RefittedRolloutEngine(build_rollouts(sampler_model, request.config, request.chat, request.device), policy)
