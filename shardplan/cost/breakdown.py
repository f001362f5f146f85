"""Memory breakdowns whose parts sum to their total."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU by category. `total` is the sum of the parts, always."""

    weights: float = 0.0
    kv_cache: float = 0.0
    activations: float = 0.0
    gradients: float = 0.0
    optimizer_states: float = 0.0
    temporary: float = 0.0  # ZeRO-3/FSDP gathered parameters in flight
    overhead: float = 0.0  # CUDA context, library workspaces, NCCL buffers, CUDA graphs

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.kv_cache
            + self.activations
            + self.gradients
            + self.optimizer_states
            + self.temporary
            + self.overhead
        )

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total"] = self.total
        return d


@dataclass(frozen=True)
class RankMemory:
    """One distinct kind of rank (a pipeline stage); every rank of that stage looks alike."""

    stage: int
    layers: tuple[int, int]  # first and last layer index held (inclusive)
    num_ranks: int  # how many GPUs share this memory picture
    breakdown: MemoryBreakdown
    detail: dict[str, float] = field(default_factory=dict)  # named sub-items, bytes
    host_bytes: float = 0.0  # offloaded to CPU RAM by this rank
    nvme_bytes: float = 0.0  # offloaded to NVMe by this rank
    # The largest single tensor at the peak: the caching allocator needs a fresh block of this
    # size, so it reserves the total plus it (training: the fp32 logits of the loss).
    largest_allocation_bytes: float = 0.0
    largest_allocation: str = ""
    # Blocks the caching allocator holds apart from the peak's: memory freed on one stream that an
    # allocation on another cannot reuse (FSDP's gradients, reduce-scattered on their own stream, beside
    # the activations backward freed on the compute stream).
    reserved_apart_bytes: float = 0.0

    @property
    def reserved_bytes(self) -> float:
        return self.breakdown.total + self.largest_allocation_bytes + self.reserved_apart_bytes


@dataclass(frozen=True)
class SecondsBreakdown:
    """Base of the time breakdowns: every field is seconds, and `total` is their sum."""

    def as_parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def total(self) -> float:
        return sum(self.as_parts().values())

    def as_dict(self) -> dict[str, float]:
        d = self.as_parts()
        d["total"] = self.total
        return d
