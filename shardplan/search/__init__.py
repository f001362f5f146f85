"""recommend's search: candidate generators -> structural and bound prunes -> full cost -> ranking.

Rules (tests/test_architecture.py): pure, imports no yaml, rich, typer or torch, and nothing
from `plan`, `exporters`, `tasks`, `verify` or `cli`; the CLI passes a progress callback and renders the result.
`serving.py` costs every replica and batch; `training.py` is an exact branch and bound over
tp, cp, pp, dp, ep, micro-batch, virtual stages, SP, recomputation, ZeRO and offload. Ties
break on a fixed key (fewer GPUs, smaller degrees, ...), so results are deterministic. The
shortcuts that keep every search under a second change no result (cost/memo.py lists them;
`memo.reference_path()` runs without them, tests/search/test_search_memo.py compares the two).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

from shardplan.cost import memo
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import ShardplanError
from shardplan.search.space import (
    SERVING_OBJECTIVES,
    TRAINING_OBJECTIVES,
    Evaluated,
    Goal,
    Objective,
    Progress,
    SearchResult,
    Space,
    layout_shape,
    gpu_counts,
    price_per_gpu_hour,
    topology,
)
from shardplan.search.training import search_training
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec

__all__ = ["Evaluated", "Goal", "Objective", "SearchResult", "Space", "honest_top", "parallel_shape", "search"]


PROGRESS_STEPS = 1000  # progress units per GPU count


def parallel_shape(e: Evaluated) -> tuple[int, ...]:
    """What a plan's GPUs do (`layout_shape`)."""
    return layout_shape(e.layout)


def secondary_key(e: Evaluated) -> tuple[Any, ...]:
    """Which of the plans tied with the first is the pick (issue 25): fewer GPUs; tensor
    parallelism inside a node before across nodes; less communication (a smaller context-parallel group, whose ring passes K/V chunks every layer of
    every micro-batch; fewer pipeline stages; a smaller tensor-parallel group); the simpler
    schedule (fewer virtual stages, lower ZeRO stage, less recomputation); then the search's own
    deterministic key. (Context parallelism first: of 29 published expert layouts one more is
    the pick, DeepSeek-V3's tp 2 pp 16 on 1,024 H100s, and none fewer;
    tests/golden/test_nvidia_layouts.py.) `explain.PICK_AMONG_TIES` says it in words."""
    lay = e.layout
    spans = lay.tp > e.hw.gpus_per_node
    recompute = {"none": 0, "selective": 1, "full": 2}.get(lay.recompute.value, 3)
    return (e.num_gpus, spans, lay.cp, lay.pp, lay.tp, lay.virtual_stages, lay.zero_stage, recompute, e.key)


def honest_top(ranked: list[Evaluated], goal: Goal) -> list[Evaluated]:
    """The top K by the objective, each parallel shape once (its best variant, with how many it
    stands for) unless `goal.group_by_shape` is off. Plans whose objective is within the error
    band of the first (`goal.tie_band_fraction`) are ties (marked): the pick is the tie with the
    best `secondary_key`, and the others follow by the objective (equal values by the search's
    deterministic key, the order the search keeps them in), so that the K shown are the K best
    distinct shapes the model sees, not the simplest variants of the pick's own family (a list ordered wholly by the secondary key filled its places
    with shallow pipelines whenever more than K shapes tied: 20 of 29 published expert layouts
    were among the top 10, against 23 this way; tests/golden/test_nvidia_layouts.py)."""
    if goal.group_by_shape:
        best: dict[tuple[int, ...], Evaluated] = {}
        counts: dict[tuple[int, ...], int] = {}
        order: list[tuple[int, ...]] = []
        for e in ranked:
            s = parallel_shape(e)
            counts[s] = counts.get(s, 0) + 1
            if s not in best:
                best[s] = e
                order.append(s)
        shown = [replace(best[s], variants=counts[s]) for s in order]
    else:
        shown = list(ranked)
    if not shown:
        return []
    head = shown[0]
    band = goal.tie_band_fraction or 0.0
    ref = abs(head.objective_value) or 1.0

    def ties(e: Evaluated) -> bool:
        return e.tight == head.tight and abs(e.objective_value - head.objective_value) <= band * ref + 1e-12 * ref

    tied = [e for e in shown if ties(e)]
    if len(tied) <= 1:
        return shown[: max(1, goal.top_k)]
    pick = min(tied, key=secondary_key)
    # The others in the search's own order ((tight, objective, key), as `ranked` comes): the plans a
    # search keeps at the K-th place among equal values are the first by that key (training `_cut`).
    others = [e for e in shown if e is not pick]
    return [replace(e, tie=True) if ties(e) else e for e in [pick, *others]][: max(1, goal.top_k)]


def _within(progress: Progress | None, offset: int, total: int) -> Progress | None:
    """One GPU count's (done, of its layouts) as a share of its PROGRESS_STEPS, on the fixed total."""
    if progress is None:
        return None
    return lambda done, count: progress(offset + PROGRESS_STEPS * min(done, count) // max(1, count), total)


@contextmanager
def _cycle_collector_paused() -> Iterator[None]:
    """The search allocates hundreds of thousands of short-lived objects, which reference counting
    frees; their allocations keep triggering the cycle collector, whose full passes walk every
    object the process holds (a tenth of a large search's time). It runs again afterwards."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def search(
    spec: ModelSpec,
    hw: HardwareProfile,
    workload: InferenceWorkload | TrainingWorkload,
    space: Space,
    goal: Goal,
    *,
    num_gpus: int | None = None,
    max_gpus: int | None = None,
    progress: Progress | None = None,
    first_fit: bool = False,
) -> SearchResult:
    """Search every layout of `spec` on `hw` (the GPU count given, or each count up to `max_gpus`;
    `first_fit`: stop at the smallest count where something fits)."""
    with _cycle_collector_paused():
        return _search(spec, hw, workload, space, goal, num_gpus=num_gpus, max_gpus=max_gpus, progress=progress,
                       first_fit=first_fit)


def _search(
    spec: ModelSpec,
    hw: HardwareProfile,
    workload: InferenceWorkload | TrainingWorkload,
    space: Space,
    goal: Goal,
    *,
    num_gpus: int | None,
    max_gpus: int | None,
    progress: Progress | None,
    first_fit: bool,
) -> SearchResult:
    training = isinstance(workload, TrainingWorkload)
    if not training:  # a training search does not load the serving search (nor its simulation's imports)
        from shardplan.search.serving import pareto_front, search_serving
    allowed = TRAINING_OBJECTIVES if training else SERVING_OBJECTIVES
    if goal.objective not in allowed:
        raise ShardplanError(
            f"objective {goal.objective.value!r} does not apply to {'training' if training else 'serving'}",
            field="--objective", hint="use one of " + ", ".join(o.value for o in allowed),
        )
    if goal.objective is Objective.COST and price_per_gpu_hour(hw, goal) is None:
        raise ShardplanError(
            f"the profile {hw.name} has no price", field="--gpu-hour-price", hint="give --gpu-hour-price USD"
        )
    start = time.perf_counter()
    counts = gpu_counts(hw, num_gpus=num_gpus, max_gpus=max_gpus)
    res = SearchResult(training=training, goal=goal, gpu_counts=counts)
    # The bar counts GPU counts, each split into PROGRESS_STEPS by its share of layouts decided:
    # its layouts are only known once it starts, so counting layouts would move the total.
    total = len(counts) * PROGRESS_STEPS
    # Serving: a replica costed at one GPU count is looked up at the others (search/serving.py).
    replicas: dict | None = {} if memo.ENABLED and not training else None
    for i, c in enumerate(counts):
        if res.num_steps >= space.max_search_steps:  # bounded work: say which counts were left out
            res.unsearched_gpu_counts = counts[i:]
            break
        # Each count gets an equal share of the steps left (what one leaves unused rolls over);
        # `first_fit` wants the smallest count that fits, so each count may use all that is left.
        share = 1 if first_fit else len(counts) - i
        res.step_limit = res.num_steps + (space.max_search_steps - res.num_steps) // share
        hwc = topology(hw, c)
        within = _within(progress, i * PROGRESS_STEPS, total)
        if training:
            search_training(spec, hwc, workload, space, goal, res, within)  # type: ignore[arg-type]
        else:
            search_serving(spec, hwc, workload, space, goal, res, memo=replicas)  # type: ignore[arg-type]
        if progress is not None:
            progress((i + 1) * PROGRESS_STEPS, total)
        if first_fit and res.feasible:
            break
    if (not training and not res.feasible and len(counts) == 1 and not res.unsearched_gpu_counts
            and space.allow_offload and space.offload is None):
        # Nothing fits on these GPUs alone: try the engine's smaller weight formats, then hold some
        # layers' weights in host memory as the engine can (the slow way to fit; the suggestions
        # say what more GPUs give). Ranked together by the objective.
        hwc = topology(hw, counts[0])
        extra = tuple(q for q in space.fallback_quantizations if q not in space.quantizations)
        if extra:  # the offload pass follows: its plans may show a shape whose variants this pass would leave out
            search_serving(spec, hwc, workload, replace(space, quantizations=extra), goal, res,  # type: ignore[arg-type]
                           memo=replicas, bound=False)
        wide = replace(space, quantizations=space.quantizations + extra)
        search_serving(spec, hwc, workload, wide, goal, res, offload=True, memo=replicas)  # type: ignore[arg-type]
    # Plans that fit only at the prediction ("tight") rank after those that fit at the band's
    # edge. Serving leaves out only points that cannot change what this shows (search/serving.py,
    # `_top_floor` reads this order and the shapes), so the order is exact; training's branch and
    # bound keeps each GPU count's best K by the objective, and this orders those (with --strict-fit
    # the search rejects tight plans where it decides fit, so the K kept all fit at the edge).
    ranked = sorted(res.feasible, key=lambda e: (e.tight, e.objective_value, e.key))
    res.top = honest_top(ranked, goal)
    if not training:
        res.pareto = pareto_front(res.feasible)
    res.smallest_num_gpus = min((e.num_gpus for e in res.feasible), default=None)
    res.elapsed_seconds = time.perf_counter() - start
    return res
