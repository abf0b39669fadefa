"""HF transformers backend: a Policy and a RolloutEngine for any causal LM (Qwen3 first)."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from nemo_jq.chat import ChatFormat
from nemo_jq.config import PRECISIONS
from nemo_jq.distributed import DataParallel
from nemo_jq.models.interfaces import LossFn, Rollout, TokenBatch
from nemo_jq.models.logprobs import chunked_token_logprobs



def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    return precision


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast over fp32 master weights on GPU ("auto" or "bf16"); plain fp32 otherwise."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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


def resolve_pretrained(path: str) -> str:
    """A local HF folder (checked to exist and hold config.json), or a hub name passed through."""
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise FileNotFoundError(f"model folder {local} has no config.json")
        return str(local)
    if path.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"model folder {local} does not exist")
    return path


def load_causal_lm(path: str) -> Any:
    """An HF causal LM from a local folder (or a hub name where a network is available), in fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_pretrained(path), dtype=torch.float32)


#: Marks a folder as written by ``HFPolicy.export`` and lists its files, so a later export may replace them.
EXPORT_MARKER = "nemo_jq_export.json"

#: The rollouts' sampling (the paper's and the config's default: temperature 1, no top-k or top-p
#: truncation), written out because ``generate``'s own defaults are greedy decoding, and top_k=50
#: when sampling. Pass ``do_sample=False`` to ``generate`` for greedy decoding.
ROLLOUT_SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def files_of_earlier_export(out_dir: Path) -> list[str]:
    """The files an earlier export left in ``out_dir`` (none if it is missing or empty).

    Refuses anything else, so an export never overwrites or mixes with a user's own files.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"export target {out_dir} is a file: choose another --out or remove it")
    present = {path.name for path in out_dir.iterdir()} if out_dir.exists() else set()
    if not present:
        return []
    marker = out_dir / EXPORT_MARKER
    earlier = [EXPORT_MARKER, *json.loads(marker.read_text())["files"]] if marker.is_file() else []
    if not present <= set(earlier):
        raise ValueError(f"export target {out_dir} holds files that are not from an earlier export: choose another --out or remove it")
    return earlier


def make_readable(folder: Path) -> None:
    """Give group and others read access to ``folder`` and its files, whatever the umask or writer chose."""
    folder.chmod(folder.stat().st_mode | 0o755)
    for path in folder.iterdir():
        path.chmod(path.stat().st_mode | 0o644)


#: The files of an HF policy's checkpoint: weights in HF layout, and the optimizer's state.
WEIGHTS_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.pt"


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


def require_files(directory: Path, names: Sequence[str]) -> None:
    """Raise ``FileNotFoundError`` naming every file of ``names`` that ``directory`` lacks."""
    missing = [name for name in names if not (Path(directory) / name).exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is missing {', '.join(missing)}")


class HFPolicy:
    """Trains an HF causal LM in one process: chunked log-probs, AdamW, gradient clipping, bf16 autocast on GPU."""

    data_parallel = DataParallel()
    #: One process holds the whole model (a refitted rollout engine samples here).
    model_parallel_group = None

    def __init__(self, model: Any, *, device: torch.device, precision: str = "auto", lr: float = 1e-6,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 grad_clip: float = 1.0, logprob_chunk_size: int = 256):
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            raise ValueError("LM heads with a bias are not supported by the chunked log-prob kernel")
        self.model = model.to(device)
        self.device = device
        self.precision = check_precision(precision)
        self.grad_clip = grad_clip
        self.logprob_chunk_size = logprob_chunk_size
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        #: Moves whenever the weights change, so an engine with its own copy knows to refit.
        self.weights_version = 0

    def iter_hf(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights under their HF names, one tensor at a time (what a refitted engine loads)."""
        return iter(self.model.state_dict().items())

    def autocast(self):
        return autocast_context(self.device, self.precision)

    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        batch = batch.to(self.device)
        targets = batch.target_mask
        with self.autocast():
            hidden = self.model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            picked = chunked_token_logprobs(
                hidden[:, :-1][targets],
                self.model.get_output_embeddings().weight,
                batch.input_ids[:, 1:][targets],
                self.logprob_chunk_size,
            )
        out = torch.zeros(targets.shape, dtype=torch.float32, device=self.device)
        return out.index_put((targets,), picked.float())

    def forward_backward(self, micro_batches: Sequence[TokenBatch], loss_fn: LossFn) -> None:
        self.model.train()
        for index, micro in enumerate(micro_batches):
            loss_fn(self.token_logprobs(micro), index).backward()

    def optimizer_step(self) -> dict[str, float]:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_version += 1
        return {"grad_norm": float(grad_norm)}

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def from_loss_stage(self, value: Any) -> Any:
        return value  # one process runs every loss_fn call

    def save(self, directory: Path) -> None:
        """``model.safetensors`` and ``optimizer.pt``."""
        from safetensors.torch import save_model

        save_model(self.model, str(Path(directory) / WEIGHTS_FILE))
        torch.save(self.optimizer.state_dict(), Path(directory) / OPTIMIZER_FILE)

    def load(self, directory: Path, *, with_optimizer: bool = True) -> None:
        from safetensors.torch import load_model

        directory = Path(directory)
        require_files(directory, [WEIGHTS_FILE, *([OPTIMIZER_FILE] if with_optimizer else [])])
        load_model(self.model, str(directory / WEIGHTS_FILE), device=str(self.device))
        self.weights_version += 1
        if with_optimizer:
            self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))

    def export(self, out_dir: Path, tokenizer: Any) -> None:
        """Write the model as an HF folder that plain ``transformers`` code uses as training did (:func:`export_hf_model`)."""
        export_hf_model(self.model, out_dir, tokenizer)


def export_hf_model(model: Any, out_dir: Path, tokenizer: Any) -> None:
    """Write an HF folder where plain ``apply_chat_template`` + ``generate`` behave like training's rollouts.

    The chat template ends the generation prompt in ``<think>\\n`` (thinking on), as training
    prompts do; ``config.json`` and ``generation_config.json`` stop at ``<|im_end|>`` and pad;
    the generation config samples as the rollouts did (``ROLLOUT_SAMPLING``);
    every file is readable by group and others. ``out_dir`` must be missing, empty or an
    earlier export (which is replaced); anything else raises ``ValueError``, untouched.
    """
    _export(out_dir, tokenizer, model.config, model.save_pretrained)


def export_hf_stream(config: Any, tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, tokenizer: Any,
                     max_shard_bytes: int = 5 * 1024**3) -> None:
    """As :func:`export_hf_model`, from HF-named tensors that arrive one at a time (a model that never
    exists whole in this process): safetensors shards of at most ``max_shard_bytes`` and their index,
    as ``save_pretrained`` writes them. ``tensors`` is always consumed to the end, even on an error,
    since other ranks may be producing it collectively."""
    tensors = iter(tensors)
    try:
        _export(out_dir, tokenizer, config, lambda folder: write_safetensors_shards(tensors, folder, max_shard_bytes))
    finally:
        for _ in tensors:
            pass


def write_safetensors_shards(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    files, weight_map, shard, shard_bytes, total = [], {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            files.append(out_dir / f".shard-{len(files)}.safetensors")
            save_file(shard, str(files[-1]), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, len(files) - 1))
            shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name], shard_bytes, total = tensor.detach().cpu().contiguous(), shard_bytes + size, total + size
    flush()
    names = ([WEIGHTS_FILE] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for path, name in zip(files, names):
        path.rename(out_dir / name)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
        (out_dir / f"{WEIGHTS_FILE}.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _export(out_dir: Path, tokenizer: Any, config: Any, write_weights: Callable[[Path], None]) -> None:
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    earlier_files = files_of_earlier_export(out_dir)
    chat = ChatFormat(tokenizer)
    for name in earlier_files:
        (out_dir / name).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)

    write_weights(out_dir)
    stop_ids = [chat.end_of_turn_id]  # and the tokenizer's own eos, where it differs (Qwen3's convention)
    if tokenizer.eos_token_id not in (None, chat.end_of_turn_id):
        stop_ids.append(tokenizer.eos_token_id)
    config = copy.deepcopy(config)
    config.eos_token_id, config.pad_token_id = stop_ids, chat.pad_id
    config.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=stop_ids, pad_token_id=chat.pad_id, **ROLLOUT_SAMPLING).save_pretrained(out_dir)
    original_template = tokenizer.chat_template
    tokenizer.chat_template = chat.chat_template
    try:
        tokenizer.save_pretrained(out_dir)
    finally:
        tokenizer.chat_template = original_template

    written = sorted(path.name for path in out_dir.iterdir() if path.name != EXPORT_MARKER)
    (out_dir / EXPORT_MARKER).write_text(json.dumps({"files": written}, indent=2) + "\n")
    make_readable(out_dir)
