"""Per-rank memory accounting from torch's own view of its tensors: a TorchDispatchMode that
sees every storage an op allocates (as torch.distributed._tools.mem_tracker.MemTracker does;
DTensor ops are seen as the local ops they run), tagged with the phase it was born in.

Steady-state categories (parameters, gradients, optimizer state, KV cache) are the storage
bytes of the tensors that hold them; activations are the forward-born storages still alive
when a forward ends (what backward will read), sampled at every chunk's forward end so that
a pipeline's in-flight micro-batches add up; serving activations are the running peak of
forward-born storages; ZeRO-3 temporaries are the gathered (unsharded) parameters alive at a
block boundary. Sizes are read live (`nbytes()`), so FSDP's `resize_(0)` frees count.
"""

from __future__ import annotations

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


class StorageTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = OTHER
        self._storages: dict[int, tuple[weakref.ref, str, int]] = {}
        self._running: dict[str, int] = {FORWARD: 0, OTHER: 0}
        self.peak_running: dict[str, int] = {FORWARD: 0, OTHER: 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back through here
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not None:
            return out  # DTensor's sharding propagation computing shapes on fake tensors: no memory
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and not isinstance(t, FakeTensor):
                self._add(t.untyped_storage())
        return out

    def _add(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self._storages and self._storages[key][0]() is not None:
            return
        size = st.nbytes()
        phase = self.phase
        self._storages[key] = (weakref.ref(st, lambda _r, k=key: self._drop(k)), phase, size)
        self._running[phase] += size
        if self._running[phase] > self.peak_running[phase]:
            self.peak_running[phase] = self._running[phase]

    def _drop(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self._running[entry[1]] -= entry[2]

    def age(self) -> None:
        """Count every storage alive now as OTHER: a new step's activations start from zero
        (whatever an earlier forward left alive is not this step's)."""
        for key, (ref, born, size) in list(self._storages.items()):
            if born != OTHER:
                self._storages[key] = (ref, OTHER, size)
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


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
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
