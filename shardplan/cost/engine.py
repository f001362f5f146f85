"""An engine's rules (knowledge/engines/*.yaml, resolved to `EngineRules`) applied to one
deployment: the serving defaults and budget switches the cost model reads, each with the
sentence that says which rule set it and why.

The profiling pass: vLLM sizes the KV cache after one forward of max_num_batched_tokens
tokens (V0 `Worker.determine_num_available_blocks`, V1 `gpu_worker.determine_available_memory`
-> `profile_run`). Its default follows the scheduler's rules: without chunked prefill
max(max_model_len, 2048) tokens; with it, the chunked budget (by version and device). V0
turned chunked prefill on by itself only above a 32K context, so V0's verdict is not
monotonic in max_model_len: a longer context can profile a smaller pass and fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.knowledge.schema import EngineRules
from shardplan.specs.hardware import HardwareProfile
from shardplan.units import BYTES_PER_GIB


@dataclass(frozen=True)
class ServingDefaults:
    """The engine's effective settings for one deployment and why each has its value."""

    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    block_size: int
    cuda_context_in_budget: bool
    cuda_graphs_in_budget: bool
    refusal: str
    accounting: str
    static_fraction_by_tp: tuple[tuple[int, float], ...]
    assumptions: tuple[str, ...]


def chunked_prefill_on(rules: EngineRules, max_model_len: int, asked: bool | None, multimodal: bool) -> tuple[bool, str]:
    era = rules.era
    if era.chunked_prefill == "always":
        return True, f"{rules.label}: chunked prefill is always on ({era.sources['chunked_prefill']})"
    if asked is not None:
        return asked, f"{rules.label}: chunked prefill {'on' if asked else 'off'}, as asked"
    if era.chunked_prefill == "above_context" and not multimodal:
        above = era.chunked_prefill_above_tokens
        assert above is not None  # the schema requires it for above_context
        on = max_model_len > above
        return on, (f"{rules.label}: chunked prefill {'on' if on else 'off'} by default because max_model_len "
                    f"{max_model_len:,} is {'above' if on else 'at most'} {above:,} ({era.sources['chunked_prefill']})")
    return False, f"{rules.label}: chunked prefill off by default ({era.sources['chunked_prefill']})"


def resolve_serving(rules: EngineRules, hw: HardwareProfile, *, max_model_len: int, multimodal: bool = False,
                    max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                    gpu_memory_utilization: float | None = None, block_size: int | None = None,
                    enable_chunked_prefill: bool | None = None) -> ServingDefaults:
    """Fill what the user left out with the engine's defaults for this device and context."""
    era = rules.era
    memory_gib = hw.memory_capacity_bytes / BYTES_PER_GIB
    device = hw.gpu_model
    notes: list[str] = []
    if max_num_seqs is None:
        max_num_seqs = rules.by_device(era.max_num_seqs, memory_gib, device)
        notes.append(f"{rules.label}: max_num_seqs {max_num_seqs} by default on {device} ({era.sources['max_num_seqs']})")
    chunked, why = chunked_prefill_on(rules, max_model_len, enable_chunked_prefill, multimodal)
    notes.append(why)
    if max_num_batched_tokens is None:
        if chunked:
            max_num_batched_tokens = rules.by_device(era.chunked_budget_tokens, memory_gib, device)
            notes.append(f"{rules.label}: profile pass of {max_num_batched_tokens:,} tokens, the chunked-prefill "
                         f"budget on {device} ({era.sources['chunked_budget_tokens']})")
        else:
            max_num_batched_tokens = max(max_model_len, era.unchunked_min_tokens)
            notes.append(f"{rules.label}: profile pass of {max_num_batched_tokens:,} tokens = max(max_model_len, "
                         f"{era.unchunked_min_tokens:,}) without chunked prefill ({era.sources['unchunked_min_tokens']})")
    by_tp: tuple[tuple[int, float], ...] = ()
    if era.accounting == "static_fraction":
        assert era.static_fraction_by_tp is not None  # the schema requires it
        notes.append(f"{rules.label}: a static pool of (free memory at start) x mem_fraction_static holds the weights "
                     f"and the KV cache; activations and CUDA graphs use the rest ({era.sources['accounting']})")
        if gpu_memory_utilization is None:
            by_tp = tuple(sorted(((r.min_tp, r.value) for r in era.static_fraction_by_tp), reverse=True))
            gpu_memory_utilization = era.gpu_memory_utilization
            notes.append(f"{rules.label}: mem_fraction_static by tensor-parallel size, "
                         + ", ".join(f"{v:g} from tp {t}" for t, v in by_tp) + f" ({era.sources['static_fraction_by_tp']})")
    elif gpu_memory_utilization is None:
        gpu_memory_utilization = era.gpu_memory_utilization
        notes.append(f"{rules.label}: gpu_memory_utilization {gpu_memory_utilization:g} by default "
                     f"({era.sources['gpu_memory_utilization']})")
    if block_size is None:
        block_size = era.block_size
    notes.append(f"{rules.label}: the CUDA context is {'inside' if era.cuda_context_in_budget else 'outside'} the "
                 f"budget ({era.sources['cuda_context_in_budget']})")
    notes.append(f"{rules.label}: CUDA graphs are {'inside' if era.cuda_graphs_in_budget else 'outside'} the budget "
                 f"({era.sources['cuda_graphs_in_budget']})")
    return ServingDefaults(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
        cuda_context_in_budget=era.cuda_context_in_budget, cuda_graphs_in_budget=era.cuda_graphs_in_budget,
        refusal=era.refusal, accounting=era.accounting, static_fraction_by_tp=by_tp, assumptions=tuple(notes),
    )


__all__ = ["ServingDefaults", "chunked_prefill_on", "resolve_serving"]
