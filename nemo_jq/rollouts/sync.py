"""The weight sync from training ranks to rollout ranks: HF-named tensors in fixed-size buckets over one collective.

The source (a training rank) streams ``policy.iter_hf()`` — for a Megatron policy each tensor is gathered from its
TP/PP shards once, as for a refit — into a byte bucket of ``rollout.sync_bucket_mb``; each full bucket is broadcast
over the sync group (gloo on CPU, NCCL on GPU) while the next one fills. A tensor larger than a bucket spans several,
and a bucket holds as many small tensors as fit: the source holds at most two buckets beside the model, a receiver
one bucket and a tensor spread over buckets put together whole (the embedding, at real vocabularies); never a full copy
of the weights on one host. The receivers unpack each bucket into views and hand them, one tensor at a
time, to the engine's ``load_weights`` (the refit path), which copies them into its model.

Each bucket is three broadcasts: the sizes of its table of contents (name, dtype, shape, which bytes of the tensor it
carries, where in the bucket) and of its bytes, the table, the bytes. A table of size 0 ends the stream.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

#: Where each tensor's bytes start in a bucket: a multiple of this, so that a whole tensor is a view of any dtype.
ALIGNMENT = 16


@dataclass(frozen=True)
class SyncStats:
    """One sync: the weights' bytes, the buckets they took and the seconds from first to last byte."""

    bytes: int
    buckets: int
    seconds: float


@dataclass(frozen=True)
class _Piece:
    """Bytes ``[start, start + size)`` of tensor ``name`` (its full byte count: ``total``) at ``offset`` in a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    size: int
    total: int
    offset: int


class WeightSync:
    """Bucketed broadcasts of HF-named weights from ``source`` (a rank of ``group``) to the group's other ranks.

    ``group``: a ``torch.distributed`` process group (its own methods are called, so a group made outside the default
    world, as the rollout ranks' bridge is, serves as well); ``device``: where its buffers live (a CUDA device for
    NCCL, the CPU for gloo)."""

    def __init__(self, group: Any, *, source: int, bucket_bytes: int, device: torch.device):
        if bucket_bytes < ALIGNMENT:
            raise ValueError(f"a weight-sync bucket must hold at least {ALIGNMENT} bytes; got {bucket_bytes}")
        self.group, self.source, self.bucket_bytes, self.device = group, source, bucket_bytes, device
        #: The latest sync's :class:`SyncStats` (on every rank of the group).
        self.last: SyncStats | None = None

    # ----------------------------------------------------------------- source
    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Broadcast every ``(name, tensor)`` in buckets (on the source)."""
        started, total, buckets = time.perf_counter(), 0, 0
        bucket, pieces, filled, in_flight = self._new_bucket(), [], 0, []
        for name, tensor in tensors:
            data = _bytes_of(tensor)
            total += data.numel()
            start = 0
            while True:
                offset = -(-filled // ALIGNMENT) * ALIGNMENT
                if offset >= self.bucket_bytes:
                    in_flight = self._flush(bucket, pieces, filled, in_flight)
                    bucket, pieces, filled, offset, buckets = self._new_bucket(), [], 0, 0, buckets + 1
                size = min(data.numel() - start, self.bucket_bytes - offset)
                bucket[offset:offset + size].copy_(data[start:start + size])
                pieces.append(_Piece(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), start, size,
                                     data.numel(), offset))
                start, filled = start + size, offset + size
                if start >= data.numel():
                    break
        if pieces:
            in_flight = self._flush(bucket, pieces, filled, in_flight)
            buckets += 1
        for work in self._flush(None, [], 0, in_flight):
            work.wait()
        self.last = SyncStats(total, buckets, time.perf_counter() - started)
        return self.last

    def _new_bucket(self) -> torch.Tensor:
        return torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)

    def _flush(self, bucket: torch.Tensor | None, pieces: list[_Piece], filled: int, in_flight: list[Any]) -> list[Any]:
        """Start the broadcasts of one bucket (None: the end of the stream), after those of the bucket before the
        last have finished: two buckets at most are alive (one in flight, one filling)."""
        table = torch.frombuffer(bytearray(pickle.dumps(pieces)), dtype=torch.uint8).to(self.device) if pieces else None
        sizes = torch.tensor([0 if table is None else table.numel(), filled], dtype=torch.int64, device=self.device)
        for work in in_flight:
            work.wait()
        works = [self.group.broadcast(sizes, self.source)]
        if table is not None:
            works += [self.group.broadcast(table, self.source), self.group.broadcast(bucket[:filled], self.source)]
        return works

    # ----------------------------------------------------------------- receivers
    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The source's tensors, one at a time, in its order (on the other ranks; consume it to the end). A whole
        tensor is a view of its bucket; one spread over buckets is put together in a tensor of its own."""
        started, total, buckets = time.perf_counter(), 0, 0
        partial: dict[str, torch.Tensor] = {}
        while True:
            sizes = torch.empty(2, dtype=torch.int64, device=self.device)
            self.group.broadcast(sizes, self.source).wait()
            table_size, filled = (int(value) for value in sizes.tolist())
            if table_size == 0:
                break
            table = torch.empty(table_size, dtype=torch.uint8, device=self.device)
            payload = torch.empty(filled, dtype=torch.uint8, device=self.device)
            self.group.broadcast(table, self.source).wait()
            self.group.broadcast(payload, self.source).wait()
            buckets += 1
            pieces: list[_Piece] = pickle.loads(table.cpu().numpy().tobytes())
            for piece in pieces:
                data = payload[piece.offset:piece.offset + piece.size]
                dtype = getattr(torch, piece.dtype)
                if piece.size == piece.total:
                    total += piece.total
                    yield piece.name, data.view(dtype).view(piece.shape)
                    continue
                whole = partial.setdefault(piece.name, torch.empty(piece.shape, dtype=dtype, device=self.device))
                _bytes_of(whole)[piece.start:piece.start + piece.size].copy_(data)
                if piece.start + piece.size == piece.total:
                    total += piece.total
                    yield piece.name, partial.pop(piece.name)
        self.last = SyncStats(total, buckets, time.perf_counter() - started)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a copy only of a non-contiguous one)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
