"""HF transformers backend: a Policy and a RolloutEngine for any causal LM (Qwen3 first)."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

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


def require_files(directory: Path, names: Sequence[str]) -> None:
    """Raise ``FileNotFoundError`` naming every file of ``names`` that ``directory`` lacks."""
    missing = [name for name in names if not (Path(directory) / name).exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is missing {', '.join(missing)}")


class HFPolicy:
    """Trains an HF causal LM in one process: chunked log-probs, AdamW, gradient clipping, bf16 autocast on GPU."""

    data_parallel = DataParallel()

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
        return {"grad_norm": float(grad_norm)}

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


# Roles of generated tokens in the decode loop's buffer.
_NONE, _RATIONALE, _THINK_END, _ANSWER = 0, 1, 2, 3


class HFRolloutEngine:
    """Batched sampling with a thinking budget, in one decode loop over an HF model.

    Each row thinks until it samples ``</think>`` or reaches ``max_thinking_tokens``, where
    ``</think>`` is forced (s1-style budget forcing); then, only if asked, it samples an answer
    until end-of-turn or ``max_answer_tokens``. Rows finish independently; the loop ends when
    all have. Sampling uses the caller's ``torch.Generator``, so rollouts are reproducible.
    """

    def __init__(self, model: Any, *, think_end_id: int, end_of_turn_id: int, pad_id: int, device: torch.device,
                 max_thinking_tokens: int, max_answer_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, precision: str = "auto"):
        if max_thinking_tokens < 0 or max_answer_tokens < 1:
            raise ValueError(
                f"need max_thinking_tokens >= 0 and max_answer_tokens >= 1; got {max_thinking_tokens}, {max_answer_tokens}"
            )
        self.model = model
        self.think_end_id, self.end_of_turn_id, self.pad_id = think_end_id, end_of_turn_id, pad_id
        self.device = device
        self.precision = check_precision(precision)
        self.max_thinking_tokens, self.max_answer_tokens = max_thinking_tokens, max_answer_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.tokens_generated = 0

    @torch.inference_mode()
    def generate(self, prompts: Sequence[list[int]], num_samples: int, *, sample_answers: bool,
                 generator: torch.Generator) -> list[list[Rollout]]:
        rows = [list(p) for p in prompts for _ in range(num_samples)]
        n = len(rows)
        width = max(map(len, rows))
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(rows):  # left padding, so every row's next token is at the end
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        phase = torch.zeros(n, dtype=torch.long, device=self.device)  # 0 thinking, 1 answering, 2 done
        thought = torch.zeros(n, dtype=torch.long, device=self.device)
        answered = torch.zeros(n, dtype=torch.long, device=self.device)
        forced = torch.zeros(n, dtype=torch.bool, device=self.device)
        max_steps = self.max_thinking_tokens + 1 + (self.max_answer_tokens if sample_answers else 0)
        tokens = torch.full((n, max_steps), self.pad_id, dtype=torch.long, device=self.device)
        roles = torch.zeros((n, max_steps), dtype=torch.long, device=self.device)

        self.model.eval()
        cache, step_input = None, ids
        for step in range(max_steps):
            with autocast_context(self.device, self.precision):
                out = self.model(input_ids=step_input, attention_mask=mask, position_ids=positions,
                                 past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            token = self._sample(out.logits[:, -1], generator)

            thinking, answering = phase == 0, phase == 1
            force = thinking & (thought >= self.max_thinking_tokens)
            token = torch.where(force, self.think_end_id, token)
            ends_thinking = thinking & (token == self.think_end_id)
            forced |= force
            roles[:, step] = torch.where(
                ends_thinking, _THINK_END, torch.where(thinking, _RATIONALE, torch.where(answering, _ANSWER, _NONE))
            )
            tokens[:, step] = torch.where(phase == 2, self.pad_id, token)
            thought += thinking & ~ends_thinking
            answered += answering
            finished_answer = answering & ((token == self.end_of_turn_id) | (answered >= self.max_answer_tokens))
            phase = torch.where(ends_thinking, 1 if sample_answers else 2, torch.where(finished_answer, 2, phase))
            if bool((phase == 2).all()):
                break
            step_input = tokens[:, step : step + 1]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1

        tokens, roles, forced = tokens.cpu(), roles.cpu(), forced.cpu()
        self.tokens_generated += int((roles != _NONE).sum())
        rollouts = [
            Rollout(
                prompt_ids=rows[i],
                rationale_ids=tokens[i][roles[i] == _RATIONALE].tolist(),
                think_end_forced=bool(forced[i]),
                answer_ids=tokens[i][roles[i] == _ANSWER].tolist() if sample_answers else None,
            )
            for i in range(n)
        ]
        return [rollouts[b * num_samples : (b + 1) * num_samples] for b in range(len(prompts))]

    def _sample(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        logits = logits.float()
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            probs = torch.softmax(sorted_logits, -1)
            drop = probs.cumsum(-1) - probs > self.top_p  # keep the smallest prefix with mass >= top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(logits, -1)
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(1).to(logits.device)
