"""Training search: an exact branch and bound over every layout of one GPU count.

A layout is three levels deep:
  degrees  tp, cp, pp, dp, ep                      (their product with pp.. is the GPU count)
  shape    + micro-batch, virtual stages, sequence parallelism, recomputation
           (fixes the compute and TP/EP/CP traffic of every micro-batch)
  variant  + ZeRO stage, hybrid sharding, offload  (fixes the model states and their traffic)
A large cluster has 10^5-10^7 layouts; costing each (~1 ms) would take hours, as it does in
Calculon. Each level has a lower bound on the step that holds for everything below it:
  degrees  min over (micro-batch, SP, recompute) of (m + (pp-1)/v_max) x T_layers / pp
  shape    (m + (pp-1)/v) x max(stage 0's layers' time, T_layers / pp)  (`step_seconds_lower_bound`)
  refined  every stage's exact compute + TP/EP/CP comm, the bubble and p2p (`pipeline_seconds`)
where T_layers sums every layer's own per-micro-batch time (`layers_seconds_lower_bound`); the
terms left out (data-parallel sync, ZeRO-3 gathers, the optimizer, offload) are non-negative.
Nodes are expanded best bound first from one heap; once the K-th best step found is below
the smallest bound left, nothing unexpanded can enter the top K and the search stops, counting
what it skipped. Memory prunes a shape when its turn comes (most shapes pushed never get one):
stage 0's activations plus the least model states of any ZeRO variant
(`activation_bytes_lower_bound`, `stage_states_and_gradients`, `total_lower_bound`). Ranked by
parallel shape (the default), a shape's entries skip once a faster variant of the same (tp, pp,
dp, cp, ep) is kept: one slower cannot take that shape's place in the top K.
An offloaded variant is never faster than the same ZeRO variant without offload (offload adds
host traffic and a CPU optimizer step): where that twin fits, its value is the offloaded one's
bound and it waits in the heap; where it does not, the offloaded one is costed with the shape.
(An offloaded ZeRO-1 can beat a plain ZeRO-3 that fits: LoRA's optimizer step on the CPU is
nearly free, ZeRO-3's gathers are not.)
A variant's step is computed before its memory (the shape's pipeline is already known; its
sync, ZeRO-3, optimizer and offload terms are cheap beside the memory model): one slower than
the K-th best kept cannot enter the top K, fit or not, and is dropped unmeasured. On Llama 3.1
405B over 16,384 H100s this leaves 17 memory models to cost (35 before the same-shape prune).
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache
from typing import Any, Iterator

from shardplan.cost.accuracy import memory_fits_at_edge
from shardplan.cost.layout import Layout, Offload, PipelineSchedule, Recompute
from shardplan.cost import memo
from shardplan.cost.memory_training import (
    activation_bytes_lower_bound,
    stage_states_and_gradients,
    total_lower_bound,
    training_memory,
    training_memory_unless_over_gpu,
)
from shardplan.cost.time_training import (
    shape_layers_seconds,
    pipeline_seconds,
    step_seconds_lower_bound,
    training_time,
)
from shardplan.cost.workload import TrainingWorkload
from shardplan.search.targets import Admission, fields_read, setting
from shardplan.search.space import (
    BUDGET_SPENT,
    SECONDS_PER_HOUR,
    TIGHT,
    TOKENS_PER_MILLION,
    Evaluated,
    Goal,
    Objective,
    Progress,
    SearchResult,
    Space,
    check_layout,
    divisors,
    layout_shape,
    memory_reason,
    price_per_gpu_hour,
    tp_choices,
)
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec

Variant = tuple[int, bool, Offload, Offload]  # zero stage, hybrid shard, offload optimizer, offload params
_NO_OFFLOAD = (Offload.NONE, Offload.NONE)
_OFFLOADS = ((Offload.CPU, Offload.NONE), (Offload.NVME, Offload.NONE))
_PARAM_OFFLOADS = ((Offload.CPU, Offload.CPU), (Offload.NVME, Offload.NVME))

# Heap entries: (bound, tie-break key, kind, payload). Kinds, in the order ties expand them; an
# _OFFLOADED entry holds offloaded variants whose plain twin fits, bounded by that twin's value.
_DEGREES, _SHAPE, _REFINED, _OFFLOADED = 0, 1, 2, 3
OFFLOAD_SLOWER = "offload: slower than the same layout without it"
BEYOND_BOUND = "cannot beat the top {k} (lower bound on the step)"
SLOWER_THAN_TOP = "cannot beat the top {k} (its step, before its memory)"
SHAPE_KEPT = "cannot beat the faster variant of its parallel shape already kept"


def state_variants(layout: Layout, hw: HardwareProfile, space: Space,
                   adm: Admission | None = None) -> tuple[list[Variant], list[Variant]]:
    """ZeRO stage x hybrid sharding of one set of degrees, without offload and with it (those the
    target's rules admit, with `adm`: its state rules read degree facts only, so a shape's
    variants are its degrees')."""
    plain: list[Variant] = []
    offloaded: list[Variant] = []
    zeros = [space.zero_stage] if space.zero_stage is not None else [0, 1, 2, 3]
    replicas = layout.dp * layout.cp
    # One data-parallel replica has nothing to shard over: ZeRO stages only differ from stage 0 by
    # the offload they carry (DeepSpeed's ZeRO-Offload takes optimizer offload from stage 1, and
    # ZeRO-Infinity parameter offload at stage 3: deepspeed.ai docs config-json), so each offload
    # is tried once, at the least stage that runs it.
    lone = replicas == 1 and space.zero_stage is None
    for z in zeros:
        if lone and z == 2:
            continue
        for hyb in [space.hybrid_shard] if space.hybrid_shard is not None else [False, True]:
            if hyb and space.hybrid_shard is None and (z == 0 or hw.gpus_per_node // layout.tp >= replicas):
                continue  # hybrid sharding only differs when the replicas span nodes
            if space.offload is not None:
                offloads = [space.offload]
            elif space.allow_offload:
                offloads = [_NO_OFFLOAD, *_OFFLOADS, *(_PARAM_OFFLOADS if z == 3 else ())]
            else:
                offloads = [_NO_OFFLOAD]
            for opt, par in offloads:
                if par is not Offload.NONE and z != 3:
                    continue
                if lone and (z != 0 if (opt, par) == _NO_OFFLOAD else (par is Offload.NONE and z != 1)):
                    continue
                (plain if (opt, par) == _NO_OFFLOAD else offloaded).append((z, hyb, opt, par))
    if adm is not None and adm.rules.state:
        plain = [v for v in plain if adm.state(with_variant(layout, v))]
        offloaded = [v for v in offloaded if adm.state(with_variant(layout, v))]
    return plain, offloaded


class _StateVariants:
    """`state_variants` of one search (one GPU count, its space and rules), each computed once
    for the layout fields it reads: tp, dp and cp, and the fields the target's state rules read
    (`fields_read`). The search asks for the same degrees' variants from the count, the
    expansion and every refined shape (a refused verdict is counted once either way: `Admission`
    counts each distinct verdict). The lists returned are shared: callers only read them."""

    def __init__(self, hw: HardwareProfile, space: Space, adm: Admission | None) -> None:
        self._hw, self._space, self._adm = hw, space, adm
        rules = fields_read(adm.rules.state) if adm is not None and adm.rules.state else ()
        self._fields = ("tp", "dp", "cp", *rules)
        self._known: dict[tuple[Any, ...], tuple[list[Variant], list[Variant]]] = {}

    def __call__(self, layout: Layout) -> tuple[list[Variant], list[Variant]]:
        values = layout.__dict__
        key = tuple([values[f] for f in self._fields])
        found = self._known.get(key)
        if found is None:
            found = self._known[key] = state_variants(layout, self._hw, self._space, self._adm)
        return found


def _evolve(layout: Layout, **changes: Any) -> Layout:
    """`dataclasses.replace` for the search's hot loops, without re-running `__init__` and
    `__post_init__` (a third of the time of building a shape): the callers pass values that are
    already of the fields' types (enums as enums), which is all `__post_init__` would ensure."""
    new = object.__new__(Layout)
    new.__dict__.update(layout.__dict__, **changes)
    return new


def with_variant(layout: Layout, v: Variant) -> Layout:
    return _evolve(layout, zero_stage=v[0], hybrid_shard=v[1], offload_optimizer=Offload(v[2]), offload_params=Offload(v[3]))


def degree_candidates(spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, space: Space, res: SearchResult,
                      adm: Admission | None = None) -> Iterator[Layout]:
    """tp, cp, pp, dp, ep that can exist (micro-batch 1, one virtual stage), and that the
    target's workload, model and degree rules admit (`adm`; refusals counted by rule)."""
    n = hw.num_gpus
    for tp in tp_choices(spec, hw, n, space, res.invalid):
        for cp in [space.cp] if space.cp else divisors(n // tp):
            if (n // tp) % cp or (cp > 1 and wl.seq_len % (2 * cp)):
                res.invalid["cp does not divide the GPUs, or 2 x cp the sequence"] += 1
                continue
            for pp in [space.pp] if space.pp else divisors(n // (tp * cp)):
                if (n // (tp * cp)) % pp or pp > spec.num_layers:
                    res.invalid["pp does not divide the GPUs or exceeds the layers"] += 1
                    continue
                dp = n // (tp * cp * pp)
                if (space.dp and space.dp != dp) or wl.global_batch_size % dp:
                    res.invalid["global batch not divisible by dp (or dp not the pinned one)"] += 1
                    continue
                if space.ep:
                    eps = [space.ep]
                elif spec.moe is not None:
                    eps = [e for e in divisors(spec.moe.num_experts) if (dp * cp * tp) % e == 0]
                else:
                    eps = [1]
                for ep in eps:
                    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
                    if not check_layout(spec, layout, n, True, res.invalid):
                        continue
                    refused = adm.early(layout) if adm is not None else None
                    if refused is not None:
                        res.invalid[refused] += 1
                        continue
                    yield layout


def _micro_batches(wl: TrainingWorkload, space: Space, deg: Layout) -> list[int]:
    per_replica = wl.global_batch_size // deg.dp
    if space.micro_batch_size:
        return [space.micro_batch_size] if per_replica % space.micro_batch_size == 0 else []
    # Powers of two, as frameworks' tuned kernels and published configs use; --micro-batch-size pins any.
    return [b for b in divisors(per_replica) if b <= space.max_micro_batch_size and b & (b - 1) == 0]


def _pipelines(spec: ModelSpec, wl: TrainingWorkload, space: Space, deg: Layout, mbs: int,
               adm: Admission | None = None) -> tuple[tuple[int, PipelineSchedule], ...]:
    """(virtual stages, schedule) for one micro-batch size. Megatron's interleaved schedule
    needs the micro-batches to divide evenly among the pp stages; the target's pipeline rules
    (`adm`) may refuse more (torch's 1F1B: fewer micro-batches than stages)."""
    pipes = _pipelines_of(spec.num_layers, wl.global_batch_size, space.virtual_stages, space.max_virtual_stages,
                          space.pp_schedule, deg.pp, deg.dp, mbs)
    return adm.pipelines(deg, mbs, pipes) if adm is not None else pipes


@lru_cache(maxsize=8192)
def _pipelines_of(num_layers: int, global_batch_size: int, virtual_stages: int | None, max_virtual_stages: int,
                  pp_schedule: PipelineSchedule | None, pp: int, dp: int, mbs: int) -> tuple[tuple[int, PipelineSchedule], ...]:
    m = global_batch_size // (dp * mbs)
    if virtual_stages:
        vs = [virtual_stages]
    elif pp == 1:
        vs = [1]
    else:
        vs = [v for v in range(1, max_virtual_stages + 1) if pp * v <= num_layers]
    out = []
    for v in vs:
        sched = pp_schedule or (PipelineSchedule.INTERLEAVED if v > 1 else PipelineSchedule.ONE_F_ONE_B)
        if sched is PipelineSchedule.INTERLEAVED and (pp == 1 or m % pp):
            continue
        if v > 1 and sched is not PipelineSchedule.INTERLEAVED:
            continue
        out.append((v, sched))
    return tuple(out)


def _flags(space: Space, deg: Layout, wl: TrainingWorkload, adm: Admission | None = None) -> tuple[list[bool], list[Recompute]]:
    sps = [space.sequence_parallel] if space.sequence_parallel is not None else ([False, True] if deg.tp > 1 else [False])
    sps = [sp for sp in sps if not (sp and deg.tp == 1)]
    # the checkpointing the stack offers (Hugging Face: none or full)
    rcs = [space.recompute] if space.recompute is not None else [r for r in Recompute if r.value in wl.recompute_offered]
    if adm is not None:
        return adm.flags(deg, sps, [Recompute(r) for r in rcs])
    return sps, rcs


def shape_candidates(spec: ModelSpec, wl: TrainingWorkload, space: Space, deg: Layout,
                     adm: Admission | None = None) -> Iterator[Layout]:
    sps, rcs = _flags(space, deg, wl, adm)
    rcs = [Recompute(rc) for rc in rcs]
    for mbs in _micro_batches(wl, space, deg):
        for v, sched in _pipelines(spec, wl, space, deg, mbs, adm):
            sched = PipelineSchedule(sched)
            for sp in sps:
                for rc in rcs:
                    yield _evolve(deg, micro_batch_size=mbs, virtual_stages=v, pp_schedule=sched, sequence_parallel=sp, recompute=rc)


def _num_layouts(spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, space: Space, deg: Layout,
                 adm: Admission | None = None, variants: _StateVariants | None = None) -> int:
    """Layouts under one set of degrees, counted without building them."""
    sps, rcs = _flags(space, deg, wl, adm)
    shapes = sum(len(_pipelines(spec, wl, space, deg, mbs, adm)) for mbs in _micro_batches(wl, space, deg)) * len(sps) * len(rcs)
    plain, offloaded = variants(deg) if variants is not None else state_variants(deg, hw, space, adm)
    return shapes * (len(plain) + len(offloaded))


def objective_value(goal: Goal, hw: HardwareProfile, num_gpus: int, step_seconds: float, tokens_per_step: float) -> float:
    if goal.objective is Objective.COST:
        price = price_per_gpu_hour(hw, goal) or 0.0
        return price * num_gpus / SECONDS_PER_HOUR * step_seconds / tokens_per_step * TOKENS_PER_MILLION
    return step_seconds


def degrees_bound(spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, space: Space, deg: Layout,
                  adm: Admission | None = None) -> float:
    """min over micro-batch, SP and recomputation of (m + (pp-1)/v_max) x (all layers' time) / pp:
    the slowest stage takes at least the mean, whatever the virtual stages."""
    sps, rcs = _flags(space, deg, wl, adm)
    if not rcs:
        return math.inf
    # Recomputation only adds work (a recomputed forward, a third pass of TP/EP traffic), so
    # the least recomputation allowed gives the least time.
    rc = Recompute(min(rcs, key=lambda r: _RECOMPUTE_RANK[Recompute(r)]))
    etp = deg.expert_tp
    best = math.inf
    for mbs in _micro_batches(wl, space, deg):
        pipes = _pipelines(spec, wl, space, deg, mbs, adm)
        if not pipes:
            continue
        v_max = max(v for v, _ in pipes)
        m = wl.global_batch_size // (deg.dp * mbs)
        for sp in sps:
            mean_stage = shape_layers_seconds(spec, hw, wl, deg.tp, deg.cp, deg.ep, etp, sp, rc, mbs) / deg.pp
            best = min(best, (m + (deg.pp - 1) / v_max) * mean_stage)
    return best


def _key(layout: Layout) -> tuple[Any, ...]:
    """Deterministic tie-break: fewer GPUs, then smaller degrees, larger micro-batches, SP on,
    less recomputation."""
    return (
        layout.world_size, layout.tp, layout.pp, layout.cp, layout.ep, layout.virtual_stages,
        -layout.micro_batch_size, not layout.sequence_parallel, _RECOMPUTE_RANK[layout.recompute],
    )


_RECOMPUTE_RANK = {r: i for i, r in enumerate(Recompute)}  # less recomputation first

def search_training(
    spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, space: Space, goal: Goal, res: SearchResult,
    progress: Progress | None = None,
) -> None:
    n = hw.num_gpus
    cap = float(hw.memory_capacity_bytes)
    tokens = wl.global_batch_size * wl.seq_len
    k = max(1, goal.top_k)
    band = goal.tie_band_fraction or 0.0
    heap: list[tuple[float, tuple[Any, ...], int, Any]] = []
    candidates_before = res.num_candidates
    # The target's (or the stack's runtime) rules, checked at each stage (search/targets.py).
    adm = Admission(space.rules, setting(spec, hw, wl)) if space.rules is not None else None
    variants = _StateVariants(hw, space, adm)
    for deg in degree_candidates(spec, hw, wl, space, res, adm):
        count = _num_layouts(spec, hw, wl, space, deg, adm, variants)
        if count == 0:
            by_target = adm is not None and _num_layouts(spec, hw, wl, space, deg) > 0
            res.invalid[f"{space.rules.name}: no micro-batch, schedule or state it runs" if by_target  # type: ignore[union-attr]
                        else "no micro-batch or schedule divides the batch"] += 1
            continue
        res.num_candidates += count
        res.num_steps += 1
        bound = objective_value(goal, hw, n, degrees_bound(spec, hw, wl, space, deg, adm), tokens)
        heap.append((bound, _key(deg), _DEGREES, (deg, count)))
    heapq.heapify(heap)
    total = res.num_candidates - candidates_before  # this GPU count's layouts, like `done` below
    best: list[Evaluated] = []
    evaluated_before = res.num_evaluated
    while heap:
        if res.num_steps >= res.step_limit:
            skipped = sum(_count(p, kd) for _, _, kd, p in heap)
            res.rejected[BUDGET_SPENT] += skipped
            res.num_evaluated += skipped
            break
        bound, key, kind, payload = heapq.heappop(heap)
        if kind != _DEGREES and goal.group_by_shape and best:
            # The top K hold one variant per parallel shape (tp, pp, dp, cp, ep): a shape, and each of
            # its state variants, only matters if it can beat the variant of its degrees kept so far.
            kept = _kept_value(best, payload[0])
            if kept is not None and bound > kept:
                res.rejected[SHAPE_KEPT] += payload[3]
                res.num_evaluated += payload[3]
                continue
        if bound > _cut(best, k, band):
            left = [(kind, payload), *((kd, p) for _, _, kd, p in heap)]
            slower = sum(_count(p, kd) for kd, p in left if kd == _OFFLOADED)
            if slower:
                res.rejected[OFFLOAD_SLOWER] += slower
            res.rejected[BEYOND_BOUND.format(k=k)] += sum(
                _count(p, kd) for kd, p in left if kd != _OFFLOADED)
            res.num_evaluated += sum(_count(p, kd) for kd, p in left)
            break
        if kind == _SHAPE:
            # Its memory prunes when its turn comes: most shapes pushed never get one.
            shape, m, least_states, count = payload
            plain_fits = _memory_prune(spec, hw, wl, res, shape, m, cap, variants(shape), least_states)
            if plain_fits is None:
                continue
            payload = (shape, m, plain_fits, count if plain_fits else len(variants(shape)[1]))
        res.num_steps += 1
        if kind == _DEGREES:
            deg, _ = payload
            _expand(spec, hw, wl, space, goal, res, deg, heap, cap, tokens, variants, adm)
        elif kind == _SHAPE:
            shape, m = payload[:2]
            tight = objective_value(goal, hw, n, pipeline_seconds(spec, hw, shape, wl, m), tokens)
            heapq.heappush(heap, (max(bound, tight), key, _REFINED, payload))
        elif kind == _REFINED:
            shape, m, plain_fits, count = payload
            plain, offloaded = variants(shape)
            fitted = _cost_variants(spec, hw, wl, goal, res, shape, plain, key, best, k, m, band) if plain_fits else {}
            # An offloaded variant is never faster than the same ZeRO variant without offload:
            # where that one fits, its value bounds the offloaded one, which waits in the heap.
            later: dict[float, list[Variant]] = {}
            now = []
            for v in offloaded:
                value = fitted.get(v[:2])
                if value is None:
                    now.append(v)
                else:
                    later.setdefault(value, []).append(v)
            if now:
                _cost_variants(spec, hw, wl, goal, res, shape, now, key, best, k, m, band)
            for value, waiting in later.items():
                heapq.heappush(heap, (value, key, _OFFLOADED, (shape, m, waiting, len(waiting))))
        else:
            shape, m, waiting, count = payload
            _cost_variants(spec, hw, wl, goal, res, shape, waiting, key, best, k, m, band)
        if progress is not None:
            progress(res.num_evaluated - evaluated_before, total)
    res.feasible.extend(best)
    if adm is not None:  # candidates the target's later-stage rules left out, by rule
        res.invalid.update(adm.refused)


def _shape(e: Evaluated) -> tuple[int, ...]:
    return layout_shape(e.layout)


def _kept_value(best: list[Evaluated], layout: Layout) -> float | None:
    """The objective of the variant of `layout`'s parallel shape among the top K kept, if any and
    if it fits at the band's edge (a slower variant that does may still rank ahead of a tight one)."""
    shape = layout_shape(layout)
    for e in best:
        if _shape(e) == shape:
            return None if e.tight else e.objective_value
    return None


def _count(payload: Any, kind: int) -> int:
    return payload[1] if kind == _DEGREES else payload[3]


def _expand(
    spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, space: Space, goal: Goal, res: SearchResult,
    deg: Layout, heap: list, cap: float, tokens: float, variants: _StateVariants, adm: Admission | None = None,
) -> None:
    """Push every shape of one set of degrees with its bound; its memory prunes wait for its turn
    (`_memory_prune`), sharing the least model states of the degrees' variants by virtual stages."""
    n = hw.num_gpus
    plain, offloaded = variants(deg)
    count = len(plain) + len(offloaded)
    least_states: dict[int, list[tuple[float, float]]] = {}
    for shape in shape_candidates(spec, wl, space, deg, adm):
        m = wl.global_batch_size // (shape.dp * shape.micro_batch_size)
        bound = objective_value(goal, hw, n, step_seconds_lower_bound(spec, hw, shape, wl, m), tokens)
        heapq.heappush(heap, (bound, _key(shape), _SHAPE, (shape, m, least_states, count)))


def _memory_prune(spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, res: SearchResult, shape: Layout, m: int,
                  cap: float, variants: tuple[list[Variant], list[Variant]],
                  least_states: dict[int, list[tuple[float, float]]]) -> bool | None:
    """None where no variant of `shape` can fit (stage 0's activations alone, or with the least
    model states of any variant, exceed the GPU; offloaded variants are left to their own
    costing), else whether its plain variants may fit. Rejections are counted."""
    plain, offloaded = variants
    act = activation_bytes_lower_bound(spec, hw, shape, wl, m)
    if act > cap:
        res.rejected["activations alone exceed GPU memory"] += len(plain) + len(offloaded)
        res.num_evaluated += len(plain) + len(offloaded)
        return None
    # by virtual stages: states do not depend on micro-batch, SP or recompute
    v_key = shape.virtual_stages
    if v_key not in least_states:
        least_states[v_key] = [stage_states_and_gradients(spec, hw, with_variant(shape, v), wl) for v in plain]
    if min((total_lower_bound(act, st, wl, m) for st in least_states[v_key]), default=math.inf) <= cap:
        return True
    res.rejected["model states + activations exceed GPU memory"] += len(plain)
    res.num_evaluated += len(plain)
    return False if offloaded else None


def _cost_variants(
    spec: ModelSpec, hw: HardwareProfile, wl: TrainingWorkload, goal: Goal, res: SearchResult, shape: Layout,
    variants: list[Variant], shape_key: tuple[Any, ...], best: list[Evaluated], k: int, m: int, band: float = 0.0,
) -> dict[tuple[int, bool], float]:
    """Cost each state variant of `shape` in full; keep the best k in `best`. Returns the value
    of each variant that fits, by (ZeRO stage, hybrid sharding)."""
    cap = float(hw.memory_capacity_bytes)
    tokens = wl.global_batch_size * wl.seq_len
    act = activation_bytes_lower_bound(spec, hw, shape, wl, m)
    # The verdict's rejection reads as memory_reason's GPU reason unless the profile's GPU name
    # holds one of the words memory_reason looks for first (then the full model decides).
    verdict = memo.ENABLED and memory_reason(hw.gpu_model) == memory_reason(None)
    fitted: dict[tuple[int, bool], float] = {}
    for v in variants:
        layout = with_variant(shape, v)
        res.num_evaluated += 1
        if total_lower_bound(act, stage_states_and_gradients(spec, hw, layout, wl), wl, m) > cap:
            res.rejected["model states + activations exceed GPU memory"] += 1
            continue
        # The step first: it reads the shape's pipeline (already costed for its bound) and the
        # variant's sync, ZeRO-3, optimizer and offload terms, a fraction of the memory model's
        # cost. A variant slower than the K-th best kept cannot enter the top K whether or not it
        # fits (the K-th best only improves), so its memory is never costed.
        tt = training_time(spec, hw, layout, wl, m)
        value = objective_value(goal, hw, layout.world_size, tt.step_seconds, tokens)
        if value > _cut(best, k, band):
            res.rejected[SLOWER_THAN_TOP.format(k=k)] += 1
            continue
        if goal.group_by_shape:
            kept = _kept_value(best, layout)
            if kept is not None and value > kept:
                res.rejected[SHAPE_KEPT] += 1
                continue
        res.num_costed += 1
        # The full model stops at the first stage over the GPU (stage 0 and the last first): most
        # layouts here end this way.
        tm = training_memory_unless_over_gpu(spec, hw, layout, wl) if verdict else training_memory(spec, hw, layout, wl)
        if tm is None:
            res.rejected["does not fit in GPU memory"] += 1
            continue
        if not tm.fits:
            res.rejected[memory_reason(tm.reason)] += 1
            continue
        tight = not memory_fits_at_edge(max(r.reserved_bytes for r in tm.ranks), cap, goal.peak_memory_band_fraction)
        if tight and goal.strict_fit:  # a tighter memory test: the bounds above stay lower bounds
            res.rejected[TIGHT] += 1
            continue
        res.num_feasible += 1
        figures = {
            "step_seconds": tt.step_seconds,
            "tokens_per_second_per_gpu": tt.tokens_per_second_per_gpu,
            "mfu": tt.mfu,
            "headroom_bytes": cap - max(r.breakdown.total for r in tm.ranks),
        }
        fitted[(v[0], v[1])] = value
        best.append(Evaluated(layout, wl, hw, value, shape_key + (v[0], v[1], v[2].value, v[3].value), figures, tight))
        best.sort(key=lambda e: (e.tight, e.objective_value, e.key))  # as `search.honest_top` ranks them
        if goal.group_by_shape:
            # The best K distinct parallel shapes (issue 25): a variant (ZeRO, recompute, virtual
            # stages, micro-batch) of a shape already kept does not take a place of its own.
            seen: set[tuple[int, ...]] = set()
            best[:] = [e for e in best if not (_shape(e) in seen or seen.add(_shape(e)))]  # type: ignore[func-returns-value]
        edge = _band_edge(best, band)
        del best[max(k, sum(1 for e in best if e.objective_value <= edge)):]
    return fitted


def _band_edge(best: list[Evaluated], band: float) -> float:
    """The largest objective that may tie with the first plan shown (`search.honest_top`: within
    the model's error band of it, the pick among them decided by the secondary key; a hair over,
    for its rounding, which also keeps exactly equal plans without a band); -inf before any plan is
    kept. The first shown is `best[0]` (plans that fit at the band's edge first): once one of those
    is kept, a plan found later can only lower it, so the edge only moves in (`_cut` prunes nothing
    before K of them are kept)."""
    if not best:
        return -math.inf
    head = best[0].objective_value
    ref = abs(head) or 1.0
    return head + band * ref + 2e-12 * ref


def _cut(best: list[Evaluated], k: int, band: float) -> float:
    """The objective beyond which a plan cannot be shown, as `search.honest_top` ranks: plans that
    fit at the band's edge before those that fit only at the prediction (tight), which no tight plan
    displaces, so the K-th of those kept (until K are kept, any plan may still be shown); and the
    edge of the first's tie band where that lies further (every tie is kept, so that the pick is the
    best by the secondary key among all of them, whatever K is)."""
    if len(best) < k or best[k - 1].tight:
        return math.inf
    return max(best[k - 1].objective_value, _band_edge(best, band))
