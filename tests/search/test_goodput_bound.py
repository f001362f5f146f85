"""The goodput search's bound (search/serving.py, `_goodput_bound`): a replica whose bound on
goodput cannot reach the plans shown, and whose shape no other variant can bring among them, is
not simulated. Exact for what the ranking shows: on a grid of models, GPUs, formats, lengths and
SLAs, the search with the bound and the reference path (`memo.reference_path()`: every replica
simulated) show the same plans, in the same order, with the same figures, variant counts and
ties; and every replica the reference path simulated gets no more goodput per GPU than its bound.
(Not the Pareto front: a plan left out is not on it, as `SearchResult.pareto` says.) Each case
also says whether the bound leaves something out, so that one that no longer prunes fails. The
ranking settings the grid does not reach (a tie band, tight plans, --expand, K of 0 to 5, the
fallback search's two passes of one count) are checked on random points through the bound order
itself, against the reference path.

Across GPU counts a replica's verdict is looked up, not simulated again, where everything it
depends on is the same: the reference path found that a one-GPU replica's verdict had been
reused for the same replica beside others, whose KV cache NCCL's buffers make smaller (Mistral
7B on L4s: the 2-GPU plan's figures were the 1-GPU plan's, and the Pareto front lost a point)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost import inputs, memo
from shardplan.cost.layout import Layout
from shardplan.cost.traffic import Sla
from shardplan.cost.workload import Quantization, ServingLoad
from shardplan.knowledge.load import engine_rules
from shardplan.search import Goal, Objective, Space, search
from shardplan.search import serving as serving_search
from shardplan.search.space import SearchResult
from shardplan.specs.loading import load_hardware, load_model

CASES = [
    # (model, GPU, weight formats beside bf16, most GPUs, prompt, output tokens, p90 TTFT s, p90 TPOT s,
    #  whether the bound leaves something out)
    ("llama-3.1-70b", "h100-sxm-80gb", ("fp8", "int4"), 8, 1024, 128, 1.0, 0.05, True),
    ("llama-3.1-8b", "h100-sxm-80gb", ("fp8", "int8", "int4"), 4, 1024, 128, 1.0, 0.05, True),
    ("qwen3-30b-a3b", "h100-sxm-80gb", ("fp8",), 4, 1024, 128, 1.0, 0.05, True),  # MoE
    ("gemma-2-9b", "l40s-48gb", ("int4",), 4, 2048, 256, 2.0, 0.1, True),  # sliding-window layers
    # Long prompts on small GPUs: a one-GPU replica and the same replica beside others (their KV caches
    # differ by NCCL's buffers) are judged apart. No bound before simulating leaves a point out here; a
    # rate search stopped where it could no longer reach the plans shown does.
    ("mistral-7b", "l4-24gb", ("fp8", "int4"), 4, 4000, 500, 5.0, 0.1, True),
]


def _case(model: str, gpu: str, formats: tuple[str, ...], prompt: int, output: int, ttft: float, tpot: float):
    spec = load_model(model).spec
    hw = load_hardware(gpu)
    wl = inputs.inference_workload(
        engine=engine_rules("vllm", None), hw=hw, model_max_len=spec.max_position_embeddings,
        max_model_len=8192, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=prompt, output_len=output, batch_size=None)
    wl = replace(wl, load=ServingLoad())
    space = replace(Space(), quantizations=(Quantization.NONE, *map(Quantization, formats)),
                    kv_cache_dtypes=(wl.kv_cache_dtype,))
    goal = Goal(Objective.GOODPUT, top_k=5, max_ttft_seconds=ttft, max_tpot_seconds=tpot, slo_percentile=90)
    return spec, hw, wl, space, goal


def _shown(res: SearchResult) -> list:
    return [(e.layout, e.workload, e.objective_value, e.figures, e.tight, e.variants, e.tie) for e in res.top]


@pytest.mark.parametrize("model,gpu,formats,max_gpus,prompt,output,ttft,tpot,pruned", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_the_bound_leaves_out_only_what_the_reference_path_does_not_show(model, gpu, formats, max_gpus, prompt,
                                                                         output, ttft, tpot, pruned):
    spec, hw, wl, space, goal = _case(model, gpu, formats, prompt, output, ttft, tpot)
    fast = search(spec, hw, wl, space, goal, max_gpus=max_gpus)
    with memo.reference_path():
        every = search(spec, hw, wl, space, goal, max_gpus=max_gpus)
    assert fast.top and _shown(fast) == _shown(every)
    assert (fast.rejected.get(serving_search.BOUNDED_OUT, 0) > 0) is pruned, fast.rejected
    assert serving_search.BOUNDED_OUT not in every.rejected
    # What the bound stands for: every replica simulated gets at most its bound (per GPU, as ranked).
    sla = Sla(goal.max_ttft_seconds, goal.max_tpot_seconds, goal.slo_percentile)
    for e in every.feasible:
        lay = e.layout
        bound = serving_search._goodput_bound(spec, e.hw, lay, replace(e.workload, load=wl.load), sla, None)
        assert e.figures["throughput_tokens_per_second_per_gpu"] <= serving_search.BOUND_MARGIN * bound / (lay.tp * lay.pp)


# Random points (shapes, bounds, what a simulation would find, rejections, tight plans) through the
# bound order itself, with the bound and on the reference path: what `honest_top` shows must be the
# same under every ranking setting (K, shapes grouped or --expand, a tie band), over one GPU count or
# several, and over the fallback search's two passes of one count (the extra formats, unbounded, then
# the offloaded plans), where a shape the first pass judged out of reach can be shown by the second.
_SHAPES = {n: [(tp, pp, n // (tp * pp)) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if n % (tp * pp) == 0]
           for n in (2, 4, 8)}


class _Fake:
    """A replica's workload as the fakes below read it: its bound per replica, its verdict (goodput
    per GPU, or None: over the SLA) and the ceilings its rate search checks on the way (per GPU,
    falling, none below the verdict: where a search given a need stops, `serving._cut`)."""

    def __init__(self, uid: int, bound: float, value: float | None, ceilings: tuple[float, ...] = ()) -> None:
        self.uid, self.bound, self.value, self.load, self.ceilings = uid, bound, value, ServingLoad(), ceilings

    def found(self, layout: Layout, need: float | None) -> serving_search.Verdict:
        """The fake `_goodput_found`: stops at the first ceiling below `need`, as `rate_search` does."""
        per_replica = tuple(c * layout.tp * layout.pp for c in self.ceilings)
        for k, c in enumerate(self.ceilings):
            if need is not None and c < need:
                return serving_search.Verdict(serving_search.OUT_OF_REACH, None, None, None, per_replica[:k + 1])
        return serving_search.Verdict(None if self.value is not None else "over the SLA", self.value, None, None,
                                      per_replica)


class _NoMemory:
    kv_account = None  # what the memo key reads (the fakes key nothing)


_NO_MEMORY = _NoMemory()


def _random_passes(rng, fallback: bool):
    uid = iter(range(10**6))

    def points(n: int, count: int, tight_share: float):
        out = []
        for _ in range(count):
            tp, pp, dp = rng.choice(_SHAPES[n])
            per_gpu_bound = rng.choice((1, 2, 3, 4, 6, 8, 10))
            value = None if rng.random() < 0.2 else rng.choice([v for v in (1, 2, 3, 4, 6, 8, 10) if v <= per_gpu_bound])
            above = [v for v in (0.5, 1, 2, 3, 4, 6, 8, 10) if v >= (value or 0) and v <= per_gpu_bound]
            ceilings = tuple(sorted((rng.choice(above) for _ in range(rng.randint(0, 4))), reverse=True))
            out.append((Layout(tp=tp, pp=pp, dp=dp), _Fake(next(uid), per_gpu_bound * tp * pp, value, ceilings),
                        _NO_MEMORY, rng.random() < tight_share))
        return out
    if fallback:
        n = rng.choice((4, 8))
        return [(points(n, rng.randint(1, 12), rng.choice((0.0, 0.3, 0.8))), False),
                (points(n, rng.randint(1, 8), rng.choice((0.0, 0.3))), True)]
    return [(points(n, rng.randint(1, 12), rng.choice((0.0, 0.3))), True) for n in rng.choice(([4], [8], [2, 4, 8]))]


@pytest.mark.parametrize("fallback", [False, True], ids=["counts", "fallback-passes"])
def test_leaving_out_by_bound_never_changes_what_is_shown_on_random_points(monkeypatch, fallback):
    import random

    from shardplan.search import honest_top
    from shardplan.search.space import Evaluated

    class Hw:
        gpus_per_node = 8

    def simulated(hw, layout, wl, sm, goal, res, tight, found):
        res.num_candidates += 1
        if found.reason is not None:
            res.rejected[found.reason] += 1
        else:
            res.feasible.append(Evaluated(layout, wl, hw, -found.rate, (layout.world_size, layout.tp, layout.pp, wl.uid),
                                          {}, tight))
    monkeypatch.setattr(serving_search, "_goodput_bound", lambda spec, hw, layout, wl, sla, m: wl.bound)
    stops = [0]  # rate searches stopped below their need (the reference path gives none a need)

    def found(spec, hw, layout, wl, sm, goal, m, need=None):
        verdict = wl.found(layout, need)
        stops[0] += verdict.reason == serving_search.OUT_OF_REACH
        return verdict
    monkeypatch.setattr(serving_search, "_goodput_found", found)
    monkeypatch.setattr(serving_search, "_goodput", simulated)
    monkeypatch.setattr(serving_search, "_goodput_memo_key", lambda *a: None)

    def shown(passes, goal) -> tuple[list, SearchResult]:
        res = SearchResult(training=False, goal=goal, gpu_counts=[])
        for pending, bounded in passes:
            serving_search._goodput_in_bound_order(None, Hw(), pending, goal, res, None, 0, bounded)
        ranked = sorted(res.feasible, key=lambda e: (e.tight, e.objective_value, e.key))
        return [(e.layout, e.workload.uid, e.objective_value, e.tight, e.variants, e.tie)
                for e in honest_top(ranked, goal)], res

    left_out = 0
    for seed in range(600):
        rng = random.Random(seed)
        passes = _random_passes(rng, fallback)
        goal = Goal(Objective.GOODPUT, top_k=rng.choice((0, 1, 2, 3, 5)), group_by_shape=rng.random() < 0.7,
                    tie_band_fraction=rng.choice((None, None, 0.1, 0.3)))
        fast, res = shown(passes, goal)
        with memo.reference_path():
            every, _ = shown(passes, goal)
        assert fast == every, (seed, goal)
        left_out += res.rejected.get(serving_search.BOUNDED_OUT, 0)
    assert left_out > 100  # the bound did leave points out
    assert stops[0] > 100  # and rate searches stopped part-way left points out
