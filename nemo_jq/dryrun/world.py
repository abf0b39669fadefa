"""The dry run's world: the project's own code at real shapes on tensors that hold no memory.

Every tensor is a ``FakeTensor`` (``torch._subclasses.fake_tensor``): shapes, dtypes and devices propagate through
every operator, and nothing is allocated or computed. The GPU is the ``meta`` device (:data:`GPU`): the CPU build of
torch cannot run elementwise operators on fake ``cuda`` tensors ("not linked with support for cuda"), while ``meta``
is a device other than the CPU, so a tensor the code leaves on the host that meets a GPU tensor fails here as it
would on a GPU, and the failure names the module it happened in. The host is the fake CPU: a model built there
(as ``load_model`` builds one) takes no memory either.

What a fake tensor cannot say, the world answers, always with the case that costs the most memory:

* a boolean mask selects every element (``nonzero``, indexing by a mask);
* a whole-number scalar read is more than any length (a sequence trimmed to its longest row keeps every
  position), a float 1.0, a boolean False, except that a decode loop's "is any row still decoding?" (``any``) is
  True for the first :attr:`FakeWorld.decode_steps` reads of a sampling call, so the loop runs that many steps;
* a GPU tensor copied to the host (to be read: sampled tokens, lengths) arrives as real zeros, when it is small;
* CUDA's SDPA choice is made as on a GPU (FlashAttention without a mask, memory-efficient attention with one:
  neither keeps the [L, L] scores), where on ``meta`` torch would take its math path, which does;
* files of tensors (``torch.save``/``torch.load``, safetensors' ``save_model``/``load_model``) keep fake tensors
  in memory as shapes and devices (and real ones, such as generator states, as they are), and loading allocates
  what the real load allocates, where it allocates it.
"""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from pathlib import Path
from typing import Any, Iterator

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from nemo_jq.dryrun.memory import MemoryTracker
from nemo_jq.precision import MetaAutocast

#: The stand-in GPU.
GPU = torch.device("meta")
#: What a whole-number scalar read answers: more than any length, so that a slice up to it keeps everything.
MOST = 1 << 62
aten = torch.ops.aten


class WrongDevice(ValueError):
    """A host tensor met a GPU tensor: the message names the module (or call) and the phase."""


class FakeWorld:
    """Inside ``with FakeWorld(tracker):`` every tensor is fake and every GPU storage is counted by ``tracker``."""

    def __init__(self, tracker: MemoryTracker, *, decode_steps: int = 2):
        self.tracker, self.decode_steps = tracker, decode_steps
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        #: Decode-loop reads still answered True in the current sampling call (:meth:`sampling_call`).
        self.decoding = 0
        #: The share of a mask's elements a ``masked_select`` keeps (its count is data, which fake tensors lack): all
        #: of them, the most; a Qwen3-MoE's routing sets it to top-k / experts, routing balanced (dryrun.megatron).
        self.selected_share = 1.0
        self.phase_name = "build"
        self._module_path: list[str] = []
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._files: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    # ---------------------------------------------------------------- entering
    def __enter__(self) -> FakeWorld:
        import safetensors.torch

        # Garbage left from before runs its finalizers now, on real values: freed inside, a finalizer reads the
        # world's answers (vLLM CPU's oneDNN handle was released as MOST, a segfault, where an engine ran earlier).
        gc.collect()
        stack = self._stack
        self._swap = torch.utils.swap_tensors
        for owner, name, replacement in ((torch.utils, "swap_tensors", self._swap_tensors),
                                         (torch.nn.functional, "scaled_dot_product_attention", gpu_attention),
                                         (torch, "save", self._save), (torch, "load", self._load),
                                         (safetensors.torch, "save_model", self._save_model),
                                         (safetensors.torch, "load_model", self._load_model)):
            stack.enter_context(patched(owner, name, replacement))
        hooks = [torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module),
                 torch.nn.modules.module.register_module_forward_hook(self._leave_module)]
        stack.callback(lambda: [hook.remove() for hook in hooks])
        stack.enter_context(self.fake)
        stack.enter_context(_Dispatch(self))
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        _ACTIVE.remove(self)

    def name_modules(self, model: torch.nn.Module, prefix: str) -> None:
        """Name ``model``'s modules ``prefix.path`` in device errors."""
        for path, module in model.named_modules():
            self._names[module] = f"{prefix}.{path}" if path else prefix

    @contextlib.contextmanager
    def sampling_call(self) -> Iterator[None]:
        """A sampler's call: its decode loop runs :attr:`decode_steps` steps."""
        self.decoding = self.decode_steps
        try:
            yield
        finally:
            self.decoding = 0

    # ---------------------------------------------------------------- answers
    def scalar(self, tensor: torch.Tensor, any_results: set[int]) -> Any:
        """A scalar read: True while a decode loop runs, else False; a whole number is :data:`MOST` (a length or a
        count: a slice up to it takes everything), a float 1.0 (nothing divides by zero)."""
        if id(tensor) in any_results and self.decoding > 0:
            self.decoding -= 1
            return True
        return False if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else MOST

    def where_call(self) -> str:
        return self._module_path[-1] if self._module_path else "outside any module"

    def _enter_module(self, module, args) -> None:
        self._module_path.append(self._names.get(module, type(module).__name__))

    def _leave_module(self, module, args, output) -> None:
        if self._module_path:
            self._module_path.pop()

    # ---------------------------------------------------------------- module moves
    def _swap_tensors(self, first: torch.Tensor, second: torch.Tensor) -> None:
        """``Module.to`` swaps a fake parameter for its moved copy, which fails while the fake mode's memo holds a
        weak reference to either: drop those entries (the memo only maps real tensors to fakes, and there are none)."""
        memo = self.fake.fake_tensor_converter.meta_converter.tensor_memo.data
        for key in [key for key, ref in memo.items() if ref() is first or ref() is second]:
            del memo[key]
        self._swap(first, second)

    # ---------------------------------------------------------------- files of tensors
    def _save(self, obj: Any, path: Any, *args, host_bytes: int | None = None, **kwargs) -> None:
        """The file holds a key to what was saved (so that it survives the checkpoint's atomic rename). ``torch.save``
        copies one GPU storage to the host at a time as it writes: the largest is held on the host meanwhile
        (``host_bytes``: another writer's)."""
        key = f"dry run file {len(self._files)}"
        if host_bytes is None:
            host_bytes = max((value.untyped_storage().nbytes() for value in tree_leaves(obj)
                              if isinstance(value, torch.Tensor) and value.device.type != "cpu"), default=0)
        with self.tracker.host_reserved(host_bytes):
            self._files[key] = tree_map_only(FakeTensor, _Saved.of, obj)  # real ones (generator states) kept as they are
        Path(path).write_text(key)

    def _load(self, path: Any, map_location: Any = None, **kwargs) -> Any:
        device = torch.device(map_location) if isinstance(map_location, (str, torch.device)) else None
        return tree_map_only(_Saved, lambda saved: saved.allocate(device), self._files[Path(path).read_text()])

    def _save_model(self, model: torch.nn.Module, filename: str, **kwargs) -> None:
        """safetensors serialises the whole file in host memory before it writes it: every tensor's bytes at once."""
        state = dict(model.state_dict())
        self._save(state, filename, host_bytes=sum(tensor.nbytes for tensor in state.values()))

    def _load_model(self, model: torch.nn.Module, filename: str, strict: bool = True, device: Any = "cpu"):
        """As safetensors' ``load_model``: the whole file loaded onto ``device``, then copied into the model."""
        return model.load_state_dict(self._load(filename, map_location=device), strict=strict)


#: The worlds entered, innermost last (what a patch made outside one, such as megatron's checkpoints, reports to).
_ACTIVE: list[FakeWorld] = []


def active_world() -> FakeWorld:
    """The innermost :class:`FakeWorld` entered."""
    return _ACTIVE[-1]


class _Saved:
    """A saved tensor: its shape, dtype and the device it is restored to."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = shape, dtype, device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Saved:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)

    def allocate(self, device: torch.device | None) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device or self.device)


def gpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as CUDA runs it: FlashAttention (grouped-query heads as they are) without a
    mask, memory-efficient attention with one (its boolean mask made an additive bias in the query's dtype, K/V
    repeated to the query's heads); either keeps the output and its log-sum-exp, never the [L, L] scores."""
    dtype = MetaAutocast.active
    if dtype is not None:
        query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
    if attn_mask is None:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device)
    repeats = query.shape[-3] // key.shape[-3]
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask.expand(
        query.shape[0], query.shape[1], query.shape[2], key.shape[2]), query.requires_grad, dropout_p, is_causal,
        scale=scale)[0]


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name`` is ``replacement`` inside the block; after it, what ``owner`` itself held (a static method as
    one), or nothing again where the attribute came from its class. A name ``owner`` lacks is an error: a renamed
    seam must not leave the dry run patching nothing (a fake group's collective then waits forever)."""
    if not hasattr(owner, name):
        raise AttributeError(f"the dry run patches {owner!r}.{name}, which no longer exists")
    original = vars(owner).get(name, _ABSENT)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


_ABSENT = object()


class _Dispatch(TorchDispatchMode):
    """Sits above the fake mode: answers what fake tensors cannot, counts every GPU storage, names device errors."""

    def __init__(self, world: FakeWorld):
        super().__init__()
        self.world = world
        self.any_results: set[int] = set()  # ids of live ``any`` results (a WeakSet would compare tensors with ==)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return self.world.scalar(args[0], self.any_results)
        if func is aten.nonzero.default:
            out = args[0].new_empty((args[0].numel(), args[0].dim()), dtype=torch.long)
            self.world.tracker.track(out)
            return out
        if func is aten.masked_select.default:
            selected = math.ceil(torch.broadcast_shapes(args[0].shape, args[1].shape).numel() * self.world.selected_share)
            out = args[0].new_empty((selected,))
            self.world.tracker.track(out)
            return out
        if func is aten.detach_.default and not isinstance(args[0], FakeTensor):
            return args[0]  # torch.tensor(data, device=GPU) makes a real meta tensor, then detaches it in place
        if func is aten._to_copy.default and _to_host(args[0], kwargs):
            with unset_fake_temporarily():  # values read back on the host are unknown: zeros, and cheap to read
                read = torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            self.world.tracker.track(read)  # host bytes, as the real read's
            return read
        if func in _INDEXED:
            args = (args[0], _mask_free(args[1]), *args[2:])
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException:  # decomposed here instead, its data-dependent reads answered above
            with self:
                out = func.decompose(*args, **kwargs)
            if out is NotImplemented:
                raise
        except RuntimeError as err:
            if not is_device_mismatch(err):
                raise
            raise WrongDevice(f"phase {self.world.phase_name}: a tensor on the host (cpu) met one on the GPU in "
                              f"{self.world.where_call()} ({func}): {err}") from None
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.world.tracker.track(tensor)
        if func in (aten.any.default, aten.any.dim):
            self.any_results.add(id(out))
            weakref.finalize(out, self.any_results.discard, id(out))
        return out


def is_device_mismatch(error: RuntimeError) -> bool:
    """Whether a fake operator failed because its inputs are on two devices: torch 2.13 raises its own
    ``FakeTensorDeviceMismatchError``, earlier versions (2.11 on a GPU machine, seen) a ``RuntimeError`` saying so."""
    mismatch = getattr(fake_tensor, "FakeTensorDeviceMismatchError", None)
    return isinstance(error, mismatch) if mismatch is not None else "Unhandled FakeTensor Device Propagation" in str(error)


def _to_host(tensor: torch.Tensor, kwargs: dict) -> bool:
    """Whether this copy brings a GPU tensor of at most :data:`HOST_READ` elements back to the host."""
    device = kwargs.get("device")
    return (tensor.device.type == GPU.type and device is not None and torch.device(device).type == "cpu"
            and tensor.numel() <= HOST_READ)


#: The most elements a GPU tensor copied to the host may have to arrive as real zeros (a larger one stays fake).
HOST_READ = 1 << 24

_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _mask_free(indices: list) -> list:
    """Indices with each boolean mask replaced by the long indices of its elements, as if every one were set."""
    out = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            out += [index.new_empty((index.numel(),), dtype=torch.long)] * index.dim()
        else:
            out.append(index)
    return out
