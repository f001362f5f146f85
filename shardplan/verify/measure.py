"""Per-rank memory accounting from torch's own view of its tensors: a TorchDispatchMode that
sees every storage an op allocates (as torch.distributed._tools.mem_tracker.MemTracker does;
DTensor ops are seen as the local ops they run), tagged with the phase it was born in.

Steady-state categories (parameters, gradients, optimizer state, KV cache) are the storage
bytes of the tensors that hold them; activations are the forward-born storages still alive
when a forward ends (what backward will read), sampled at every chunk's forward end so that
a pipeline's in-flight micro-batches add up; serving activations are the running peak of
forward-born storages over the prefill (under gloo, the smaller of two identical prefills:
see `worker.run_serving`); ZeRO-3 temporaries are the gathered (unsharded) parameters alive at a
block boundary. Sizes are read live (`nbytes()`), so FSDP's `resize_(0)` frees count.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Iterable

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FORWARD = "forward"
OTHER = "other"


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t.untyped_storage()


def storage_key(t: torch.Tensor) -> int:
    return _storage(t)._cdata


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = _storage(t)
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class SimulatedOutOfMemory(torch.OutOfMemoryError):
    """A rank's live tensors would exceed the device memory the run simulates (a CPU run of a
    plan for a GPU of that size): raised where the allocation happened, as the GPU would."""


# The component an allocation belongs to, as the cost model names it; "loss" is the loss
# head's part of the activations (the logits and what the loss makes of them).
WEIGHTS, GRADIENTS, OPTIMIZER, ACTIVATIONS, LOSS, TEMPORARY, KV_CACHE = (
    "weights", "gradients", "optimizer_states", "activations", "loss", "temporary", "kv_cache")
_TRIED_TO_ALLOCATE = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNIT_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_
_ACTIVE: list[StorageTracker] = []


def _tracked_resize(storage: torch.UntypedStorage, size: int):  # type: ignore[no-untyped-def]
    """`UntypedStorage.resize_` while a tracker is active: FSDP2 frees and re-allocates the
    unsharded parameters by resizing their storages (`free_storage`/`alloc_storage` in
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py), which no dispatched op shows."""
    try:
        out = _ORIGINAL_RESIZE(storage, size)
    except torch.OutOfMemoryError:
        for tracker in _ACTIVE:
            tracker.note_failure("storage.resize_ (FSDP all-gather of parameters)", [int(size)], "uint8", int(size),
                                 TEMPORARY)
        raise
    for tracker in _ACTIVE:
        tracker.resized(storage)
    return out


def _fake_output(func, args, kwargs) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    """The first tensor `func` would return, computed on fake tensors (no memory); None if it
    cannot be (the shape of a failed allocation is a courtesy: the failure is reported anyway)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            out = func(*args, **kwargs)
    except Exception:  # noqa: BLE001
        return None
    return next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)


def await_release(t: torch.Tensor, refs_before: int, limit_seconds: float = 10.0) -> None:
    """Gloo completes a collective on its worker thread, which still holds the tensor for a
    moment after `wait()` returns. If the caller drops the tensor first, the last reference
    goes with that thread, whenever it is scheduled: on a busy CPU the partial sum outlives
    the residual add and a (tokens x hidden) buffer shows up in the activation peak on some
    runs only. Waiting here until gloo has let go makes the measurement what the model does
    (NCCL on a GPU frees through the caching allocator's stream order, so it is not needed).
    The limit only bounds a wait that normally lasts microseconds: a CPU shared by four ranks and
    a test suite can leave gloo's thread unscheduled for longer than a second."""
    deadline = time.monotonic() + limit_seconds
    while t._use_count() > refs_before and time.monotonic() < deadline:
        time.sleep(0.0001)


_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


def _is_collective(func) -> bool:  # type: ignore[no-untyped-def]
    """A functional collective (DTensor's redistributions, funcol's autograd all-to-all)."""
    return (func.namespace in ("_c10d_functional", "_c10d_functional_autograd")
            and func._opname not in _NOT_COLLECTIVES)


def _settle_collective(refs_before: dict[int, int], out) -> None:  # type: ignore[no-untyped-def]
    """A functional collective on a CPU (gloo), made whole before the model sees its result:
    waited for here, then held until gloo's thread has let go of the output (`await_release`).
    DTensor's Partial -> Replicate all-reduce hands back a fresh tensor that the residual add
    soon drops; without this the drop went with gloo's thread on a busy CPU, and a serving
    prefill's peak once counted one more (tokens x hidden) buffer (+16.9%). The wait the
    caller does later (AsyncCollectiveTensor) then finds nothing left to wait for."""
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            torch.ops._c10d_functional.wait_tensor(t)
            await_release(t, refs_before.get(id(t), 1))  # a fresh output: this frame's handle only


class StorageTracker(TorchDispatchMode):
    """Live storages by the phase they were born in, their exact total (`live_total`, sizes
    followed through resizes) and its peak. With `limit_bytes`, once `armed`, an allocation
    that takes the total over it raises SimulatedOutOfMemory; `failure` then (or after a real
    out-of-memory error on a GPU) says what was being allocated."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        super().__init__()
        self.phase = OTHER
        self._storages: dict[int, list] = {}  # key -> [weakref, phase, bytes]
        self._running: dict[str, int] = {FORWARD: 0, OTHER: 0}
        self.peak_running: dict[str, int] = {FORWARD: 0, OTHER: 0}
        self.live_total = 0
        self.peak_total = 0
        self.limit_bytes = limit_bytes
        self.armed = False
        self.component: str | None = None  # set by the rank (weights, optimizer_states, ...); None: from the phase
        self.last_stage = False  # outside forward and backward, the last stage is computing its loss
        self.param_shapes: set[tuple[int, ...]] = set()  # shapes a gradient has (global and local)
        self.failure: dict | None = None
        self.peak_at: dict[str, str] | None = None  # the op and component of the allocation that set peak_total

    def __enter__(self):  # type: ignore[no-untyped-def]
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _tracked_resize  # type: ignore[method-assign]
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back through here
        collective = _is_collective(func)
        if collective:  # an in-place one hands back its input: the handles it had before
            refs_before = {id(a): a._use_count() for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)}
        try:
            out = func(*args, **(kwargs or {}))
        except torch.OutOfMemoryError as e:
            if not isinstance(e, SimulatedOutOfMemory) and self.failure is None:
                self._note_device_failure(func, args, kwargs or {}, str(e))
            raise
        if collective:
            _settle_collective(refs_before, out)
        if active_fake_mode() is not None:
            return out  # DTensor's sharding propagation computing shapes on fake tensors: no memory
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and not isinstance(t, FakeTensor):
                self._add(t.untyped_storage(), func, t)
        return out

    def _add(self, st: torch.UntypedStorage, func=None, t: torch.Tensor | None = None) -> None:  # type: ignore[no-untyped-def]
        key = st._cdata
        if key in self._storages and self._storages[key][0]() is not None:
            return
        size = st.nbytes()
        phase = self.phase
        self._storages[key] = [weakref.ref(st, lambda _r, k=key: self._drop(k)), phase, size]
        self._grow(phase, size)
        if t is not None and size and self.live_total == self.peak_total:  # a new peak: what reached it
            self.peak_at = {"op": str(func), "component": self.component_of(t)}
        if self.armed and self.limit_bytes is not None and self.live_total > self.limit_bytes and t is not None:
            self._exceeded(str(func), list(t.shape), str(t.dtype).replace("torch.", ""), size, self.component_of(t))

    def _grow(self, phase: str, size: int) -> None:
        self._running[phase] += size
        self.peak_running[phase] = max(self.peak_running[phase], self._running[phase])
        self.live_total += size
        self.peak_total = max(self.peak_total, self.live_total)

    def resized(self, st: torch.UntypedStorage) -> None:
        entry = self._storages.get(st._cdata)
        if entry is None or entry[0]() is None:
            return
        delta = st.nbytes() - entry[2]
        entry[2] += delta
        self._grow(entry[1], delta)
        if delta > 0 and self.armed and self.limit_bytes is not None and self.live_total > self.limit_bytes:
            self._exceeded("storage.resize_ (FSDP all-gather of parameters)", [delta], "uint8", delta, TEMPORARY)

    def _drop(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self._running[entry[1]] -= entry[2]
            self.live_total -= entry[2]

    def component_of(self, t: torch.Tensor) -> str:
        """What an allocation is, by what the rank is doing: what the rank said (building the
        model: weights; the optimizer step: optimizer states), else the forward (activations),
        the backward (a tensor of a parameter's shape: gradients; else temporaries), or between
        them on the last stage, the loss."""
        if self.component is not None:
            return self.component
        if self.phase == FORWARD:
            return ACTIVATIONS
        if torch._C._current_graph_task_id() != -1:  # inside autograd's backward
            return GRADIENTS if tuple(t.shape) in self.param_shapes else TEMPORARY
        return LOSS if self.last_stage else ACTIVATIONS

    def _exceeded(self, op: str, shape: list[int], dtype: str, size: int, component: str) -> None:
        self.failure = {"op": op, "shape": shape, "dtype": dtype, "allocation_bytes": int(size),
                        "live_bytes": int(self.live_total - size), "live_forward_bytes": int(self._running[FORWARD]),
                        "limit_bytes": int(self.limit_bytes or 0), "component": component, "simulated": True,
                        "message": None}
        raise SimulatedOutOfMemory(
            f"simulated out of memory: {op} allocating {size} bytes {shape} with {self.live_total - size} bytes live, "
            f"over the {self.limit_bytes} bytes the device leaves torch")

    def note_failure(self, op: str, shape: list[int] | None, dtype: str | None, size: int | None, component: str,
                     message: str | None = None) -> None:
        """A real out-of-memory error (a GPU's): what was being allocated."""
        if self.failure is None:
            self.failure = {"op": op, "shape": shape, "dtype": dtype, "allocation_bytes": size,
                            "live_bytes": int(self.live_total), "live_forward_bytes": int(self._running[FORWARD]),
                            "limit_bytes": self.limit_bytes, "component": component, "simulated": False,
                            "message": message}

    def _note_device_failure(self, func, args, kwargs, message: str) -> None:  # type: ignore[no-untyped-def]
        """The op that failed, its output's shape (the op run again on fake tensors; None if it
        cannot be) and the size torch's message says it tried to allocate."""
        m = _TRIED_TO_ALLOCATE.search(message)
        size = int(float(m.group(1)) * _UNIT_BYTES[m.group(2)]) if m else None
        shape, dtype = None, None
        first = _fake_output(func, args, kwargs)
        if first is not None:
            shape, dtype = list(first.shape), str(first.dtype).replace("torch.", "")
        component = self.component_of(first) if first is not None else (self.component or
                                                                          (ACTIVATIONS if self.phase == FORWARD else TEMPORARY))
        self.note_failure(str(func), shape, dtype, size, component, message.strip().splitlines()[0][:500])

    def arm(self) -> None:
        """Check the limit from now on; raises SimulatedOutOfMemory if what is live already
        exceeds it (the model's own sharded parameters)."""
        self.armed = True
        if self.limit_bytes is not None and self.live_total > self.limit_bytes:
            self.failure = {"op": "materialise (the model's parameters after sharding)", "shape": None, "dtype": None,
                            "allocation_bytes": int(self.live_total), "live_bytes": 0, "live_forward_bytes": 0,
                            "limit_bytes": int(self.limit_bytes), "component": self.component or WEIGHTS,
                            "simulated": True, "message": None}
            raise SimulatedOutOfMemory(f"simulated out of memory: {self.live_total} bytes of parameters, over "
                                       f"the {self.limit_bytes} bytes the device leaves torch")

    def reset_peak_total(self) -> None:
        self.peak_total = self.live_total
        self.peak_at = None

    def age(self) -> None:
        """Count every storage alive now as OTHER: a new step's activations start from zero
        (whatever an earlier forward left alive is not this step's)."""
        for entry in list(self._storages.values()):
            born, size = entry[1], entry[2]
            if born != OTHER:
                entry[1] = OTHER
                self._running[born] -= size
                self._running[OTHER] += size

    def reset_peaks(self) -> None:
        self.peak_running = dict(self._running)

    def live_bytes(self, phase: str, exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        """Bytes now held by storages born in `phase`, those in `exclude` left out."""
        total = 0
        for key, (ref, born, _) in list(self._storages.items()):
            st = ref()
            if st is not None and born == phase and key not in exclude:
                total += st.nbytes()
        return total


def settled(sample, quiet_samples: int = 10, interval_seconds: float = 0.002, limit_seconds: float = 0.5) -> int:
    """`sample()` once the storages a gloo collective's worker thread still held have gone.
    Gloo completes a collective on its own thread, which drops its references to the input
    and output a moment after `wait()` returns; on a busy CPU a buffer the model has already
    dropped can still be alive when a forward ends (+3.5% on some sequence-parallel runs, the
    all-gathered or reduce-scattered (tokens x hidden) buffer). Sampled until unchanged
    `quiet_samples` times in a row (20 ms), within `limit_seconds`: with more runnable
    processes than cores that thread can wait tens of milliseconds for a core (a 5 ms window
    once let a pipeline stage's received buffer count, +60%). NCCL frees through the caching
    allocator in stream order, so it is not needed there."""
    value = sample()
    same = 0
    deadline = time.monotonic() + limit_seconds
    while same < quiet_samples and time.monotonic() < deadline:
        time.sleep(interval_seconds)
        now = sample()
        same = same + 1 if now == value else 0
        value = now
    return value


class HostBytes:
    """Model states in host memory, per kind, at their peak. Offloaded states are the ones on
    the CPU: on GPUs that is their device; on a CPU-only run everything is on the CPU, so the
    states FSDP2's CPUOffloadPolicy keeps in host memory (sharded parameters, their gradients
    and the optimizer states) count as offloaded and nothing else does."""

    def __init__(self, offloaded: bool) -> None:
        self.offloaded = offloaded
        self.peak = Peak()

    def on_host(self, t: torch.Tensor) -> bool:
        return self.offloaded and t.device.type == "cpu"

    def device_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        return tensors_bytes(t for t in tensors if not self.on_host(t))

    def offer(self, kind: str, tensors: Iterable[torch.Tensor]) -> None:
        self.peak.offer(kind, tensors_bytes(t for t in tensors if self.on_host(t)))

    def total(self) -> int:
        return sum(self.peak.values.values())


class Peak:
    """A running maximum of named samples."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def offer(self, name: str, value: int) -> None:
        self.values[name] = max(self.values.get(name, 0), value)

    def get(self, name: str) -> int:
        return self.values.get(name, 0)


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """The optimizer's state tensors (a master-weights optimizer's fp32 masters included)."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "state_tensors"):
        return optimizer.state_tensors()
    out: list[torch.Tensor] = []
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    return out


def param_storage_keys(modules: Iterable[torch.nn.Module]) -> set[int]:
    """Storages of the modules' parameters and buffers (ops that view them, e.g. a weight's
    transpose or a slice of the RoPE cache, must not count as activations)."""
    return {storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}


def gathered_param_bytes(modules: Iterable[torch.nn.Module], at_rest: set[int]) -> int:
    """Bytes of the parameters registered right now whose storage is not one of the at-rest
    (sharded) storages `at_rest`: under FSDP, the all-gathered ones."""
    return tensors_bytes(p for m in modules for p in m.parameters() if storage_key(p) not in at_rest)
