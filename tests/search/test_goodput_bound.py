"""The goodput search's bound (search/serving.py, `_goodput_bound`): a replica whose bound on
goodput cannot reach the plans shown, and whose shape no other variant can bring among them, is
not simulated. Exact for what the ranking shows: on a grid of models, GPUs, formats, lengths and
SLAs, the search with the bound and the reference path (`memo.reference_path()`: every replica
simulated) show the same plans, in the same order, with the same figures, variant counts and
ties; and every replica the reference path simulated gets no more goodput per GPU than its bound.
(Not the Pareto front: a plan left out is not on it, as `SearchResult.pareto` says.) Each case
also says whether the bound leaves something out, so that one that no longer prunes fails.

Across GPU counts a replica's verdict is looked up, not simulated again, where everything it
depends on is the same: the reference path found that a one-GPU replica's verdict had been
reused for the same replica beside others, whose KV cache NCCL's buffers make smaller (Mistral
7B on L4s: the 2-GPU plan's figures were the 1-GPU plan's, and the Pareto front lost a point)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost import inputs, memo
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
    # Long prompts on small GPUs: nothing bounded out, but a one-GPU replica and the same replica
    # beside others (their KV caches differ by NCCL's buffers) are judged apart.
    ("mistral-7b", "l4-24gb", ("fp8", "int4"), 4, 4000, 500, 5.0, 0.1, False),
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
