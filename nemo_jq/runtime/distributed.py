"""Who this process is in a multi-process run, and the few collectives the recipe needs.

The recipe is SPMD: under ``torchrun`` every rank runs the same loop over the same global
batches. Each data-parallel (DP) rank trains on its own share of a batch's prompt groups; the
ranks of one model replica (its tensor- and pipeline-parallel ranks) see the same share. Files
are written by global rank 0 only. In one process every function here is a no-op, so the
recipe reads the same either way.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class OtherRankFailed(RuntimeError):
    """Raised on the ranks that did not fail themselves; the message says which rank failed and how."""


def launched_world_size(environ: Any = None) -> int:
    """The process count a launcher gave in ``WORLD_SIZE`` (1 where none did); one that is not a process count (a
    batch script's empty or misspelt variable) raises ``ValueError`` naming it."""
    world = (os.environ if environ is None else environ).get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 1:
        raise ValueError(f"WORLD_SIZE={world!r} is not a process count (a whole number >= 1): unset it, or start under "
                         "torchrun/srun")
    return int(world)


def init_from_env(device: torch.device, timeout: timedelta | None = None, *, rollout_ranks: int = 0,
                  engine_ranks: int = 1) -> torch.device:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1 in the environment), once,
    and return this rank's device: its ``LOCAL_RANK`` GPU on CUDA (NCCL; ``cuda:N`` of another N is refused), else
    ``device`` (gloo).

    ``timeout``: how long a rank waits in a collective for the others before it fails (NCCL's default is
    10 minutes, shorter than one replica's rollouts of an 8B model, which the other ranks wait for);
    the groups made later (the backend's) take the same (:func:`collective_timeout`).
    ``rollout_ranks`` (``rollout.placement=separate``): the world's last that many ranks only sample; the
    world is split (:class:`Roles`, :func:`roles`): the default group is the training ranks', or on a rollout rank its
    engine's: ``engine_ranks`` consecutive rollout ranks (``rollout.tensor_parallel``) hold one engine.
    """
    global _TIMEOUT
    _TIMEOUT = timeout or _TIMEOUT
    adopt_slurm_step()
    world = launched_world_size()
    if rollout_ranks and world <= rollout_ranks:
        raise ValueError(f"rollout.placement=separate with rollout.ranks={rollout_ranks} leaves no training process "
                         f"among the {world} of this run: start rollout.ranks + the training processes under torchrun "
                         f"(e.g. torchrun --nproc-per-node {rollout_ranks + 1}), or set rollout.placement=colocated")
    if world <= 1:
        return device
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.index not in (None, local):  # it was replaced without a word
            raise ValueError(f"train.device={device} in a world of {world} processes: each takes its LOCAL_RANK's GPU "
                             f"(this one cuda:{local}): set train.device=cuda (or auto), and choose the GPUs with "
                             "CUDA_VISIBLE_DEVICES")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        global _OWNED
        backend = "nccl" if device.type == "cuda" else "gloo"
        if rollout_ranks:
            _split_world(backend, world, rollout_ranks, device, engine_ranks)
        else:
            dist.init_process_group(backend, timeout=_TIMEOUT)
        _OWNED = True
    return device


#: Whether :func:`init_from_env` started this process's groups (so :func:`close` ends them; a caller's own it leaves).
_OWNED = False
#: What :func:`close` ends before the groups (:func:`before_close`).
_BEFORE_CLOSE: list[Callable[[], None]] = []


def before_close(teardown: Callable[[], None]) -> None:
    """Have :func:`close` run ``teardown`` once every rank has arrived and before the groups end (once, however often
    asked): a vLLM engine's shutdown, which ends the groups it made, the world's with them; left to exit, it met
    groups already ended and raised."""
    if teardown not in _BEFORE_CLOSE:
        _BEFORE_CLOSE.append(teardown)


def close() -> None:
    """End the groups :func:`init_from_env` started, at a command's normal end: every rank waits for the others
    (over the whole world, a split one's rollout ranks too), what :func:`before_close` was given runs, then
    megatron-core's groups and the world's are shut down in order, here, not by their destructors at exit, where torch
    warns that NCCL's were never destroyed and a gloo group torn down while its peer still closes its side can end the
    process in "terminate called without an active exception" (tests/distributed/test_model_download.py). After a
    failure the ranks are not in step: the process exits without this."""
    global _OWNED, _ROLES
    if not _OWNED or not dist.is_initialized():
        return
    if _ROLES is not None:
        done = torch.zeros(1, device=_ROLES.device)
        _ROLES.bridge.allreduce([done]).wait()
    else:
        dist.barrier()
    while _BEFORE_CLOSE:
        _BEFORE_CLOSE.pop(0)()
    if _ROLES is not None:
        for group in (_ROLES.sync, _ROLES.bridge):
            if group is not None and hasattr(group, "shutdown"):
                group.shutdown()
        _ROLES = None
    parallel_state = sys.modules.get("megatron.core.parallel_state")  # the megatron backend's groups, where it made them
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _OWNED = False


@dataclass(frozen=True)
class Roles:
    """This process's place in a world that ``rollout.placement=separate`` splits: the first ``training`` ranks train,
    the last ``rollout`` ranks sample. The training ranks' default process group holds them only, so a backend sees a
    world of trainers (its TP/PP/DP groups are theirs); a rollout rank's holds its engine's ``engine_ranks`` rollout
    ranks (consecutive: one vLLM engine's tensor-parallel world; by default itself only). ``bridge``
    holds every rank, by global rank, for requests and rollouts; ``sync`` the first training rank (its rank 0) and the
    rollout ranks, for the weights (None on the other training ranks). Their tensors live on ``device`` (a GPU under
    NCCL)."""

    rank: int
    training: int
    rollout: int
    bridge: Any
    sync: Any
    device: torch.device
    engine_ranks: int = 1

    @property
    def samples(self) -> bool:
        return self.rank >= self.training

    @property
    def engines(self) -> int:
        """How many engines the rollout ranks hold."""
        return self.rollout // self.engine_ranks

    def engine_members(self, engine: int) -> list[int]:
        """The global ranks of rollout engine ``engine``, its first (which answers the training ranks) first."""
        first = self.training + engine * self.engine_ranks
        return list(range(first, first + self.engine_ranks))


#: The split world (None: every rank trains, or one process).
_ROLES: Roles | None = None


def roles() -> Roles | None:
    return _ROLES


def role_of(rank: int, world: int, rollout_ranks: int) -> tuple[str, int, int]:
    """A global rank's role in a world the last ``rollout_ranks`` of which sample: ("training" or "rollout", its rank
    within the role, the role's size). The one rule the split, ``doctor`` and ``launch`` all follow."""
    training = world - rollout_ranks
    return ("rollout", rank - training, rollout_ranks) if rank >= training else ("training", rank, training)


def _split_world(backend: str, world: int, rollout_ranks: int, device: torch.device, engine_ranks: int = 1) -> None:
    """Join this rank's role's default group and the bridge and sync groups (:class:`Roles`), all over the one
    rendezvous store torchrun describes, each under a prefix of its own."""
    global _ROLES
    rank = int(os.environ["RANK"])
    training = world - rollout_ranks
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=_TIMEOUT or timedelta(minutes=30)))
    role, role_rank, role_size = role_of(rank, world, rollout_ranks)
    samples = role == "rollout"
    if samples:  # each engine's rollout ranks a world of their own (vLLM builds one engine over its whole world)
        role, role_rank, role_size = f"rollout/{role_rank // engine_ranks}", role_rank % engine_ranks, engine_ranks
    dist.init_process_group(backend, store=dist.PrefixStore(f"nemo_jq/{role}/", store), rank=role_rank,
                            world_size=role_size, timeout=_TIMEOUT)
    bridge = _group_outside_the_world(backend, dist.PrefixStore("nemo_jq/bridge/", store), rank, world)
    sync = None
    if rank == 0 or samples:
        sync = _group_outside_the_world(backend, dist.PrefixStore("nemo_jq/sync/", store),
                                        rank - training + 1 if samples else 0, rollout_ranks + 1)
    _ROLES = Roles(rank, training, rollout_ranks, bridge, sync, device if backend == "nccl" else torch.device("cpu"),
                   engine_ranks)


def _group_outside_the_world(backend: str, store: Any, rank: int, size: int) -> Any:
    """A process group over ranks of several roles' worlds, which ``dist.new_group`` (within one world) cannot make:
    called through its own methods (``group.broadcast``, ``group.send``...), with ranks counted within it."""
    timeout = _TIMEOUT or timedelta(minutes=30)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def send_object(group: Any, value: Any, destination: int, device: torch.device) -> None:
    """``value`` (pickled) to rank ``destination`` of ``group`` (a group's own ``send``: see
    :func:`_group_outside_the_world`)."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
    group.send([torch.tensor([data.numel()], dtype=torch.int64, device=device)], destination, 0).wait()
    group.send([data], destination, 0).wait()


def receive_object(group: Any, source: int, device: torch.device) -> Any:
    """What :func:`send_object` sent from rank ``source`` of ``group``."""
    size = torch.empty(1, dtype=torch.int64, device=device)
    group.recv([size], source, 0).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.recv([data], source, 0).wait()
    return pickle.loads(data.cpu().numpy().tobytes())


def slurm_step_world() -> dict[str, str] | None:
    """Where ``srun`` started one process per GPU (no torchrun, so that SLURM's signals reach this process): the
    ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` the step's variables give. None outside a step of several tasks
    (``SLURM_STEP_NUM_TASKS``: the batch shell has ``SLURM_PROCID`` too) or where a launcher set ``WORLD_SIZE``."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    if "WORLD_SIZE" in os.environ or not tasks.isdigit() or int(tasks) <= 1:
        return None
    return {"WORLD_SIZE": tasks, "RANK": os.environ.get("SLURM_PROCID", "0"),
            "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0")}


def adopt_slurm_step() -> None:
    """Take :func:`slurm_step_world`'s rank, world size and local rank, as torch's env:// rendezvous and vLLM read them."""
    step = slurm_step_world()
    if step is None:
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(f"srun started {step['WORLD_SIZE']} tasks but {', '.join(missing)} is not set: export "
                         "MASTER_ADDR (the first node: scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) and "
                         "MASTER_PORT in the batch script")
    os.environ.update(step)


#: The collective timeout of this process's groups (None: the backend's default).
_TIMEOUT: timedelta | None = None


def collective_timeout() -> timedelta | None:
    return _TIMEOUT


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in its default group; in a split world (:class:`Roles`), its rank in torchrun's world."""
    if _ROLES is not None:
        return _ROLES.rank
    return dist.get_rank() if dist.is_initialized() else 0


def is_writer() -> bool:
    """Whether this rank writes the run's files (global rank 0; a rollout rank never does)."""
    return (not dist.is_initialized() or dist.get_rank() == 0) and not (_ROLES is not None and _ROLES.samples)


def will_write() -> bool:
    """Whether this process writes the run's files (:func:`is_writer`), also before it joins the process group: its
    rank as torchrun or srun gives it."""
    if world_size() > 1:
        return is_writer()
    adopt_slurm_step()  # srun's tasks learn their rank from SLURM_PROCID
    return os.environ.get("RANK", "0") == "0"


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def every_rank(value: T) -> list[T]:
    """``value`` from every rank, in rank order."""
    return _gather_objects(value)


def largest(value: T) -> T:
    """The largest ``value`` over all ranks (e.g. a stop signal that reached only some of them)."""
    return max(_gather_objects(value))


def on_writer(write: Callable[[], T]) -> T:
    """Run ``write`` on global rank 0 and return its result on every rank; if it fails, every rank raises."""
    return everywhere(write if is_writer() else lambda: None, share_from_writer=True)


def first_on_global_rank_0(action: Callable[[], Any]) -> None:
    """Run ``action`` on torchrun's rank 0 while every rank of the world waits, a split world's rollout ranks too
    (each is a world of its own, so :func:`on_writer` would not hold them: they wait on the bridge). If it fails there,
    every rank raises."""
    if _ROLES is None:
        on_writer(action)
        return
    error = None
    if _ROLES.rank == 0:
        try:
            action()
        except Exception as err:  # re-raised below, here; said to the others as a flag
            error = err
    failed = torch.tensor([float(error is not None)], device=_ROLES.device)
    _ROLES.bridge.allreduce([failed]).wait()  # SUM: every rank waits here until rank 0 is done
    if error is not None:
        raise error
    if failed.item():
        raise OtherRankFailed("rank 0 failed first (its own message says why)")


def everywhere(action: Callable[[], T], *, share_from_writer: bool = False) -> T:
    """Run ``action`` on every rank; if it fails on any, every rank raises, so none waits forever
    in a later collective (a full disk seen by one rank stops them all).

    Returns this rank's result, or rank 0's on every rank with ``share_from_writer``.
    """
    error = None
    try:
        result = action()
    except Exception as err:  # re-raised below, on this rank and (as a message) on the others
        error, result = err, None
    if world_size() == 1:
        if error is not None:
            raise error
        return result
    outcomes = _gather_objects((None if error is None else f"{type(error).__name__}: {error}",
                                result if share_from_writer and is_writer() else None))
    if error is not None:
        raise error
    failed = [f"rank {rank}: {message}" for rank, (message, _) in enumerate(outcomes) if message is not None]
    if failed:
        raise OtherRankFailed("; ".join(failed))
    return outcomes[0][1] if share_from_writer else result


#: The rendezvous store's counter of ranks that have failed and said so (see ``await_failing_ranks``).
_FAILED_RANKS_KEY = "nemo_jq/failed_ranks"


def await_failing_ranks(timeout: float = 10.0) -> None:
    """Before a failing rank exits: wait until every rank has failed too, or ``timeout`` seconds.

    torchrun stops every rank as soon as one exits, so a rank that printed its error and exited at
    once could cut off the others' own error lines. Counting on the rendezvous store (no collective,
    so a rank stuck in one elsewhere costs only the timeout) lets every failing rank print first.
    """
    if world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    store.add(_FAILED_RANKS_KEY, 1)
    deadline = time.monotonic() + timeout
    while store.add(_FAILED_RANKS_KEY, 0) < world_size() and time.monotonic() < deadline:
        time.sleep(0.05)


def _gather_objects(value: T, group: Any = None) -> list[T]:
    """``value`` from every rank of ``group`` (default: the world), in rank order."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size == 1:
        return [value]
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def batches_per_epoch(prompts: int, batch_size: int, replicas: int = 1) -> int:
    """The batches the training prompts make in an epoch over ``replicas`` (data-parallel): a short last one with
    fewer prompts than ``replicas`` is skipped (``recipe.state.PromptStream``)."""
    whole, left = divmod(prompts, batch_size)
    return whole + (left >= replicas)


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among the model replicas, and the collectives over them.

    ``group`` is the torch.distributed group of the ranks that hold the other replicas' copy of
    this rank's shard (None: one replica).
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def shard(self, items: Sequence[T]) -> list[T]:
        """This replica's contiguous share; the first ``len % size`` replicas take one more."""
        base, extra = divmod(len(items), self.size)
        start = self.rank * base + min(self.rank, extra)
        return list(items[start : start + base + (self.rank < extra)])

    def gather(self, local: list[T]) -> list[T]:
        """Every replica's ``local`` list, concatenated in replica order (the inverse of ``shard``)."""
        if self.size == 1:
            return list(local)
        return [item for piece in _gather_objects(local, self.group) for item in piece]

    def sum(self, value: float) -> float:
        return float(sum(self.gather([value])))

    def replica_seed(self, seed: int) -> int:
        """A seed of this replica's own random streams (its prompts' samples); replica 0 keeps ``seed``."""
        return seed + 1_000_003 * self.rank
