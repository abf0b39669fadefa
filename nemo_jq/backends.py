"""Backends by name: each builds the policy and the rollout engine the recipe trains with.

The recipe asks for ``model.backend`` here and never branches on which one it got, as the estimators
come from ``nemo_jq.objectives``' registry. A backend is one function registered with
:func:`register_backend` that returns a :class:`~nemo_jq.models.interfaces.Policy` and a
:class:`~nemo_jq.models.interfaces.RolloutEngine` (docs/extending.md); both are checked against their
protocols when the backend is built. The built-in backends build their policy (``nemo_jq.models``) and leave how
the engine gets its weights to :func:`nemo_jq.rollouts.wiring.compose_engine`: this module sits above both
packages, so neither imports the other's wiring.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from nemo_jq.data.chat import ChatFormat
from nemo_jq.models.common import autocast_dtype
from nemo_jq.models.hf import HFPolicy
from nemo_jq.models.interfaces import Policy, RolloutEngine, require
from nemo_jq.models.routes import has_experts, routing_replay
from nemo_jq.registry import PluginFailed, Registry, blamed_on_plugin
from nemo_jq.rollouts.wiring import compose_engine
from nemo_jq.runtime import distributed


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
BACKENDS = Registry("backend")
register_backend = BACKENDS.register


def build_backend(name: str, request: BackendRequest) -> tuple[Policy, RolloutEngine]:
    """The backend's policy and rollout engine, checked: a plugin's builder that fails, returns other than the two or
    an object without a member its protocol has is one line naming it (docs/extending.md)."""
    builder = BACKENDS.lookup(name, "model.backend")
    with blamed_on_plugin(builder, f"the builder of backend {name!r}"):
        built = builder(request)
    if not (isinstance(built, tuple) and len(built) == 2):
        raise PluginFailed(f"the builder of backend {name!r} returned {type(built).__name__}: return (policy, engine), the "
                           "policy and the rollout engine that samples from it")
    policy, engine = built
    return (require(policy, Policy, f"the policy of backend {name!r}"),
            require(engine, RolloutEngine, f"the rollout engine of backend {name!r}"))


def policy_options(config: Any) -> dict[str, Any]:
    """The optimizer and precision settings every policy takes, from the run's config."""
    optim = config.optim
    options = {"precision": config.model.precision, "lr": optim.lr, "weight_decay": optim.weight_decay,
               "betas": tuple(optim.betas), "eps": optim.eps, "grad_clip": optim.grad_clip or math.inf,
               "logprob_chunk_size": config.model.logprob_chunk_size}
    return options if optim.name == "adamw" else {**options, "optimizer": optim.name, "momentum": optim.momentum}


@register_backend("hf")
def hf_backend(request: BackendRequest) -> tuple[Policy, RolloutEngine]:
    """One process, one device: the policy trains the HF model in place; the native and hf samplers
    decode that same model (a copy refitted after each step when rollouts are sampled ahead, which sample
    while the policy trains), vLLM its own copy, refitted likewise."""
    if distributed.world_size() > 1:
        raise ValueError(f"model.backend=hf trains in one process, but this run has {distributed.world_size()}: "
                         "use model.backend=megatron to train over several processes")
    compiled = request.config.model.compile and request.device.type == "cuda"
    if request.config.model.compile and not compiled and request.config.train.device == "auto":  # =cpu: said on load
        print(f"nemo-jq: warning: model.compile=true is ignored: this run is on {request.device.type} (it compiles on "
              "a GPU)", file=sys.stderr)
    policy = HFPolicy(request.load_model(), device=request.device, **policy_options(request.config),
                      activation_checkpointing=request.config.model.activation_checkpointing, compiled=compiled)
    routing_replay(request.config, has_experts(policy.model.config))  # refused here, in one line, where asked for
    ahead = request.config.rollout.async_steps > 0
    return policy, engine_for(policy, request, in_place_model=policy.model,
                              own_copy=(lambda: copy.deepcopy(policy.model)) if ahead else None)


def engine_for(policy: Policy, request: BackendRequest, **weights: Any) -> RolloutEngine:
    """The run's rollout engine over ``policy`` (``weights``: :func:`~nemo_jq.rollouts.wiring.compose_engine`'s)."""
    return compose_engine(policy, config=request.config, chat=request.chat, device=request.device,
                          model_dir=request.model_dir, **weights)


@register_backend("megatron")
def megatron_backend(request: BackendRequest) -> tuple[Policy, RolloutEngine]:
    """megatron-core's GPTModel on every rank of the world (one rank without torchrun), laid out as the config's
    ``megatron`` section says. From a local HF folder each rank reads only its shard; the rollouts come from the
    first rank of each replica, whose sampler holds the one HF copy (refitted after each step; other ranks hold none).
    """
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_jq.models.megatron import MegatronPolicy
    from nemo_jq.models.megatron.provider import read_qwen3_config

    layout = request.config.megatron
    in_memory = request.load_model() if request.model_dir is None else None
    hf_config = in_memory.config if in_memory is not None else AutoConfig.from_pretrained(request.model_dir)
    arch = read_qwen3_config(hf_config)
    layout.validate(arch)
    routing_replay(request.config, arch.is_moe)  # a contradiction refused before any weight is read
    if request.device.type != "cuda" and os.environ.get(MEGATRON_ON_CPU) != "1":
        raise ValueError(
            "model.backend=megatron needs a CUDA device (train.device): megatron-core 0.16.1 calls CUDA in its "
            "rotary embeddings and RNG tracker; on CPU it runs only under the test suite's patches (eval, generate "
            "and export of a Megatron run load it with megatron-core too: run them on a GPU node)"
        )
    if not dist.is_initialized():  # one process, not started by torchrun: NCCL on a GPU, as torchrun's ranks use
        store = tempfile.NamedTemporaryFile(prefix="nemo_jq_pg_", delete=False).name
        backend = "nccl" if request.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    layout.validate(world_size=dist.get_world_size())
    settings = dict(device=request.device, **dataclasses.asdict(layout), **policy_options(request.config))
    if in_memory is not None:
        policy = MegatronPolicy.from_hf_model(in_memory, **settings)
    else:
        policy = MegatronPolicy.from_hf_folder(request.model_dir, **settings)
    def sampler_copy():
        """The one HF copy: on the replica's sampling rank, in the compute dtype; other ranks hold none."""
        samples = dist.get_rank() == dist.get_global_rank(policy.model_parallel_group, 0)
        dtype = autocast_dtype(request.device, request.config.model.precision) or torch.float32
        if in_memory is None:
            with torch.device(request.device if samples else "meta"):  # its weights arrive with the first refit
                return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        return in_memory.to(request.device if samples else "meta", dtype=dtype)  # the model built here, moved

    return policy, engine_for(policy, request, own_copy=sampler_copy)
