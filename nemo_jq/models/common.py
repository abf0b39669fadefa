"""Helpers every backend uses: devices, precision, where a pretrained model lives, and reading its weights."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from nemo_jq.models import OPTIMIZERS, PRECISIONS
from nemo_jq.precision import MetaAutocast


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a device this process has; a CUDA device it lacks is a ``ValueError`` saying why."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # "gpu", "cuda0", ...: torch lists its twenty device types
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # meta, xpu, mps...: the runs are built for these two
        raise ValueError(f"train.device={name} is not a device a run takes: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None else
               f"no GPU is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        raise ValueError(f"train.device={name} but {why} (torch {torch.__version__}): run on a GPU node, or set "
                         "train.device=cpu (or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"train.device={name} but this process sees {torch.cuda.device_count()} GPU(s)")
    return device


def reset_peak_memory(device: torch.device) -> None:
    """Start counting :func:`peak_memory_gib` from now (a step's own peak, not the run's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory torch allocated on ``device`` since :func:`reset_peak_memory` (GiB): what a real run holds
    against ``nemo-jq plan`` and the dry run. None off CUDA (the host's memory is not the GPU's)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    return precision


#: Device types that compute as a GPU does: CUDA, and ``meta``, the dry run's stand-in GPU (``nemo_jq.dryrun``).
ACCELERATORS = ("cuda", "meta")


def new_generator(device: torch.device) -> torch.Generator:
    """A random generator for ``device``; on the dry run's stand-in GPU (``meta``), which has none,
    :class:`StandInGenerator`."""
    return StandInGenerator() if device.type == "meta" else torch.Generator(device)


class StandInGenerator(torch.Generator):
    """The dry run's stand-in GPU's generator: it draws as the host's (its values are never read), and its device and
    state are a GPU generator's kind: ``meta``, 16 bytes (the seed and an offset, as CUDA's). So a state carried to a
    generator of another device type fails in the dry run as it fails on a GPU (issue 43's N1: a CUDA state in a CPU
    generator)."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    def get_state(self) -> torch.Tensor:
        return torch.tensor([self.initial_seed(), 0], dtype=torch.int64).view(torch.uint8)

    def set_state(self, new_state: torch.Tensor) -> StandInGenerator:
        if new_state.numel() != 16:
            raise RuntimeError("Expected a CUDAGeneratorImplState of size 16 but found the input RNG state size to be "
                               f"{new_state.numel()}")
        self.manual_seed(int(new_state.view(torch.int64)[0]))
        return self


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The dtype a forward runs in under ``precision``: bf16 on GPU ("auto") or anywhere ("bf16"); None for fp32."""
    return torch.bfloat16 if precision == "bf16" or (precision == "auto" and device.type in ACCELERATORS) else None


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast over fp32 master weights on GPU ("auto" or "bf16"); plain fp32 otherwise. Without grad (sampling,
    a scoring pass) autocast keeps no weight casts: its cache, which holds the bf16 cast of every weight that requires
    grad until the context ends, saves nothing where each weight is used once, and held a bf16 copy of the whole
    model at a sampler's prefill beside its KV cache (the dry run's meta autocast never cached)."""
    dtype = autocast_dtype(device, precision)
    if dtype is None:
        return contextlib.nullcontext()
    if device.type == "meta":
        return MetaAutocast(dtype)
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=torch.is_grad_enabled())


#: What a run reads of a hub model: its config, tokenizer, weights and generation settings.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]


@contextlib.contextmanager
def quiet_weight_files() -> Iterator[None]:
    """transformers' "Loading weights" and "Writing model shards" bars off while local weight files are read or
    written (two lines each in a batch log, a tenth of an experiment's output); the bars come back after, for the hub's
    downloads. Only around local files: a hub download keeps its bar."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def is_hub_name(path: str) -> bool:
    """Whether ``model.path`` is spelled as a hub model's name (``Qwen/Qwen3-8B``: one slash, no leading ``/``, ``.``
    or ``~``); the disk is not looked at (a local folder so spelled is the caller's to find first)."""
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1


def resolve_pretrained(path: str, *, local_files_only: bool = False) -> Path:
    """``model.path`` as a local HF folder holding config.json: a folder as it is, or a hub name's snapshot in the
    Hugging Face cache (downloaded into it, unless ``local_files_only`` or ``HF_HUB_OFFLINE``). A name the cache
    lacks and the hub cannot give is a one-line error that says how to get it."""
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise FileNotFoundError(f"model folder {local} has no config.json")
        return local
    if not is_hub_name(path):
        raise FileNotFoundError(f"model folder {local} does not exist (model.path is a local folder or a hub name "
                                "like Qwen/Qwen3-8B)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=HUB_FILES, local_files_only=local_files_only))
    except Exception as err:  # noqa: BLE001 - not cached, offline, no network, unknown repository: one message
        raise FileNotFoundError(
            f"model.path={path} is not in the local Hugging Face cache and could not be downloaded "
            f"({type(err).__name__}): download it where there is a network (`hf download {path}`; huggingface-hub "
            f"before 0.34: `huggingface-cli download {path}`; into "
            "the HF_HOME every node reads) or set model.path to a local folder") from None


#: An HF folder's weights (unsharded), and the weights of an HF policy's checkpoint.
WEIGHTS_FILE = "model.safetensors"


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """An HF folder's weights by name (``model.safetensors``, or the shards its index lists), each read
    from its file only when asked for: a model too large for one process is loaded tensor by tensor."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / f"{WEIGHTS_FILE}.index.json"
        if index.exists():
            self.files = {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / WEIGHTS_FILE).exists():
            with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:
                self.files = dict.fromkeys(weights.keys(), folder / WEIGHTS_FILE)
        else:
            raise FileNotFoundError(f"{folder} has neither {WEIGHTS_FILE} nor {WEIGHTS_FILE}.index.json")
        absent = sorted({str(path) for path in self.files.values() if not path.exists()})
        if absent:
            raise FileNotFoundError(f"{index} lists weight files that do not exist: {', '.join(absent)}")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as weights:
            return weights.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def build_optimizer(params: Iterable[torch.nn.Parameter], name: str = "adamw", *, lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, momentum: float = 0.0) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer: AdamW, or plain SGD (with ``momentum``; the paper's theory is gradient flow).

    Its kernels are named from the parameters' device as torch picks them: on a GPU the foreach ones (AdamW's holds
    the square root of its second moment for the whole model at once: as many bytes again as the weights in fp32,
    measured on an H100, bench/results/real_gpu.json), on the host one tensor at a time. Said explicitly, the dry
    run's stand-in GPU (``meta``, where torch would pick the host's kernels) runs and counts what a GPU runs."""
    params = list(params)
    foreach = all(p.device.type != "cpu" for p in params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=foreach)
    if name != "adamw":
        raise ValueError(f"optim.name must be one of {', '.join(OPTIMIZERS)}; got {name!r}")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, foreach=foreach)


_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def checkpoint_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An in-memory HF model's tensors under the names its checkpoint stores them by: a Qwen3-MoE's fused experts
    (transformers 5's ``gate_up_proj [E, 2I, H]``, gate rows first, and ``down_proj [E, H, I]``) one tensor per expert
    (views), the rest as they are (the inverse of :func:`in_memory_target`)."""
    out = {}
    for name, tensor in state.items():
        prefix, fused, kind = name.rpartition(".experts.")
        if not fused or kind not in ("gate_up_proj", "down_proj"):
            out[name] = tensor
        elif kind == "gate_up_proj":
            for j, expert in enumerate(tensor):
                out[f"{prefix}.experts.{j}.gate_proj.weight"], out[f"{prefix}.experts.{j}.up_proj.weight"] = expert.chunk(2)
        else:
            out.update({f"{prefix}.experts.{j}.down_proj.weight": expert for j, expert in enumerate(tensor)})
    return out


def in_memory_target(name: str, state: Mapping[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """Where a checkpoint-named tensor goes in an in-memory HF model's ``state``: its own entry, or for one expert of
    a Qwen3-MoE (checkpoints store ``mlp.experts.{j}.gate_proj.weight``; transformers 5 fuses the experts in memory
    as ``gate_up_proj [E, 2I, H]``, gate rows first, and ``down_proj [E, H, I]``) its slice of the fused tensor. The
    in-memory name and a view to copy into; None where ``state`` has neither."""
    if name in state:
        return name, state[name]
    match = _EXPERT.fullmatch(name)
    if match is None:
        return None
    prefix, expert, kind = match[1], int(match[2]), match[3]
    fused = f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
    if fused not in state:
        return None
    tensor = state[fused][expert]
    if kind != "down_proj":
        tensor = tensor.chunk(2)[kind == "up_proj"]
    return fused, tensor
