"""A Qwen3-MoE's routes: which experts each token went to, as the rollout engine ran it (docs/moe.md, routing replay).

A sampler in bf16 and a trainer in fp32 pick different experts where two router logits nearly tie, so the trainer
would score other experts than the ones that produced a rollout (Megatron-LM issue 4168: ~10% of routers disagree
per forward, and GRPO on Qwen3-30B-A3B collapsed without replaying them). A rollout carries its routes, ``[positions,
layers, top-k]`` uint8 expert ids (128 experts fit), for the positions the engine ran through the model (the prompt,
and every sampled token it fed back); :data:`ROUTE_YOURSELF` marks the others (the last sampled token, a forced
``</think>``, a teacher-forced answer, padding), which the trainer routes itself.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_jq.typed import ConfigError

#: The expert id that says "no route recorded here: let the trainer's router choose" (uint8's largest).
ROUTE_YOURSELF = 255
ROUTES_DTYPE = torch.uint8


def has_experts(hf_config: Any) -> bool:
    """Whether an HF config (a config object, or config.json's mapping) is a mixture of experts this project routes
    (``model_type: qwen3_moe``)."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else getattr(hf_config, "model_type", None)
    return model_type == "qwen3_moe"


def routing_replay(config: Any, experts: bool) -> bool:
    """Whether the run replays the engine's routes (``rollout.routing_replay``; null: for a Qwen3-MoE trained by the
    megatron backend, the one that replays them; the config refuses it on another), or a one-line
    :class:`ConfigError` where it asks for what cannot be."""
    asked = config.rollout.routing_replay
    if asked and not experts:
        model = (f"model.path's model ({config.model.path})" if config.model.path
                 else "the tiny model from scratch (model.path: null)")
        raise ConfigError(f"rollout.routing_replay=true, but {model} has no experts to route (a dense Qwen3): set it to "
                          "null or false")
    return experts and config.model.backend == "megatron" if asked is None else asked


def empty_routes(*shape: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Routes of ``shape`` (``[..., positions, layers, top_k]``) with nothing recorded."""
    return torch.full(shape, ROUTE_YOURSELF, dtype=ROUTES_DTYPE, device=device)


class RouteRecorder:
    """The experts a transformers Qwen3-MoE routes each input token to, per forward: hooks on every layer's router
    (``mlp.gate``, whose forward returns the logits, the top-k weights and the top-k expert ids)."""

    def __init__(self, model: Any):
        self.gates = [layer.mlp.gate for layer in model.get_decoder().layers]
        text = model.config.get_text_config(decoder=True)
        if text.num_experts > ROUTE_YOURSELF:
            raise ConfigError(f"rollout.routing_replay: {text.num_experts} experts do not fit the routes' uint8 ids "
                              f"(at most {ROUTE_YOURSELF}): set rollout.routing_replay=false")
        self.top_k = text.num_experts_per_tok
        self._seen: list[torch.Tensor | None] = [None] * len(self.gates)
        self._hooks = [gate.register_forward_hook(self._hook(index)) for index, gate in enumerate(self.gates)]

    @property
    def layers(self) -> int:
        return len(self.gates)

    def _hook(self, index: int):
        def record(_module: Any, _inputs: Any, output: tuple[torch.Tensor, ...]) -> None:
            self._seen[index] = output[-1]  # the top-k expert ids, [rows x tokens, k]

        return record

    def take(self, tokens: int) -> torch.Tensor:
        """The last forward's routes, ``[rows, tokens, layers, k]`` uint8, for its ``[rows, tokens]`` input."""
        if any(seen is None for seen in self._seen):
            raise RuntimeError("no forward ran through every router since the last take()")
        routes = torch.stack([seen.reshape(-1, tokens, self.top_k) for seen in self._seen], dim=2).to(ROUTES_DTYPE)
        self._seen = [None] * len(self.gates)
        return routes

    def prefilled(self, width: int, rows: int, new_tokens: int) -> torch.Tensor:
        """``[rows, width + new_tokens, layers, k]`` routes holding the last forward's, a prefill of ``width`` tokens
        (repeated for the samples of a prompt prefilled once), for the decode to fill as it feeds tokens back."""
        prefill = self.take(width)
        routes = empty_routes(rows, width + new_tokens, self.layers, self.top_k, device=prefill.device)
        routes[:, :width] = prefill.repeat_interleave(rows // prefill.shape[0], dim=0)
        return routes

    def __enter__(self) -> "RouteRecorder":
        return self

    def __exit__(self, *_: Any) -> None:
        for hook in self._hooks:
            hook.remove()
