"""What only a GPU can show, measured on one, each part beside the figure the project predicts for it.

1. ``train``: ``nemo-jq train`` on the 0.6B FinQA GARL paper config, cut to a size that runs in a minute (OVERRIDES:
   the synthetic task, 4 prompts a step, a 256-token thinking budget, M=32 as in the paper, 8 rows a chunk), with a
   random Qwen3-0.6B (its real config, bf16 safetensors) and the real Qwen3 tokenizer. Its measured per-step peak
   (``gpu_peak_gib``: ``torch.cuda.max_memory_allocated`` over the step's rollouts, training and optimizer step)
   beside ``nemo-jq dryrun``'s peak over the same phases of the same config, run beside it on the host's CPU.
2. ``one_step_off``: the demo's tiny model on the GPU with ``rollout.async_steps=1``: the sampling child process
   takes the weights over CUDA IPC (``nemo_jq/rollouts/process.py``), which no CPU test can exercise.
3. ``refit``: the 0.6B policy's weights copied into the sampler's own bf16 copy through the refit path
   (``RefittedRolloutEngine``), device to device in one process: bytes and bytes/s.
5. ``sampler_profile``: the native sampler's decode tokens/s at the 0.6B shape (64 prompts x M=8, 64 tokens), with
   the attention it asks for and with torch's own choice (cuDNN), and the plain loop's, against the bandwidth bound;
   where its time goes (torch.profiler).
6. ``sync``: the weight sync of ``rollout.placement=separate`` (``nemo_jq/rollouts/sync.py``) in one process, its
   broadcasts a loopback (one GPU cannot hold both ends of an NCCL group): the policy's weights packed into
   256 MiB buckets, each bucket copied once as a broadcast would, unpacked and loaded into the sampler's copy.
7. ``megatron``: part 1 with ``model.backend=megatron`` (TP=PP=DP=1, megatron's own recomputation in place of HF's
   checkpointing, as ``docs/megatron.md`` launches it), beside ``nemo-jq dryrun`` of the same config: megatron-core's
   model, optimizer, log-prob head and refit into the HF sampler on a GPU (on ``--device cpu``, under the test
   suite's CPU patches).
4. ``sampler``: ``bench/rollouts.py --gpu``: the native sampler's decode tokens/s at the 0.6B shape (64 prompts x
   M=8, a 256-token budget) against the memory-bandwidth bound.
8. ``speed``: the step against the GPU's bounds, old path beside new in one call (``bench/gpu_speed.py``): (a) decode
   steps alone, eager and under CUDA graphs, at the paper config's chunk and at 512 rows x 64 tokens, against the
   bytes a step must move, with host launches per step; (b) the training phase on one micro-batch of the paper's
   row length and its MFU, the old tree (``--baseline``: the package as it was, e.g. ``git archive <commit>
   nemo_jq``) beside this one; (c) the steady-state step (steps 2 and on) of part 1's cut config, old tree and this
   one (as configured, and with all 128 rows in one chunk and 2,048 positions a log-prob chunk).
9. ``generator``: a request's CUDA generator state through a rollout rank's path (``nemo_jq/rollouts/ranks.py``)
   to a sampler without a ``device`` (as vLLM's is), and the state that comes back into the trainer's generator.
10. ``moe``: part 7 with a Qwen3-MoE: Qwen3-30B-A3B cut to :data:`MOE_LAYERS` layers at its real widths (128 experts,
   top-8, random bf16 weights), all experts on the one GPU (EP=1) through megatron-core's all-gather dispatcher and
   experts one after another (Transformer Engine and grouped GEMM do not install on the GPU image), the native
   sampler's routes replayed in training; its step's peak beside the dry run's of the same config (docs/moe.md).
11. ``offload``: part 7 with the bf16 distributed optimizer, its state on the GPU (``resident``) and in host memory
   (``offloaded``: ``megatron.optimizer_cpu_offload``), each beside its dry run: the peaks, and the step times the
   host's AdamW step and the copies each way add (docs/megatron.md).

Writes ``real_gpu.json`` (and the parts' own files) to --out. Usage, on a machine with one CUDA GPU, from the repo
(``python bench/prepare_gpu.py`` makes ``.gpu/``: the tokenizer, and the old trees ``speed`` reads):

    python bench/real_gpu.py --out DIR --tokenizer .gpu/tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "qwen3_0p6b" / "finqa_cold_garl_q0.75.yaml"
#: The paper config cut to a minute's work: M, the row chunks, checkpointing and precision stay the paper's.
OVERRIDES = ["data.name=synthetic", "data.source=null", "data.train_size=8", "data.validation_size=4", "data.test_size=4",
             "rollout.max_thinking_tokens=256", "rollout.max_answer_tokens=32", "train.batch_size=4",
             "train.micro_batch_size=2", "train.micro_batch_rows=8", "train.max_steps=1", "eval.num_samples=2",
             "eval.batch_size=4"]
#: ``model.backend=megatron`` at one GPU: megatron-core recomputes with its own key (docs/megatron.md).
MEGATRON = ["model.backend=megatron", "model.activation_checkpointing=false", "megatron.recompute_activations=true"]
#: The layers part 10 cuts Qwen3-30B-A3B to (its widths kept): ~1.85B parameters, a step in tens of GiB.
MOE_LAYERS = 2
#: Part 11's optimizer: the bf16 distributed one, its state resident on the GPU or offloaded to the host.
DISTRIBUTED_BF16 = ["megatron.distributed_optimizer=true", "megatron.bf16_weights=true"]
#: The phases a step's ``gpu_peak_gib`` spans, as the dry run names them.
STEP_PHASES = ("rollout", "train", "optimizer_step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the results go (JSON files)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "real_gpu",
                        help="where the model folder and the runs go (1.2 GB)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with Qwen3's tokenizer files")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script at the tiny shape")
    parser.add_argument("--parts", nargs="+", default=["train", "one_step_off", "refit", "sampler"], help="which to run")
    parser.add_argument("--baseline", type=Path, default=ROOT / ".gpu" / "baseline",
                        help="speed: a folder holding the old tree's nemo_jq package")
    parser.add_argument("--previous", type=Path, default=ROOT / ".gpu" / "previous",
                        help="speed: a folder holding an earlier graph path's tree (its decode beside this one's)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": environment()}
    tiny = args.device == "cpu"
    folder = make_model_folder(args.work / "model", args.tokenizer, tiny=tiny, device=args.device)
    parts = {"train": lambda: train_against_dry_run(args, folder, tiny),
             "megatron": lambda: train_against_dry_run(args, folder, tiny, MEGATRON),
             "one_step_off": lambda: one_step_off(args),
             "refit": lambda: refit_bytes_per_second(folder, args.device),
             "sampler": lambda: sampler_against_bound(args, tiny),
             "sampler_profile": lambda: sampler_profile(folder, args.device, 4 if tiny else 64),
             "sync": lambda: sync_bytes_per_second(folder, args.device),
             "speed": lambda: speed(args, folder, tiny),
             "generator": lambda: generator_through_rollout_rank(args.device),
             "moe": lambda: train_against_dry_run(args, make_model_folder(
                 args.work / "moe_model", args.tokenizer, tiny=tiny, device=args.device, model="Qwen/Qwen3-30B-A3B",
                 layers=MOE_LAYERS), tiny, [*MEGATRON, "rollout.routing_replay=true"], name="moe"),
             "offload": lambda: {
                 "resident": train_against_dry_run(args, folder, tiny, [*MEGATRON, *DISTRIBUTED_BF16], name="resident"),
                 "offloaded": train_against_dry_run(args, folder, tiny, [*MEGATRON, *DISTRIBUTED_BF16,
                                                                         "megatron.optimizer_cpu_offload=true"],
                                                    name="offloaded")}}
    for name, part in ((name, parts[name]) for name in args.parts):
        started = time.perf_counter()
        try:
            report[name] = part()
        except Exception as error:  # one part's failure is a finding; the others still run
            report[name] = {"error": f"{type(error).__name__}: {error}"[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
        (args.out / "real_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"[{name}] {json.dumps(report[name])[:1500]}", flush=True)


def environment() -> dict:
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}


def make_model_folder(folder: Path, tokenizer: Path, *, tiny: bool, device: str, model: str = "Qwen/Qwen3-0.6B",
                      layers: int | None = None) -> Path:
    """A local model folder as ``hf download`` writes one: ``model``'s config (``plan``'s built-in copy of it; cut to
    ``layers``), random bf16 weights and the real tokenizer files (the tiny shape on CPU: a Qwen3-MoE keeps 8 of its
    experts there)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_jq.cluster.plan import hf_config_dict

    shape = hf_config_dict(model)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    if tiny:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32)
        if "num_experts" in shape:
            shape.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(shape.pop("model_type"), **shape)).to(torch.bfloat16)
    model.save_pretrained(folder)
    for file in tokenizer.iterdir():
        if file.is_file():
            shutil.copy(file, folder / file.name)
    del model
    return folder


def longest_prompt(folder: Path) -> int:
    """The longest prompt of the run's data in tokens, as the trainer builds it (for the dry run's prompts)."""
    from nemo_jq.config import load_config
    from nemo_jq.data.chat import ChatFormat
    from nemo_jq.data.prepare import build_task
    from nemo_jq.recipe.components import load_tokenizer

    config = load_config(CONFIG, [f"model.path={folder}", *OVERRIDES])
    task, splits = build_task(config.data)
    chat = ChatFormat(load_tokenizer(config, folder, task, splits, None))
    return max(len(chat.prompt_ids(task.messages(example, config.data.format)))
               for split in (splits.train, splits.validation, splits.test) for example in split)


def train_against_dry_run(args, folder: Path, tiny: bool, backend: list[str] = (), name: str = "") -> dict:
    """The real run's per-step peak beside the dry run's, both of one config; the dry run on the CPU meanwhile.
    ``backend``: its overrides (none: HF's); ``name``: the part's, for its files (default: the backend's)."""
    name = name or ("megatron" if backend else "")
    overrides = [f"model.path={folder}", *OVERRIDES, *backend]
    if tiny:
        overrides += ["rollout.max_thinking_tokens=16", "rollout.num_samples=4"]
    prompt_tokens = longest_prompt(folder)
    dry_json = args.out / (f"dryrun_{name}.json" if name else "dryrun.json")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the dry run's GPU is the meta device; keep it off this one
    dry = subprocess.Popen([sys.executable, "-m", "nemo_jq.cli", "dryrun", "--config", str(CONFIG), "--gpu", "h100-80gb",
                            "--prompt-tokens", str(prompt_tokens), "--json", str(dry_json), *overrides],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run_dir = args.work / (f"run_{name}" if name else "run")
    # megatron-core on CPU runs only under the suite's patches (tests/megatron_cpu.py), as in the CPU tests
    command = ["tests/megatron_cpu.py"] if backend and args.device == "cpu" else ["-m", "nemo_jq.cli"]
    real = subprocess.run([sys.executable, *command, "train", "--config", str(CONFIG), *overrides,
                           f"train.run_dir={run_dir}", f"train.device={args.device}"],
                          capture_output=True, text=True, timeout=200, cwd=ROOT)
    try:
        dry_output = dry.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:  # the real run's figures still count; the dry run can be run apart
        dry.kill()
        dry_output = "the dry run took over 300 s and was stopped\n" + dry.communicate()[0]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"gpu_peak_gib"' in line or '"step_time"' in line] if (run_dir / "metrics.jsonl").exists() else []
    result = {"overrides": overrides, "prompt_tokens": prompt_tokens, "train_exit": real.returncode,
              "train_tail": (real.stdout + real.stderr)[-1500:] if real.returncode else None,
              "steps": [{key: step.get(key) for key in ("step", "gpu_peak_gib", "step_time", "rollout_tokens_per_s",
                                                         "rollout_tokens")} for step in steps],
              "dry_run_exit": dry.returncode, "dry_run_tail": dry_output[-1500:] if dry.returncode else None}
    if dry_json.exists():
        phases = json.loads(dry_json.read_text())["phases"]
        dry_step = max(phases[name]["peak_gib"] for name in STEP_PHASES if name in phases)
        result["dry_run_step_peak_gib"] = dry_step
        result["dry_run_phases_gib"] = {name: phase["peak_gib"] for name, phase in phases.items()}
        measured = [step["gpu_peak_gib"] for step in result["steps"] if step.get("gpu_peak_gib")]
        if measured:
            result["measured_over_dry_run"] = round(max(measured) / dry_step, 3)
    return result


def one_step_off(args) -> dict:
    """Three steps of the demo on the GPU, one step off: the sampling child takes the weights over CUDA IPC."""
    run_dir = args.work / "one_step_off"
    done = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "train", f"train.device={args.device}",
                           "rollout.async_steps=1", "train.max_steps=3", "data.validation_size=8", "data.test_size=8",
                           f"train.run_dir={run_dir}"], capture_output=True, text=True, timeout=120)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"rollout_lag"' in line] if (run_dir / "metrics.jsonl").exists() else []
    return {"exit": done.returncode, "tail": (done.stdout + done.stderr)[-1500:] if done.returncode else None,
            "steps": [{key: step.get(key) for key in ("step", "rollout_lag", "loss", "gpu_peak_gib")} for step in steps]}


def _policy_and_sampler(folder: Path, device):
    """The folder's model as an fp32 policy training in bf16, and a native sampler over its own bf16 copy of it."""
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_jq.models.hf import HFPolicy
    from nemo_jq.rollouts.hf import NativeSampler

    policy = HFPolicy(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), device=device, precision="bf16")
    copy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
    return policy, NativeSampler(copy, pad_id=0, device=device)


def _wait(device) -> None:
    """Let the device's queued work finish, so that a wall-clock time covers it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def refit_bytes_per_second(folder: Path, device: str) -> dict:
    """The policy's weights into the sampler's own bf16 copy through ``RefittedRolloutEngine``'s refit, timed."""
    import torch

    from nemo_jq.rollouts.budget import BudgetedRollouts
    from nemo_jq.rollouts.refit import RefittedRolloutEngine

    device = torch.device(device)
    policy, sampler = _policy_and_sampler(folder, device)
    engine = RefittedRolloutEngine(BudgetedRollouts(sampler, think_end_id=1, end_of_turn_id=2, max_thinking_tokens=1,
                                                    max_answer_tokens=1), policy)
    engine.refit()  # the first: allocations and kernels warmed
    seconds = []
    for _ in range(3):
        policy.weights_version += 1
        _wait(device)
        started = time.perf_counter()
        engine.refit()
        _wait(device)
        seconds.append(time.perf_counter() - started)
    sent = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    received = sum(p.numel() * p.element_size() for p in sampler.model.parameters())
    best = min(seconds)
    return {"policy_bytes_read": sent, "sampler_bytes_written": received, "refit_seconds": seconds,
            "read_plus_written_bytes_per_s": (sent + received) / best}


class _Loopback:
    """A process group of one process playing the source and the receiver in turn: the source's broadcasts are
    queued as copies (the bytes a broadcast moves), the receiver's take them in order."""

    class _Done:
        def wait(self) -> None:
            return None

    def __init__(self):
        import collections

        self.queue = collections.deque()
        self.sending = True

    def broadcast(self, tensor, root: int):
        if self.sending:
            self.queue.append(tensor.clone())
        else:
            tensor.copy_(self.queue.popleft())
        return self._Done()


def sync_bytes_per_second(folder: Path, device: str) -> dict:
    """The policy's weights through :class:`nemo_jq.rollouts.sync.WeightSync` into the sampler's bf16 copy, timed."""
    import torch

    from nemo_jq.config import RolloutConfig
    from nemo_jq.rollouts.sync import WeightSync

    device = torch.device(device)
    policy, sampler = _policy_and_sampler(folder, device)
    bucket_bytes = RolloutConfig().bucket_bytes()
    rounds = []
    for _ in range(3):
        group = _Loopback()
        sync = WeightSync(group, source=0, bucket_bytes=bucket_bytes, device=device)
        _wait(device)
        sent = sync.send(policy.iter_hf())
        group.sending = False
        received = WeightSync(group, source=0, bucket_bytes=bucket_bytes, device=device)
        started = time.perf_counter()
        sampler.load_weights(received.receive())
        _wait(device)
        rounds.append({"bytes": sent.bytes, "buckets": sent.buckets, "send_seconds": sent.seconds,
                       "receive_and_load_seconds": time.perf_counter() - started})
    best = min(rounds, key=lambda r: r["send_seconds"] + r["receive_and_load_seconds"])
    return {"bucket_bytes": bucket_bytes, "rounds": rounds,
            "bytes_per_s": best["bytes"] / (best["send_seconds"] + best["receive_and_load_seconds"])}


def sampler_against_bound(args, tiny: bool) -> dict:
    if tiny:
        return {"skipped": "the bandwidth bound needs a GPU (bench/rollouts.py --gpu)"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "rollouts.py"), "--gpu", "--samples", "8", "--budget", "256",
                           "--out", str(args.out / "rollouts.json")],
                          capture_output=True, text=True, timeout=150)
    if done.returncode:
        return {"exit": done.returncode, "tail": (done.stdout + done.stderr)[-1500:]}
    return json.loads((args.out / "rollouts_gpu.json").read_text())


def sampler_profile(folder: Path, device: str, new_tokens: int = 64) -> dict:
    """Decode 64 prompts x M=8 rows, ``new_tokens`` each (none stops), at the 0.6B shape in bf16: the native sampler
    as it is, with torch's own attention choice (cuDNN's, on an H100 with torch 2.11), and the plain loop, each
    timed twice in turn, against the memory-bandwidth bound; then the native sampler under torch.profiler."""
    import contextlib
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    sys.path[:0] = [str(ROOT / "bench")]
    from rollouts import BANDWIDTH_TBS, bandwidth_bound_seconds, task_prompts

    from nemo_jq.dryrun.world import patched
    from nemo_jq.rollouts import hf
    from nemo_jq.rollouts.hf import HFSampler, NativeSampler

    device = torch.device(device)
    chat, prompts = task_prompts(64)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    engines = {"native": (NativeSampler, contextlib.nullcontext),
               "native_torch_attention_choice": (NativeSampler, lambda: patched(hf, "decode_attention", contextlib.nullcontext)),
               "plain": (HFSampler, contextlib.nullcontext)}

    def decode(name: str, tokens: int) -> tuple[float, list[int]]:
        engine_class, attention = engines[name]
        sampler = engine_class(model, pad_id=chat.pad_id, device=device, precision="bf16")
        with attention():
            _wait(device)
            started = time.perf_counter()
            groups = sampler.sample(prompts, 8, stop_ids=[chat.think_end_id], max_new_tokens=tokens,
                                    generator=torch.Generator(device).manual_seed(0))
            _wait(device)
        return time.perf_counter() - started, [len(s.token_ids) for g in groups for s in g]

    for name in engines:
        decode(name, 4)  # warm: kernels, allocator
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(2):
        for name in engines:
            took, lengths = decode(name, new_tokens)
            seconds[name].append(took)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tbs = next((v for k, v in BANDWIDTH_TBS.items() if k in name), None)
    bound = bandwidth_bound_seconds(model, max(map(len, prompts)), lengths, 2, tbs * 1e12) if tbs else None
    result = {"rows": len(lengths), "new_tokens": new_tokens, "bandwidth_tbs": tbs, "bound_seconds": bound}
    for engine, times in seconds.items():
        best = min(times)
        result[engine] = {"seconds": times, "tokens_per_s": sum(lengths) / best,
                          "bound_over_measured": bound / best if bound else None}
    result["native_over_torch_attention_choice"] = statistics.median(
        b / a for a, b in zip(seconds["native"], seconds["native_torch_attention_choice"]))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        decode("native", 16)
    result["native_top_by_self_cpu"] = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                                                     max_name_column_width=50)
    return result


def speed(args, folder: Path, tiny: bool) -> dict:
    """(a) and (b) in processes of their own (each frees its GPU memory), then (c)."""
    def probe(name: str, *extra: str, timeout: int = 240) -> dict:
        out = args.out / f"speed_{name}.json"
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_speed.py"), *extra, "--out", str(out),
                               "--device", args.device], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        print(f"[speed {name}] exit {done.returncode}", flush=True)
        if done.returncode or not out.exists():
            return {"exit": done.returncode, "tail": (done.stdout + done.stderr)[-2500:]}
        return json.loads(out.read_text())

    decode = ["decode", "--contexts", "1024", "3072", "5056", "--shapes", "paper", "rows512", "launches", "profile", "floors"]
    # what the targets need first (a run cut short by the device's time keeps each probe's own file in --out), the
    # earlier trees' figures, measured before on the same kind of GPU, last
    result = {"decode": probe("decode", *decode, "--engines", "eager", "graphs_matmul_compiled",
                              "graphs_matmul_compiled@fp32", timeout=200),
              "train_new": probe("train_new", "train", "--chunks", "256", "2048", "--floor", timeout=150),
              "train_compiled": probe("train_compiled", "train", "--chunks", "2048", "--compiled", "--rows", "8", timeout=150),
              "train_compiled_no_checkpointing": probe("train_compiled_no_checkpointing", "train", "--chunks", "2048",
                                                       "--compiled", "--no-checkpointing", "--rows", "4", "8",
                                                       "--profile", timeout=180)}
    result["steps"] = steady_steps(args, folder, tiny)
    (args.out / "speed_steps.json").write_text(json.dumps(result["steps"], indent=2) + "\n")
    result["train_old"] = probe("train_old", "train", "--root", str(args.baseline), "--chunks", "256", timeout=120)
    result["decode_previous"] = probe("decode_previous", "decode", "--contexts", "1024", "3072", "5056", "--shapes",
                                      "paper", "rows512", "profile", "--root", str(args.previous), "--engines",
                                      "graphs_matmul_compiled", "graphs_matmul_compiled@fp32", timeout=150)
    return result


def steady_steps(args, folder: Path, tiny: bool) -> dict:
    """Part 1's cut config for a few steps: each step's time, from the old tree and this one."""
    overrides = [f"model.path={folder}", *OVERRIDES, f"train.device={args.device}"]
    if tiny:
        overrides += ["rollout.max_thinking_tokens=16", "rollout.num_samples=4"]
    runs = {"old": (args.baseline, ["train.max_steps=2"]), "new": (ROOT, ["train.max_steps=3"]),
            "new_rows128_chunk2048_compiled": (ROOT, ["train.max_steps=3", "train.micro_batch_rows=128",
                                                      "model.logprob_chunk_size=2048", "model.compile=true",
                                                      "model.activation_checkpointing=false"])}
    result = {}
    for name, (tree, extra) in runs.items():
        run_dir = args.work / f"steps_{name}"
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "nemo_jq.cli", "train", "--config", str(CONFIG), *overrides, *extra,
                                   f"train.run_dir={run_dir}"], capture_output=True, text=True, timeout=150, cwd=tree)
        except subprocess.TimeoutExpired:
            result[name] = {"error": "over 150 s"}
            continue
        lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        steps = [json.loads(line) for line in lines if '"step_time"' in line]
        result[name] = {"exit": done.returncode, "wall_s": round(time.perf_counter() - started, 1),
                        "tail": (done.stdout + done.stderr)[-1500:] if done.returncode else None,
                        "steps": [{key: step.get(key) for key in ("step", "step_time", "rollout_tokens_per_s",
                                                                   "rollout_tokens", "gpu_peak_gib", "logprob_gap",
                                                                   "max_logprob_gap", "kl_k3")} for step in steps]}
        print(f"[speed steps {name}] exit {done.returncode} {result[name]['wall_s']} s", flush=True)
    return result


def generator_through_rollout_rank(device: str) -> dict:
    """Issue 43's N1 on a GPU: the trainer's CUDA generator state, sent as a request carries it, served by a rollout
    rank's engine whose sampler has no ``device``, and taken back; beside what the old path did with the state (a
    generator of the engine's device, the CPU's)."""
    import torch

    from nemo_jq.rollouts.budget import BudgetedRollouts
    from nemo_jq.rollouts.process import engine_device
    from nemo_jq.rollouts.ranks import generator_from, generator_state
    from nemo_jq.rollouts.sampling import Sample, as_groups

    class NoDevice:  # as VLLMSampler: no ``device``; draws its tokens from the generator it is given
        tensor_parallel = 1

        def sample(self, prompts, num_samples, *, stop_ids, max_new_tokens, generator, greedy=False):
            rows = len(prompts) * num_samples
            drawn = torch.randint(3, 50, (rows, max_new_tokens), generator=generator, device=generator.device)
            return as_groups([Sample(row.tolist(), False, None) for row in drawn.cpu()], num_samples)

    engine = BudgetedRollouts(NoDevice(), think_end_id=1, end_of_turn_id=2, max_thinking_tokens=4, max_answer_tokens=2)
    trainer, reference = torch.Generator(device).manual_seed(0), torch.Generator(device).manual_seed(0)
    state = generator_state(trainer)
    result = {"sent_device_type": state[0], "sent_state_bytes": state[1].numel()}
    try:
        old = torch.Generator(engine_device(engine))
        old.set_state(state[1])
        result["old_path"] = "accepted"
    except Exception as error:  # noqa: BLE001 - the defect being shown
        result["old_path"] = f"{type(error).__name__}: {error}"
    served = generator_from(state, engine_device(engine))
    rollouts = engine.generate([[5, 6]], 2, sample_answers=True, generator=served)
    trainer.set_state(served.get_state())
    expected = engine.generate([[5, 6]], 2, sample_answers=True, generator=reference)
    result.update(served_on=str(served.device), same_rollouts=[r.rationale_ids for g in rollouts for r in g] ==
                  [r.rationale_ids for g in expected for r in g],
                  trainer_moved_as_sampling_did=bool(torch.equal(torch.rand(4, generator=trainer, device=trainer.device),
                                                                torch.rand(4, generator=reference, device=reference.device))))
    return result


if __name__ == "__main__":
    main()
