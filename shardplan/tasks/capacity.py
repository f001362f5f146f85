"""capacity: the least hardware a model needs, and the most one layout holds.

Serving, per weight format (the model's 16-bit dtype, fp8, int8, int4): the fewest GPUs at
which one replica (dp = 1) holds `concurrency` sequences of `max_model_len` tokens, searched
over the GPU counts and tensor/pipeline degrees the recommend search considers valid
(`search.space`: tp divides the heads and stays inside a node, pp takes the rest); then, for
each tensor-parallel size of one node (pp = 1), the longest context at that concurrency and
the most sequences at that context. Training, per ZeRO stage and offload choice: the fewest
GPUs at which the training search finds any layout that fits.

Nothing here has its own memory formula: a layout "serves" when vLLM's start-up arithmetic
(`cost.memory_serving.serving_memory`, what `estimate` reports) fits and its maximum
concurrency at `max_model_len` is at least `concurrency`; the figures shown for each answer
are `cost.estimate.estimate(...)` of that layout. Pure: no yaml, rich or typer.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterator

from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import ServingMemory, serving_memory
from shardplan.cost.workload import InferenceWorkload, Quantization, TrainingWorkload
from shardplan.cost.inputs import OFFLOAD_CHOICES, offload_pair
from shardplan.search import Goal, Objective, Space, search
from shardplan.search.space import check_layout, gpu_counts, topology, tp_choices
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec

DEFAULT_MAX_NODES = 64  # --max-gpus defaults to this many whole nodes
QUANTIZED_FORMATS = (Quantization.FP8, Quantization.INT8, Quantization.INT4)
ZERO_STAGES = (0, 1, 2, 3)
PARAM_OFFLOADS = ("all-cpu", "all-nvme")  # parameters offloaded too: ZeRO-3 only


def default_max_gpus(hw: HardwareProfile) -> int:
    return DEFAULT_MAX_NODES * hw.gpus_per_node


@dataclass(frozen=True)
class Served:
    """One serving layout checked at one workload: its memory and whether it serves."""

    layout: Layout
    hw: HardwareProfile
    workload: InferenceWorkload
    memory: ServingMemory
    serves: bool


def check_serving(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, concurrency: int) -> Served:
    """Does `layout` hold `concurrency` sequences of wl.max_model_len tokens? vLLM's own test:
    the engine starts (`fits`) and its reported maximum concurrency is at least that."""
    sm = serving_memory(spec, hw, layout, wl)
    return Served(layout, hw, wl, sm, sm.fits and sm.max_concurrency >= concurrency)


def replica_layouts(spec: ModelSpec, hw: HardwareProfile) -> Iterator[Layout]:
    """One replica on all of `hw`'s GPUs (dp = 1): every tp the search allows (divides the
    heads, KV heads and MLP width, inside a node), pp the rest; MoE models: ep 1 or tp, as
    the serving search tries them."""
    n = hw.num_gpus
    for tp in tp_choices(spec, hw, n, Space(), Counter()):
        pp = n // tp
        if pp > spec.num_layers:
            continue
        for ep in [1, tp] if spec.moe is not None and tp > 1 else [1]:
            layout = Layout(tp=tp, pp=pp, dp=1, ep=ep)
            if check_layout(spec, layout, n, False, Counter()):
                yield layout


def _most_room(candidates: list[Served]) -> Served:
    """Of several layouts that serve, the one whose KV cache holds the most; ties: smaller tp, ep."""
    return max(candidates, key=lambda s: (s.memory.max_concurrency, -s.layout.tp, -s.layout.ep))


def min_serving(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, concurrency: int, max_gpus: int) -> Served | None:
    """At the smallest GPU count (of those the search tries up to `max_gpus`: powers of two
    inside a node, then whole nodes) at which some replica serves, that replica; else None."""
    for n in gpu_counts(hw, num_gpus=None, max_gpus=max_gpus):
        hwn = topology(hw, n)
        served = [s for s in (check_serving(spec, hwn, lay, wl, concurrency) for lay in replica_layouts(spec, hwn)) if s.serves]
        if served:
            return _most_room(served)
    return None


def longest_context_tokens(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, concurrency: int) -> int:
    """The largest max_model_len (up to the model's max_position_embeddings, which vLLM will
    not exceed) at which `layout` holds `concurrency` sequences; 0 if none. Bisection: a
    longer context only needs more KV cache, so the test is monotone."""
    def ok(tokens: int) -> bool:
        return check_serving(spec, hw, layout, replace(wl, max_model_len=tokens), concurrency).serves

    lo, hi = 0, spec.max_position_embeddings  # ok(lo) holds (vacuously for 0)
    if ok(hi):
        return hi
    while hi - lo > 1:  # invariant: ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def most_sequences(s: Served) -> int:
    """Sequences of max_model_len tokens the KV cache holds at once (vLLM's maximum
    concurrency, rounded down); 0 when the engine does not start."""
    return int(math.floor(s.memory.max_concurrency)) if s.memory.fits else 0


def _format_label(wl: InferenceWorkload, q: Quantization) -> str:
    return wl.activation_dtype.value if q is Quantization.NONE else q.value


def _serving_figures(spec: ModelSpec, s: Served) -> dict[str, Any]:
    """The estimate's own memory and KV figures for one layout (what `estimate --json` prints)."""
    report = estimate(spec, s.hw, s.layout, s.workload).as_dict()
    mem = report["memory"]
    return {
        "plan": {k: report["plan"][k] for k in ("tp", "pp", "dp", "ep")},
        "fits": report["fits"],
        "per_gpu_bytes": mem["per_gpu_bytes"],
        "headroom_bytes": mem["headroom_bytes"],
        "budget_bytes": mem["budget_bytes"],
        "kv_cache": report["kv_cache"],
    }


def _per_tp(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, concurrency: int) -> list[dict[str, Any]]:
    """For each tensor-parallel size inside a node (pp = 1, one replica): the longest context
    at `concurrency` sequences and the most sequences at wl.max_model_len."""
    node = topology(hw, hw.gpus_per_node)
    rows = []
    for tp in tp_choices(spec, node, node.num_gpus, Space(), Counter()):
        hwt = topology(hw, tp)
        options = [check_serving(spec, hwt, lay, wl, concurrency) for lay in replica_layouts(spec, hwt) if lay.pp == 1]
        if not options:
            continue
        s = _most_room(options)
        rows.append({
            "tp": tp,
            "ep": s.layout.ep,
            "serves": s.serves,
            "reason": None if s.memory.fits else s.memory.reason,
            "most_sequences": most_sequences(s),
            "longest_context_tokens": longest_context_tokens(spec, hwt, s.layout, wl, concurrency),
            "kv_capacity_tokens": s.memory.kv_capacity_tokens,
        })
    return rows


def serving_capacity(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, *, concurrency: int, max_gpus: int) -> dict[str, Any]:
    """What `capacity --json` prints for serving (wl.max_model_len is the stated context)."""
    formats = [Quantization.NONE, *QUANTIZED_FORMATS]
    context = wl.max_model_len or spec.max_position_embeddings
    wl = replace(wl, max_model_len=context)
    rows: list[dict[str, Any]] = []
    for q in formats:
        wlq = replace(wl, quantization=q)
        best = min_serving(spec, hw, wlq, concurrency, max_gpus)
        row: dict[str, Any] = {"weight_dtype": _format_label(wl, q), "quantization": q.value}
        if best is None:
            row.update(min_num_gpus=None, num_nodes=None, not_found=(
                f"no layout of up to {max_gpus} GPUs holds {concurrency} sequence(s) of {context:,} tokens"))
        else:
            row.update(min_num_gpus=best.hw.num_gpus, num_nodes=best.hw.num_nodes, not_found=None,
                       **_serving_figures(spec, best))
        row["per_tp"] = _per_tp(spec, hw, wlq, concurrency)
        rows.append(row)
    return {
        "model": spec.name,
        "hardware": hw.name,
        "workload": "inference",
        "gpus_per_node": hw.gpus_per_node,
        "max_gpus": max_gpus,
        "gpu_counts_considered": gpu_counts(hw, num_gpus=None, max_gpus=max_gpus),
        "max_model_len": context,
        "concurrency": concurrency,
        "kv_cache_dtype": wl.kv_cache_dtype.value if wl.kv_cache_dtype else "auto",
        "gpu_memory_utilization": wl.gpu_memory_utilization,
        "max_num_seqs": wl.max_num_seqs,
        "formats": rows,
        "quantization_removes_sharding": _unsharded_by_quantization(rows),
    }


def _unsharded_by_quantization(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """When the 16-bit weights need more than one GPU (or none found) and a quantized format
    fits on one: the widest such format, and every one that does."""
    dense, quantized = rows[0], rows[1:]
    if dense["min_num_gpus"] == 1:
        return None
    on_one = [r["weight_dtype"] for r in quantized if r["min_num_gpus"] == 1]
    if not on_one:
        return None
    return {"weight_dtype": on_one[0], "weight_dtypes": on_one, "dense_weight_dtype": dense["weight_dtype"],
            "dense_min_num_gpus": dense["min_num_gpus"]}


def training_capacity(spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, *, max_gpus: int, space: Space | None = None) -> dict[str, Any]:
    """What `capacity --json` prints for training: per ZeRO stage and offload choice the fewest
    GPUs at which the training search finds a layout that fits, and the fastest one there."""
    base = space or Space()
    rows: list[dict[str, Any]] = []
    for z in ZERO_STAGES:
        for off in OFFLOAD_CHOICES:
            if off in PARAM_OFFLOADS and z != 3:
                continue
            res = search(spec, hw, wl, replace(base, zero_stage=z, offload=offload_pair(off)),
                         Goal(Objective.STEP_TIME, top_k=1), max_gpus=max_gpus, first_fit=True)
            row: dict[str, Any] = {"zero_stage": z, "offload": off}
            if not res.top:
                row.update(min_num_gpus=None, num_nodes=None,
                           not_found=f"no layout of up to {max_gpus} GPUs fits at {wl.seq_len:,} tokens x {wl.global_batch_size} sequences")
                rows.append(row)
                continue
            best = res.top[0]
            report = estimate(spec, best.hw, best.layout, best.workload).as_dict()
            mem = report["memory"]
            row.update(
                min_num_gpus=best.num_gpus, num_nodes=best.hw.num_nodes, not_found=None,
                plan=report["plan"], fits=report["fits"], per_gpu_bytes=mem["per_gpu_bytes"],
                headroom_bytes=mem["headroom_bytes"], host_offload_bytes_per_node=mem["host_offload_bytes_per_node"],
                nvme_offload_bytes_per_node=mem["nvme_offload_bytes_per_node"],
                step_seconds=report["time"]["step_seconds"],
            )
            rows.append(row)
    return {
        "model": spec.name,
        "hardware": hw.name,
        "workload": "training",
        "gpus_per_node": hw.gpus_per_node,
        "max_gpus": max_gpus,
        "gpu_counts_considered": gpu_counts(hw, num_gpus=None, max_gpus=max_gpus),
        "seq_len": wl.seq_len,
        "global_batch_size": wl.global_batch_size,
        "framework": wl.framework.value,
        "rows": rows,
    }
