"""``nemo-jq plan``: per-GPU memory of every TP x PP x DP layout for a model or a run config, the one to use, and
(with a run config) how long the run takes and its GPU-hours."""

from __future__ import annotations

import argparse
import json
import sys

from nemo_jq.cli import arguments

#: ``nemo-jq plan``'s workload options: their Workload field, and the value without --config.
PLAN_WORKLOAD = {"seq_len": ("seq_len", 4096), "micro_batch": ("micro_batch", 1), "samples": ("samples", 32),
                 "batch_prompts": ("batch_prompts", 64), "recompute": ("recompute", False),
                 "sequence_parallel": ("sequence_parallel", True), "optimizer": ("optimizer", "fp32-adamw"),
                 "context_parallel": ("context_parallel", 1), "rollout_engine": ("rollout_engine", "native"),
                 "kv_cache_tokens": ("kv_cache_tokens", 131072),
                 "vllm_memory_utilization": ("vllm_memory_utilization", 0.5),
                 "rollout_tensor_parallel": ("vllm_tensor_parallel", 1), "rollout_ranks": ("rollout_ranks", 0),
                 "sync_bucket_mb": ("sync_bucket_mb", 256.0)}


#: The config keys each workload flag stands for, which ``--config`` reads instead.
CONFIG_KEYS = {"seq_len": "--prompt-tokens with rollout.max_thinking_tokens and rollout.max_answer_tokens",
               "micro_batch": "train.micro_batch_rows", "samples": "rollout.num_samples", "batch_prompts": "train.batch_size",
               "recompute": "megatron.recompute_activations, or hf's model.activation_checkpointing",
               "sequence_parallel": "megatron.sequence_parallel",
               "optimizer": "megatron.distributed_optimizer, megatron.bf16_weights, megatron.optimizer_cpu_offload",
               "context_parallel": "megatron.context_parallel", "rollout_engine": "rollout.engine",
               "kv_cache_tokens": "rollout.kv_cache_tokens", "vllm_memory_utilization": "rollout.vllm_memory_utilization",
               "rollout_tensor_parallel": "rollout.tensor_parallel", "rollout_ranks": "rollout.ranks",
               "sync_bucket_mb": "rollout.sync_bucket_mb"}


#: The exit status where no layout is recommended (the report says what would fit), so that a script stops there
#: (``nemo-jq plan --config C && sbatch ...``); bad input is 2, as in every command.
NOTHING_FITS = 1


def add_parser(commands) -> None:
    planner = commands.add_parser(
        "plan", help="estimate per-GPU memory of every TP x PP x DP layout (at a CP size), recommend one, and with --config "
        "give the run's time and GPU-hours",
        description="nemo-jq plan --model 8b --gpus-per-node 8 --nodes 2 --gpu-memory 80\n\nExits 0 with a "
        "recommended layout, 1 where nothing fits (the report says what would), 2 on bad input.",
        epilog=assumptions, formatter_class=argparse.RawDescriptionHelpFormatter)
    planner.add_argument("--config", type=arguments.path, help="read the workload from a run config (model, micro-batch in the "
                         "trainer's units, M, budgets, backend, engine, optimizer mode); key=value overrides as train takes")
    planner.add_argument("--prompt-tokens", type=arguments.positive,
                         help="with --config: the longest prompt the data holds, in tokens (default 1024)")
    planner.add_argument("overrides", nargs="*", default=[], help="with --config: section.key=value overrides")
    planner.add_argument("--model", help="a Qwen3 size (0.6b, 1.7b, 4b, 8b, 14b, 32b, 30b-a3b, 235b-a22b) or an HF "
                         "config.json / folder "
                         "(with --config: its model.path)")
    planner.add_argument("--gpus-per-node", type=arguments.positive, default=8)
    planner.add_argument("--nodes", type=arguments.positive, default=1)
    planner.add_argument("--gpu-memory", type=arguments.positive_gb, default=80.0, help="GiB per GPU")
    planner.add_argument("--seq-len", type=arguments.positive, help="prompt + thinking + answer tokens")
    planner.add_argument("--micro-batch", type=arguments.positive, help="rows per forward/backward (train.micro_batch_rows)")
    planner.add_argument("--samples", type=arguments.positive, help="M, rollouts per prompt")
    planner.add_argument("--batch-prompts", type=arguments.positive, help="prompts per optimizer step (train.batch_size)")
    planner.add_argument("--recompute", action="store_const", const=True, help="full activation recomputation")
    planner.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_const", const=False)
    planner.add_argument("--context-parallel", type=arguments.positive,
                         help="CP: ranks that split every sequence (megatron.context_parallel; GPU only, with TE)")
    planner.add_argument("--optimizer", choices=("fp32-adamw", "fp32-distopt", "bf16-distopt", "fp32-distopt-offload",
                                                 "bf16-distopt-offload"),
                         help="fp32-adamw: the backend's default; fp32-distopt: megatron.distributed_optimizer=true; "
                              "bf16-distopt: megatron.bf16_weights=true as well; *-offload: "
                              "megatron.optimizer_cpu_offload=true as well (the optimizer's state in host memory)")
    planner.add_argument("--rollout-engine", choices=("native", "hf", "vllm"), help="rollout.engine")
    planner.add_argument("--kv-cache-tokens", type=arguments.positive,
                         help="rollout.kv_cache_tokens: the native/hf samplers' most keys and values held at once")
    planner.add_argument("--vllm-memory-utilization", type=arguments.fraction, help="rollout.vllm_memory_utilization")
    planner.add_argument("--rollout-tensor-parallel", type=arguments.positive,
                         help="rollout.tensor_parallel: ranks that hold one vLLM engine")
    planner.add_argument("--rollout-ranks", type=arguments.positive, help="rollout.placement=separate with "
                         "rollout.ranks=N: the last N GPUs only sample (default: colocated)")
    planner.add_argument("--sync-bucket-mb", type=arguments.positive_amount("MiB"), help="rollout.sync_bucket_mb (default 256)")
    planner.add_argument("--sync-bandwidth", type=arguments.positive_amount("GB/s"), default=25.0, help="GB/s of the weight sync's "
                         "broadcast to the rollout ranks (default 25: one 200 Gb/s InfiniBand port)")
    planner.add_argument("--gpu", help="with --config: a100-80gb or h100-80gb, the GPU whose bf16 "
                         "peak and memory bandwidth bound the run's time (default h100-80gb)")
    planner.add_argument("--json", action="store_true", help="print JSON instead of a table")
    planner.set_defaults(run=run)


def assumptions() -> str:
    from nemo_jq.cluster import plan

    return "assumptions:\n" + plan.__doc__.split("\n", 2)[2]


def run(args: argparse.Namespace) -> int:
    from nemo_jq.cluster import plan

    given = {option: getattr(args, option) for option in PLAN_WORKLOAD if getattr(args, option) is not None}
    if args.config is None:
        if args.overrides:
            raise ValueError(f"key=value overrides ({' '.join(args.overrides)}) need --config: give the run config")
        if args.model is None:
            raise ValueError("nemo-jq plan needs --model (a Qwen3 size or an HF config) or --config (a run config)")
        if args.prompt_tokens:  # without a config, --seq-len is the whole row
            raise ValueError("--prompt-tokens: read with --config only (a row is its prompt and the config's budgets); "
                             "without it, --seq-len gives a row's tokens: drop it or give --config")
        if args.gpu:  # without a config, nothing of the run's time is estimated
            raise ValueError("--gpu: the GPU whose peaks time the run, which plan estimates with --config only; "
                             "--gpu-memory gives the memory layouts are sized for: drop --gpu or give --config")
        work = plan.Workload(**{field: given.get(option, default) for option, (field, default) in PLAN_WORKLOAD.items()})
        if work.micro_batch > work.samples * work.batch_prompts:  # its activations counted for rows no step has
            raise ValueError(f"--micro-batch {work.micro_batch} is more rows than a step trains (--samples {work.samples} x "
                             f"--batch-prompts {work.batch_prompts} = {work.samples * work.batch_prompts}): give at "
                             "most that many")
        arch = plan.architecture(args.model)
        plan.check_row(work.seq_len, arch.max_position_embeddings, f"max_position_embeddings of {args.model}",
                       "--seq-len is", "lower --seq-len")
    else:
        from nemo_jq.config import load_config

        if given:
            flags = ", ".join(f"--{option.replace('_', '-')} ({CONFIG_KEYS[option]})" for option in given)
            raise ValueError(f"{flags}: --config gives the workload; set it in the config or as key=value overrides")
        config = load_config(args.config, args.overrides)
        args.prompt_tokens, args.gpu = args.prompt_tokens or plan.PROMPT_TOKENS, args.gpu or "h100-80gb"
        given_as = "--model" if args.model else f"{args.config}: model.path"
        args.model = args.model or config.model.path
        if args.model is None:
            raise ValueError(f"{args.config} trains a tiny model from scratch (model.path: null): plan sizes real ones")
        arch = plan.architecture(args.model, given_as)
        if config.model.backend == "megatron":  # the config's own layout, as train checks it for this model
            config.megatron.validate(arch)
        plan.check_context(config, args.prompt_tokens, arch.max_position_embeddings,
                           f"max_position_embeddings of {args.model}")
        if config.train.micro_batch_rows == "auto":  # as train resolves it, for the config's own layout
            world = args.gpus_per_node * args.nodes - config.rollout.own_ranks
            config.train.micro_batch_rows = plan.auto_micro_batch_rows(config, args.prompt_tokens, args.gpu_memory,
                                                                       world)[0]
            print(f"train.micro_batch_rows=auto: {config.train.micro_batch_rows} rows at the config's layout "
                  f"({args.gpu_memory:g} GiB GPUs)", file=sys.stderr)
        work = plan.Workload.from_config(config, args.prompt_tokens)
    layouts = plan.plan(arch, work, gpus_per_node=args.gpus_per_node, nodes=args.nodes, gpu_gb=args.gpu_memory)
    result = plan.report(arch, work, layouts, args.gpu_memory, plan.HEADROOM, args.sync_bandwidth,
                         gpus=args.gpus_per_node * args.nodes, gpus_per_node=args.gpus_per_node)
    if not layouts[0].fits and work.backend == "megatron":  # the other way out: more nodes, as many as it takes
        result["fits_at_nodes"] = plan.fewest_nodes(arch, work, args.gpus_per_node, args.nodes, args.gpu_memory)
    lines = []
    if args.config is not None:
        from nemo_jq.cluster import timing
        from nemo_jq.dryrun.bounds import gpu_profile

        gpu = gpu_profile(args.gpu)
        result["time"] = timing.plan_time(arch, work, config, gpu, layouts, gpus_per_node=args.gpus_per_node,
                                          nodes=args.nodes, gpu_gb=args.gpu_memory)
        lines = timing.format_time(result["time"], gpu)
    else:
        lines = ["time: give --config (a run's steps, budgets and estimator fix how long it takes)"]
    table, last = plan.format_report(result).rsplit("\n", 1)  # the time before the assumptions' line
    print(json.dumps(result, indent=2) if args.json else "\n".join([table, *lines, last]))
    return 0 if result["recommended"] else NOTHING_FITS
