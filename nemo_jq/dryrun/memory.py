"""Live bytes on the stand-in GPU, by kind, and each phase's peak; and the host's (the tensors on ``cpu``), in total.

The design is torch's ``torch.distributed._tools.mem_tracker.MemTracker``'s: every tensor an operator returns is
counted once per storage (its ``untyped_storage()``, whose Python object lives exactly as long as the storage,
so a weak finalizer frees its bytes), and a storage's kind is the label in force when it was allocated, relabelled
when the run gives it another role (a parameter's gradient once it is accumulated, the optimizer's state, a
sampler's own copy of the weights). Unlike MemTracker it counts the kinds this project's phases differ by: the
log-prob head, the KV cache, the sampler's copy, and vLLM's reserved share, which is not a tensor of ours.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

#: The kinds of bytes, in the report's order.
KINDS = ("weights", "gradients", "optimizer", "activations", "logprob_head", "kv_cache", "sampler_copy", "vllm",
         "sync_buckets", "temporaries")


@dataclass
class PhasePeak:
    """The most bytes live at once during a phase, and what they were."""

    peak: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: Each kind's own most during the phase (the log-prob head peaks when the activations have gone, say).
    most_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    #: The most bytes of host (``cpu``) tensors live at once during the phase.
    host_peak: int = 0


class MemoryTracker:
    """Counts the storages on ``device_type`` that :meth:`track` is shown, and apart those on the host (``cpu``: the
    checkpoint's gathered optimizer state, the rollouts read back, a model loaded before it moves);
    :meth:`phase` records a phase's peaks."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.live: dict[int, list] = {}  # storage address -> [bytes, kind]
        self.host_live: dict[int, int] = {}  # storage address -> bytes
        self.host_total = 0
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.labels = ["temporaries"]
        self.phases: dict[str, PhasePeak] = {}
        self.current: PhasePeak | None = None

    @contextlib.contextmanager
    def label(self, kind: str) -> Iterator[None]:
        """Storages allocated inside are of ``kind``."""
        self.labels.append(kind)
        try:
            yield
        finally:
            self.labels.pop()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhasePeak]:
        """Record the peak from here to the end of the block as phase ``name`` (the larger, if it ran before)."""
        outer, self.current = self.current, PhasePeak(self.total, dict(self.by_kind), dict(self.by_kind), self.host_total)
        try:
            yield self.current
        finally:
            done, self.current = self.current, outer
            if name in self.phases:
                for kind, size in self.phases[name].most_by_kind.items():
                    done.most_by_kind[kind] = max(done.most_by_kind[kind], size)
                done.host_peak = max(done.host_peak, self.phases[name].host_peak)
            if name not in self.phases or done.peak > self.phases[name].peak:
                self.phases[name] = done
            else:
                self.phases[name].most_by_kind, self.phases[name].host_peak = done.most_by_kind, done.host_peak

    @contextlib.contextmanager
    def reserved(self, kind: str, size: int) -> Iterator[None]:
        """``size`` bytes held by something that is not a tensor of ours (vLLM's share of the GPU) for the block."""
        self._add(kind, size)
        try:
            yield
        finally:
            self._add(kind, -size)

    @contextlib.contextmanager
    def host_reserved(self, size: int) -> Iterator[None]:
        """``size`` host bytes held for the block by something whose buffers are not tensors the dry run sees (a
        checkpoint writer's copies)."""
        self._add_host(size)
        try:
            yield
        finally:
            self._add_host(-size)

    def track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            return self._track_host(tensor.untyped_storage())
        if tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        size, kind = storage.nbytes(), self.labels[-1]
        self.live[key] = [size, kind]
        self._add(kind, size)
        weakref.finalize(storage, self._free, key)

    def _track_host(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.host_live:
            return
        self.host_live[key] = storage.nbytes()
        self._add_host(storage.nbytes())
        weakref.finalize(storage, self._free_host, key)

    def _free_host(self, key: int) -> None:
        self._add_host(-self.host_live.pop(key, 0))

    def _add_host(self, size: int) -> None:
        self.host_total += size
        if self.current is not None and self.host_total > self.current.host_peak:
            self.current.host_peak = self.host_total

    def relabel(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """From now on count these tensors' storages as ``kind``."""
        for tensor in tensors:
            if tensor is None or tensor.device.type != self.device_type:
                continue
            entry = self.live.get(tensor.untyped_storage()._cdata)
            if entry is not None and entry[1] != kind:
                self._add(entry[1], -entry[0])
                self._add(kind, entry[0])
                entry[1] = kind

    def kind_of(self, tensor: torch.Tensor) -> str | None:
        """The kind ``tensor``'s storage is counted as (None: not counted)."""
        entry = self.live.get(tensor.untyped_storage()._cdata)
        return entry[1] if entry is not None else None

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """Stop counting these tensors' storages: they stand for nothing on the GPU (a copy a real run leaves on the
        ``meta`` device, which is the stand-in GPU here) or on the host (a stand-in that only names tensors)."""
        for tensor in tensors:
            if tensor.device.type == "cpu":
                self._add_host(-self.host_live.pop(tensor.untyped_storage()._cdata, 0))
                continue
            entry = self.live.pop(tensor.untyped_storage()._cdata, None) if tensor.device.type == self.device_type else None
            if entry is not None:
                self._add(entry[1], -entry[0])

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)  # None: forgotten
        if entry is not None:
            self._add(entry[1], -entry[0])

    def _add(self, kind: str, size: int) -> None:
        self.by_kind[kind] += size
        self.total += size
        current = self.current
        if current is None:
            return
        if self.by_kind[kind] > current.most_by_kind[kind]:
            current.most_by_kind[kind] = self.by_kind[kind]
        if self.total > current.peak:
            current.peak, current.by_kind = self.total, dict(self.by_kind)


GiB = 1024**3


def gib(size: int) -> float:
    return round(size / GiB, 6)
