"""A backend that is not HF: a bigram table trained in plain torch, sampled from its own refitted copy.

It implements only the protocols (``RefittablePolicy``, and a ``Sampler`` under the budget core), and
registers itself the documented way (docs/extending.md): ``plugins: [this file]`` in a run's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from nemo_jq.backends import BackendRequest, register_backend
from nemo_jq.models.interfaces import TokenBatch, backward_each
from nemo_jq.rollouts import BudgetedRollouts, Sample
from nemo_jq.rollouts.refit import RefittedRolloutEngine
from nemo_jq.runtime.distributed import DataParallel

TABLE = "bigram.pt"


class BigramPolicy:
    data_parallel = DataParallel()
    model_parallel_group = None
    gathers_over_replicas = False

    def __init__(self, vocab_size: int, lr: float):
        self.table = torch.nn.Parameter(torch.zeros(vocab_size, vocab_size))
        self.optimizer = torch.optim.AdamW([self.table], lr=lr)
        self.weights_version = 0

    def token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        logits = self.table[batch.input_ids[:, :-1]]
        picked = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        return picked * batch.target_mask

    def forward_backward(self, micro_batches: Sequence[TokenBatch], loss_fn) -> list[dict[str, Any]]:
        return backward_each(self, micro_batches, loss_fn)

    def optimizer_step(self) -> dict[str, float]:
        norm = torch.nn.utils.clip_grad_norm_([self.table], 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_version += 1
        return {"grad_norm": float(norm)}

    def set_learning_rate(self, lr: float) -> None:
        self.optimizer.param_groups[0]["lr"] = lr

    def save(self, directory: Path) -> None:
        torch.save({"table": self.table.detach(), "optimizer": self.optimizer.state_dict()}, Path(directory) / TABLE)

    def load(self, directory: Path, *, with_optimizer: bool = True) -> None:
        saved = torch.load(Path(directory) / TABLE, weights_only=True)
        with torch.no_grad():
            self.table.copy_(saved["table"])
        if with_optimizer:
            self.optimizer.load_state_dict(saved["optimizer"])
        self.weights_version += 1

    def export(self, out_dir: Path, tokenizer: Any) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save(self.table.detach(), Path(out_dir) / TABLE)

    def iter_hf(self) -> Iterable[tuple[str, torch.Tensor]]:
        return iter([("table", self.table.detach().clone())])


class BigramSampler:
    """Samples its own copy of the table; counts its refits."""

    tensor_parallel = 1

    def __init__(self, vocab_size: int):
        self.table, self.refits = torch.zeros(vocab_size, vocab_size), 0

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in tensors:
            self.table.copy_(tensor)
        self.refits += 1

    def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False) -> list[list[Sample]]:
        groups = []
        for prompt in prompts:
            group = []
            for _ in range(num_samples):
                tokens, logprobs, last = [], [], prompt[-1]
                for _ in range(max_new_tokens):
                    log_probs = torch.log_softmax(self.table[last], -1)
                    last = int(log_probs.argmax()) if greedy else int(torch.multinomial(log_probs.exp(), 1, generator=generator))
                    tokens.append(last)
                    logprobs.append(float(log_probs[last]))
                    if last in stop_ids:
                        break
                group.append(Sample(tokens, tokens[-1] in stop_ids, logprobs))
            groups.append(group)
        return groups


@register_backend("bigram")
def bigram_backend(request: BackendRequest):
    vocab_size = len(request.chat.tokenizer)
    policy = BigramPolicy(vocab_size, request.config.optim.lr)
    rollout = request.config.rollout
    sampler = BudgetedRollouts(BigramSampler(vocab_size), think_end_id=request.chat.think_end_id,
                               end_of_turn_id=request.chat.end_of_turn_id, max_thinking_tokens=rollout.max_thinking_tokens,
                               max_answer_tokens=rollout.max_answer_tokens)
    return policy, RefittedRolloutEngine(sampler, policy)
