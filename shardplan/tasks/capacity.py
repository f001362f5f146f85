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
are `cost.estimate.estimate(...)` of that layout. Pure: no yaml, rich or typer. Results are the
frozen models ServingCapacity and TrainingCapacity (CapacityResult is either).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Literal, Union

from pydantic import Field, RootModel

from shardplan.cost.estimate import estimate
from shardplan.cost.report import FitAtBandEdge, TrainingMemoryReport, TrainingTimeReport
from shardplan.cost.layout import Layout, Offload
from shardplan.cost.time_serving import serving_time
from shardplan.cost.memory_serving import ServingMemory, serving_memory
from shardplan.cost.workload import InferenceWorkload, Quantization, TrainingWorkload
from shardplan.cost.inputs import OFFLOAD_CHOICES, offload_pair
from shardplan.search import Goal, Objective, Space, search
from shardplan.search.space import check_layout, gpu_counts, topology, tp_choices
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec
from shardplan.search.targets import TargetRules, serving_refusal
from shardplan.tasks._bands import banded
from shardplan.tasks._targets import RunsOn, check_target, engine_label, search_rules, workload_refused
from shardplan.tasks._results import Result, absent

DEFAULT_MAX_NODES = 64  # --max-gpus defaults to this many whole nodes
QUANTIZED_FORMATS = (Quantization.FP8, Quantization.INT8, Quantization.INT4)
ZERO_STAGES = (0, 1, 2, 3)
PARAM_OFFLOADS = ("all-cpu", "all-nvme")  # parameters offloaded too: ZeRO-3 only


Progress = Callable[[int, int], None]  # (done, total)


class PerTpRow(Result):
    """One replica of `tp` GPUs of one node (pp = 1) at the stated concurrency."""

    tp: int = Field(description="tensor-parallel degree (GPUs)")
    ep: int = Field(description="expert-parallel degree (1: experts not split)")
    serves: bool = Field(description="holds `concurrency` sequences of max_model_len tokens")
    reason: str | None = Field(description="why the engine does not start; None when it does")
    most_sequences: int = Field(description="sequences of max_model_len tokens the KV cache holds at once (count)")
    longest_context_tokens: int = Field(description="longest max_model_len at `concurrency` sequences (tokens); 0: none")
    kv_capacity_tokens: int = Field(description="tokens the KV cache holds (tokens)")
    longest_context_tokens_offloaded: int | None = absent(
        "with every decoder layer's weights in host memory (the engine's offload, the most room and the slowest): "
        "the longest max_model_len at `concurrency` sequences (tokens)")
    most_sequences_offloaded: int | None = absent("likewise, the most sequences of max_model_len tokens (count)")
    tpot_seconds_offloaded: float | None = absent("time per output token of one sequence so offloaded (seconds)")


class FormatRow(Result):
    """The fewest GPUs for one weight format. The layout's figures (plan .. kv_cache) are
    present only when a layout was found."""

    weight_dtype: str = Field(description="bf16/fp16 (the model's own) or the quantized format")
    quantization: str = Field(description="none, fp8, int8 or int4")
    min_num_gpus: int | None = Field(description="fewest GPUs that serve (count); None: not found up to max_gpus")
    num_nodes: int | None = Field(description="nodes of that count (count); None: not found")
    not_found: str | None = Field(description="why nothing was found; None when found")
    plan: dict[str, int] | None = absent("the layout's degrees: tp, pp, dp, ep")
    fits: bool | None = absent("the estimate's verdict for the layout")
    fit_at_band_edge: FitAtBandEdge | None = absent("fits / tight at the KV band's edge (as `estimate --json`)")
    per_gpu_bytes: dict[str, float] | None = absent("the estimate's memory per GPU by component (bytes)")
    headroom_bytes: float | None = absent("device memory left per GPU (bytes)")
    budget_bytes: float | None = absent("vLLM's memory budget per GPU (bytes)")
    kv_cache: dict[str, int | float] | None = absent("the estimate's KV cache figures (see `estimate --json`)")
    per_tp: list[PerTpRow] = Field(description="per tensor-parallel size of one node")
    runs_on: list[str] | None = absent("the targets that run the layout found (knowledge/targets.yaml)")


class QuantizationUnshards(Result):
    """When the model's own weights need more than one GPU and a quantized format fits on one."""

    weight_dtype: str = Field(description="the widest quantized format that fits on one GPU")
    weight_dtypes: list[str] = Field(description="every quantized format that fits on one GPU")
    dense_weight_dtype: str = Field(description="the model's own weight format")
    dense_min_num_gpus: int | None = Field(description="GPUs the own format needs (count); None: more than max_gpus")


class ServingCapacity(Result):
    """`capacity --json` for serving."""

    model: str
    hardware: str
    workload: Literal["inference"]
    gpus_per_node: int = Field(description="GPUs per node (count)")
    max_gpus: int = Field(description="largest GPU count considered (count)")
    gpu_counts_considered: list[int] = Field(description="GPU counts tried, ascending (count)")
    max_model_len: int = Field(description="tokens per sequence the GPUs must hold (tokens)")
    concurrency: int = Field(description="sequences held at once (count)")
    kv_cache_dtype: str = Field(description="KV cache dtype; auto: the activation dtype")
    gpu_memory_utilization: float = Field(description="the engine's budget as a share of device memory (0-1)")
    engine: str = Field("vLLM", description="the engine and version whose rules sized the memory, as printed")
    max_num_seqs: int = Field(description="the engine's most sequences at once (count)")
    formats: list[FormatRow]
    quantization_removes_sharding: QuantizationUnshards | None
    target: str | None = absent("--target: only layouts it runs (and verify checks), only formats it loads")


class TrainingRow(Result):
    """The fewest GPUs for one ZeRO stage and offload choice; the layout's figures (plan ..
    step_seconds) are present only when one was found."""

    zero_stage: int = Field(description="ZeRO stage 0-3")
    offload: str = Field(description="offload choice (none, optimizer-cpu, ..., all-nvme)")
    min_num_gpus: int | None = Field(description="fewest GPUs at which a layout fits (count); None: not found")
    num_nodes: int | None = Field(description="nodes of that count (count); None: not found")
    not_found: str | None = Field(description="why nothing was found; None when found")
    plan: dict[str, Any] | None = absent("the fastest layout there (as `estimate --json` prints its plan)")
    fits: bool | None = absent("the estimate's verdict")
    fit_at_band_edge: FitAtBandEdge | None = absent("fits / tight at the peak-memory band's edge (as `estimate --json`)")
    per_gpu_bytes: dict[str, float] | None = absent("memory per GPU by component (bytes)")
    headroom_bytes: float | None = absent("device memory left per GPU (bytes)")
    host_offload_bytes_per_node: float | None = absent("host memory the offload uses per node (bytes)")
    nvme_offload_bytes_per_node: float | None = absent("NVMe the offload uses per node (bytes)")
    step_seconds: float | None = absent("one optimizer step (seconds)")
    runs_on: list[str] | None = absent("the targets that run the layout found (knowledge/targets.yaml)")


class TrainingCapacity(Result):
    """`capacity --json` for training."""

    model: str
    hardware: str
    workload: Literal["training"]
    gpus_per_node: int = Field(description="GPUs per node (count)")
    max_gpus: int = Field(description="largest GPU count considered (count)")
    gpu_counts_considered: list[int] = Field(description="GPU counts tried, ascending (count)")
    seq_len: int = Field(description="tokens per sequence (tokens)")
    global_batch_size: int = Field(description="sequences per optimizer step (count)")
    framework: str = Field(description="training stack the memory model follows")
    stack: str | None = Field(None, description="the training stack whose capabilities bound the rows (its ZeRO "
                                                "stages, offload and parallelism; knowledge/targets.yaml stack_targets)")
    rows: list[TrainingRow]
    target: str | None = absent("--target: only the ZeRO stages and offload it runs, only layouts it runs "
                                "(and verify checks)")


class CapacityResult(RootModel[Union[ServingCapacity, TrainingCapacity]]):
    """What `capacity --json` prints: ServingCapacity or TrainingCapacity (by `workload`)."""

    root: Union[ServingCapacity, TrainingCapacity] = Field(discriminator="workload")

    @property
    def found(self) -> bool:
        rows = self.root.formats if isinstance(self.root, ServingCapacity) else self.root.rows
        return any(r.min_num_gpus for r in rows)


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


def replica_layouts(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload | None = None,
                    rules: TargetRules | None = None) -> Iterator[Layout]:
    """One replica on all of `hw`'s GPUs (dp = 1): every tp the search allows (divides the
    heads, KV heads and MLP width, inside a node), pp the rest; MoE models: ep 1 or tp, as
    the serving search tries them; with `rules` (a --target's) only those it runs for `wl`."""
    n = hw.num_gpus
    for tp in tp_choices(spec, hw, n, Space(), Counter()):
        pp = n // tp
        if pp > spec.num_layers:
            continue
        for ep in [1, tp] if spec.moe is not None and tp > 1 else [1]:
            layout = Layout(tp=tp, pp=pp, dp=1, ep=ep)
            if check_layout(spec, layout, n, False, Counter()) and (
                    wl is None or serving_refusal(rules, spec, hw, layout, wl) is None):
                yield layout


def _most_room(candidates: list[Served]) -> Served:
    """Of several layouts that serve, the one whose KV cache holds the most; ties: smaller tp, ep."""
    return max(candidates, key=lambda s: (s.memory.max_concurrency, -s.layout.tp, -s.layout.ep))


def min_serving(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, concurrency: int, max_gpus: int,
                rules: TargetRules | None = None) -> Served | None:
    """At the smallest GPU count (of those the search tries up to `max_gpus`: powers of two
    inside a node, then whole nodes) at which some replica serves, that replica; else None."""
    for n in gpu_counts(hw, num_gpus=None, max_gpus=max_gpus):
        hwn = topology(hw, n)
        served = [s for s in (check_serving(spec, hwn, lay, wl, concurrency) for lay in replica_layouts(spec, hwn, wl, rules))
                  if s.serves]
        if served:
            return _most_room(served)
    return None


def longest_context_tokens(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, concurrency: int) -> int:
    """The largest max_model_len (up to the model's max_position_embeddings, which vLLM will
    not exceed) at which `layout` holds `concurrency` sequences; 0 if none. Bisection: a
    longer context only needs more KV cache, so the test is monotone."""
    def ok(tokens: int) -> bool:
        return check_serving(spec, hw, layout, replace(wl, max_model_len=tokens), concurrency).serves

    return _largest_that_holds(0, spec.max_position_embeddings, ok)  # ok(0) holds vacuously


def _largest_that_holds(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest n in [lo, hi] with ok(n), for a test that holds up to some n and not beyond
    (monotone), given that ok(lo) holds. Bisection."""
    if ok(hi):
        return hi
    while hi - lo > 1:  # invariant: ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


FIXED_CONTEXT_MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: the most slots llama-server takes


def most_sequences(s: Served, spec: ModelSpec | None = None) -> int:
    """Sequences of max_model_len tokens the KV cache holds at once (vLLM's maximum
    concurrency, rounded down); 0 when the engine does not start. An engine that allocates the
    context it is asked for (llama.cpp: --parallel slots of max_model_len) holds what it is given:
    the most slots whose cache still fits, by bisection (more slots only need more memory)."""
    if s.workload.accounting != "fixed_context" or spec is None:
        return int(math.floor(s.memory.max_concurrency)) if s.memory.fits else 0

    def fits(n: int) -> bool:
        return serving_memory(spec, s.hw, s.layout, replace(s.workload, max_num_seqs=n)).fits

    return _largest_that_holds(1, FIXED_CONTEXT_MAX_SEQUENCES, fits) if fits(1) else 0


def _format_label(wl: InferenceWorkload, q: Quantization) -> str:
    return wl.activation_dtype.value if q is Quantization.NONE else q.value


def _serving_figures(spec: ModelSpec, s: Served) -> dict[str, Any]:
    """The estimate's own memory and KV figures for one layout (what `estimate --json` prints)."""
    report = banded(estimate(spec, s.hw, s.layout, s.workload), s.hw)
    assert report.kv_cache is not None  # a serving estimate always has one
    plan = report.plan
    return {
        "plan": {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "ep": plan.ep},
        "fits": report.fits,
        "fit_at_band_edge": report.fit_at_band_edge,
        "per_gpu_bytes": report.memory.per_gpu_bytes,
        "headroom_bytes": report.memory.headroom_bytes,
        "budget_bytes": report.memory.budget_bytes,
        "kv_cache": report.kv_cache.model_dump(mode="json"),
    }


def _per_tp(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, concurrency: int,
            rules: TargetRules | None = None) -> list[PerTpRow]:
    """For each tensor-parallel size inside a node (pp = 1, one replica): the longest context
    at `concurrency` sequences and the most sequences at wl.max_model_len."""
    node = topology(hw, hw.gpus_per_node)
    rows = []
    for tp in tp_choices(spec, node, node.num_gpus, Space(), Counter()):
        hwt = topology(hw, tp)
        options = [check_serving(spec, hwt, lay, wl, concurrency) for lay in replica_layouts(spec, hwt, wl, rules)
                   if lay.pp == 1]
        if not options:
            continue
        s = _most_room(options)
        rows.append(PerTpRow(
            tp=tp,
            ep=s.layout.ep,
            serves=s.serves,
            reason=None if s.memory.fits else s.memory.reason,
            most_sequences=most_sequences(s, spec),
            longest_context_tokens=longest_context_tokens(spec, hwt, s.layout, wl, concurrency),
            kv_capacity_tokens=s.memory.kv_capacity_tokens,
            **_offloaded(spec, hwt, s.layout, wl, concurrency, rules),
        ))
    return rows


def _offloaded(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload,
               concurrency: int, rules: TargetRules | None = None) -> dict[str, Any]:
    """The same replica with every decoder layer's weights held in host memory, where the engine
    (and the --target) can (`offload_targets`): its longest context, most sequences and decode
    time at batch 1."""
    if "cpu" not in wl.offload_targets or layout.pp > 1:
        return {}
    off = replace(layout, offload_layers=spec.num_layers, offload_params=Offload.CPU)
    if serving_refusal(rules, spec, hw, off, wl) is not None:
        return {}
    s = check_serving(spec, hw, off, wl, concurrency)
    t = serving_time(spec, hw, off, replace(wl, batch_size=1), 1) if s.memory.fits else None
    return dict(longest_context_tokens_offloaded=longest_context_tokens(spec, hw, off, wl, concurrency),
                most_sequences_offloaded=most_sequences(s, spec), tpot_seconds_offloaded=t.tpot_seconds if t else None)


def serving_capacity(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, *, concurrency: int,
                     max_gpus: int, target: str | None = None) -> ServingCapacity:
    """What `capacity --json` prints for serving (wl.max_model_len is the stated context).
    `target`: only the formats it loads and the layouts it runs (and verify checks)."""
    if target is not None:
        check_target(target, spec, hw, wl)
    rules = search_rules(target, spec, wl)
    runs_on = RunsOn(spec)
    # The engine's own quantized formats (llama.cpp: GGUF mixtures), one of each size (awq and
    # gptq store what int4 does); an engine without the list: fp8, int8, int4.
    # Not the bytes a quantized checkpoint (CHECKPOINT_KINDS) planned as it ships already holds (int4 for a
    # 4-bit one): its own row leads.
    as_shipped = spec.checkpoint_quantization is not None and spec.ships(wl.quantization.value)
    engine_formats = [Quantization(f) for f in wl.weight_formats if f not in ("awq", "gptq")
                      and not (as_shipped and spec.ships(f))]
    formats = [Quantization.NONE, *(engine_formats or QUANTIZED_FORMATS)]
    if wl.quantization is not Quantization.NONE:
        # The format the checkpoint ships in, which the engine loads as it is (inputs.inference_workload:
        # block FP8, gpt-oss's MXFP4 experts), is the first row; a 16-bit copy is not what it loads.
        formats = [wl.quantization, *(f for f in formats if f not in (wl.quantization, Quantization.NONE))]
    context = wl.max_model_len or spec.max_position_embeddings
    wl = replace(wl, max_model_len=context)
    rows: list[FormatRow] = []
    for q in formats:
        wlq = replace(wl, quantization=q)
        if workload_refused(rules, spec, hw, wlq):
            continue  # a format the target does not load
        best = min_serving(spec, hw, wlq, concurrency, max_gpus, rules)
        if best is None:
            found: dict[str, Any] = dict(min_num_gpus=None, num_nodes=None, not_found=(
                f"no layout of up to {max_gpus} GPUs holds {concurrency} sequence(s) of {context:,} tokens"))
        else:
            found = dict(min_num_gpus=best.hw.num_gpus, num_nodes=best.hw.num_nodes, not_found=None,
                         runs_on=runs_on.of(best.hw, best.layout, best.workload), **_serving_figures(spec, best))
        rows.append(FormatRow(weight_dtype=_format_label(wl, q), quantization=q.value, **found,
                              per_tp=_per_tp(spec, hw, wlq, concurrency, rules)))
    return ServingCapacity(
        model=spec.name,
        hardware=hw.name,
        workload="inference",
        gpus_per_node=hw.gpus_per_node,
        max_gpus=max_gpus,
        gpu_counts_considered=gpu_counts(hw, num_gpus=None, max_gpus=max_gpus),
        max_model_len=context,
        concurrency=concurrency,
        kv_cache_dtype=wl.kv_cache_dtype.value if wl.kv_cache_dtype else "auto",
        gpu_memory_utilization=wl.gpu_memory_utilization,
        engine=engine_label(wl) if wl.engine_version is not None else wl.engine,
        max_num_seqs=wl.max_num_seqs,
        formats=rows,
        quantization_removes_sharding=_unsharded_by_quantization(rows),
        target=target,
    )


def _unsharded_by_quantization(rows: list[FormatRow]) -> QuantizationUnshards | None:
    """When the 16-bit weights need more than one GPU (or none found) and a quantized format
    fits on one: the widest such format, and every one that does."""
    if not rows:
        return None
    dense, quantized = rows[0], rows[1:]
    if dense.min_num_gpus == 1:
        return None
    on_one = [r.weight_dtype for r in quantized if r.min_num_gpus == 1]
    if not on_one:
        return None
    return QuantizationUnshards(weight_dtype=on_one[0], weight_dtypes=on_one, dense_weight_dtype=dense.weight_dtype,
                                dense_min_num_gpus=dense.min_num_gpus)


def training_choices() -> list[tuple[int, str]]:
    """(ZeRO stage, offload choice) pairs the training capacity tries: parameter offload only
    under ZeRO-3."""
    return [(z, off) for z in ZERO_STAGES for off in OFFLOAD_CHOICES if not (off in PARAM_OFFLOADS and z != 3)]


def training_capacity(spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, *, max_gpus: int,
                      space: Space | None = None, progress: Progress | None = None,
                      target: str | None = None) -> TrainingCapacity:
    """What `capacity --json` prints for training: per ZeRO stage and offload choice the fewest
    GPUs at which the training search finds a layout that fits, and the fastest one there.
    `progress(done, total)` is called after each of the searches (one per row). `target`: only
    layouts it runs (and verify checks); without it, only layouts the workload's stack runs
    (knowledge/targets.yaml stack_targets). A ZeRO stage and offload they never run has no row."""
    if target is not None:
        check_target(target, spec, hw, wl)
    base = replace(space or Space(), rules=search_rules(target, spec, wl))
    runs_on = RunsOn(spec)
    rows: list[TrainingRow] = []
    choices = training_choices()
    for done, (z, off) in enumerate(choices, start=1):
        res = search(spec, hw, wl, replace(base, zero_stage=z, offload=offload_pair(off)),
                     Goal(Objective.STEP_TIME, top_k=1), max_gpus=max_gpus, first_fit=True)
        if base.rules is not None and res.num_candidates == 0:
            pass  # the target (or the stack) runs no layout with this ZeRO stage and offload: no row
        elif not res.top:
            rows.append(TrainingRow(
                zero_stage=z, offload=off, min_num_gpus=None, num_nodes=None,
                not_found=f"no layout of up to {max_gpus} GPUs fits at {wl.seq_len:,} tokens x {wl.global_batch_size} sequences"))
        else:
            best = res.top[0]
            report = banded(estimate(spec, best.hw, best.layout, best.workload), best.hw)
            mem, time = report.memory, report.time
            assert isinstance(mem, TrainingMemoryReport) and isinstance(time, TrainingTimeReport)
            rows.append(TrainingRow(
                zero_stage=z, offload=off, min_num_gpus=best.num_gpus, num_nodes=best.hw.num_nodes, not_found=None,
                plan=report.plan.model_dump(mode="json"), fits=report.fits, fit_at_band_edge=report.fit_at_band_edge,
                per_gpu_bytes=mem.per_gpu_bytes,
                headroom_bytes=mem.headroom_bytes, host_offload_bytes_per_node=mem.host_offload_bytes_per_node,
                nvme_offload_bytes_per_node=mem.nvme_offload_bytes_per_node, step_seconds=time.step_seconds,
                runs_on=runs_on.of(best.hw, best.layout, best.workload),
            ))
        if progress is not None:
            progress(done, len(choices))
    return TrainingCapacity(
        model=spec.name,
        hardware=hw.name,
        workload="training",
        gpus_per_node=hw.gpus_per_node,
        max_gpus=max_gpus,
        gpu_counts_considered=gpu_counts(hw, num_gpus=None, max_gpus=max_gpus),
        seq_len=wl.seq_len,
        global_batch_size=wl.global_batch_size,
        framework=wl.framework.value,
        stack=wl.stack,
        rows=rows,
        target=target,
    )
