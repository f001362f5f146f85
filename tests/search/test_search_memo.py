"""The search's shortcuts (issue 25: cost/memo.py) change how much it computes, never what it
finds: on a grid of models, GPU counts, serving and training, the optimised search and the
reference path (`memo.reference_path()`: every stage of every pass costed, every replica costed
at every GPU count, the full memory model for every layout) return the same top 20 (plans,
workloads, objective values, figures, order), the same Pareto front and the same counts. Each
case also checks that the shortcuts were taken, so that a switch that no longer switches fails."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from shardplan.cost import inputs, memo
from shardplan.cost import memory_training, time_serving
from shardplan.cost.workload import Quantization
from shardplan.knowledge.load import DEFAULT_STACK, engine_rules, stack_rules
from shardplan.search import Goal, Objective, Space, search
from shardplan.search import serving as serving_search
from shardplan.search import training as training_search
from shardplan.search.space import SearchResult
from shardplan.specs.loading import load_hardware, load_model

TOP = 20


def _serving(model: str, hw_name: str, *, max_model_len: int = 8192, formats: tuple[str, ...] = ()):
    spec = load_model(model).spec
    hw = load_hardware(hw_name)
    wl = inputs.inference_workload(
        engine=engine_rules("vllm", None), hw=hw, model_max_len=spec.max_position_embeddings,
        max_model_len=max_model_len, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None)
    space = replace(Space(), quantizations=(wl.quantization,), kv_cache_dtypes=(wl.kv_cache_dtype,))
    if formats:
        space = replace(space, quantizations=(Quantization.NONE, *map(Quantization, formats)))
    else:  # as the command line does: the engine's smaller formats when nothing fits otherwise
        space = replace(space, fallback_quantizations=tuple(
            Quantization(f) for f in wl.weight_formats if f not in ("awq", "gptq")))
    return spec, hw, wl, space, Goal(Objective.THROUGHPUT, top_k=TOP, group_by_shape=False)


def _training(model: str, hw_name: str, *, seq_len: int, gbs: int, stack: str = DEFAULT_STACK):
    spec = load_model(model).spec
    hw = load_hardware(hw_name)
    wl = inputs.training_workload(seq_len=seq_len, global_batch_size=gbs, optimizer="adamw", framework=None,
                                  flash_attention=None, dropout=spec.trains_with_dropout, stack=stack_rules(stack),
                                  spec=spec)
    return spec, hw, wl, Space(), Goal(Objective.STEP_TIME, top_k=TOP, group_by_shape=False)


def _counts(res: SearchResult) -> tuple:
    return (res.num_candidates, res.num_evaluated, res.num_costed, res.num_feasible, res.num_steps,
            dict(res.rejected), dict(res.invalid), res.gpu_counts, res.unsearched_gpu_counts, res.smallest_num_gpus)


def _both(monkeypatch, case, *, num_gpus=None, max_gpus=None) -> tuple[SearchResult, SearchResult, Counter, Counter]:
    """The search optimised and on the reference path, with the full costs each made."""
    spec, hw, wl, space, goal = case
    calls: dict[str, Counter] = {"fast": Counter(), "reference": Counter()}
    path = ["fast"]

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*a, **k):
            calls[path[0]][name] += 1
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    counted(time_serving, "_stage_pass")
    counted(serving_search, "serving_memory")
    counted(memory_training, "_stage_memory")
    early = training_search.training_memory_unless_over_gpu

    def counted_early(*a, **k):
        tm = early(*a, **k)
        calls[path[0]]["stopped_over_gpu"] += tm is None
        return tm
    monkeypatch.setattr(training_search, "training_memory_unless_over_gpu", counted_early)
    fast = search(spec, hw, wl, space, goal, num_gpus=num_gpus, max_gpus=max_gpus)
    path[0] = "reference"
    with memo.reference_path():
        reference = search(spec, hw, wl, space, goal, num_gpus=num_gpus, max_gpus=max_gpus)
    assert memo.ENABLED  # the switch is put back
    return fast, reference, calls["fast"], calls["reference"]


def _same(fast: SearchResult, reference: SearchResult) -> None:
    assert len(fast.top) == len(reference.top) > 0
    for a, b in zip(fast.top, reference.top):  # plans, workloads, values (exactly), figures, order
        assert (a.layout, a.workload, a.objective_value, a.key, a.figures, a.tight) == \
            (b.layout, b.workload, b.objective_value, b.key, b.figures, b.tight)
    assert [(e.layout, e.workload, e.objective_value) for e in fast.pareto] == \
        [(e.layout, e.workload, e.objective_value) for e in reference.pareto]
    assert _counts(fast) == _counts(reference)


@pytest.mark.parametrize("model,hw_name,kw,gpus", [
    ("llama-3.1-70b", "h100-sxm-80gb", {}, 64),  # 80 layers: up to 80 stages, one make-up or two
    ("mixtral-8x7b", "h100-sxm-80gb", {}, 32),  # MoE, expert parallelism
    ("gemma-2-9b", "a100-sxm-80gb", {}, 16),  # sliding-window and full layers alternate
    ("qwen3-30b-a3b", "h100-sxm-80gb", {"formats": ("fp8", "int4")}, 16),  # MoE with quantized formats
])
def test_serving_on_one_gpu_count_is_unchanged(monkeypatch, model, hw_name, kw, gpus):
    fast, reference, fast_calls, ref_calls = _both(monkeypatch, _serving(model, hw_name, **kw), num_gpus=gpus)
    _same(fast, reference)
    assert fast_calls["_stage_pass"] < ref_calls["_stage_pass"]  # one costing per stage make-up


def test_serving_fallback_pass_is_unchanged(monkeypatch):
    """Nothing fits one GPU as asked: the engine's smaller formats, then offloaded layers."""
    fast, reference, fast_calls, ref_calls = _both(monkeypatch, _serving("llama-3.1-70b", "h100-sxm-80gb"), num_gpus=1)
    assert any(e.layout.offload_layers for e in fast.top)
    _same(fast, reference)
    assert fast_calls["serving_memory"] < ref_calls["serving_memory"]  # the offload pass looks the first pass up


def test_serving_over_gpu_counts_is_unchanged(monkeypatch):
    fast, reference, fast_calls, ref_calls = _both(monkeypatch, _serving("llama-3.1-8b", "h100-sxm-80gb"), max_gpus=256)
    assert len(fast.gpu_counts) > 10
    _same(fast, reference)
    assert fast_calls["serving_memory"] < ref_calls["serving_memory"] / 2  # replicas costed once across counts


# `verdict`: the search's memory model stops at the first stage over the GPU
# (training_memory_unless_over_gpu) on some layouts, so it costs no more stages than the reference
# path, which costs every stage of every layout; where the model states' exact prune already rejects
# every layout that cannot fit (Mixtral here) it never stops early.
@pytest.mark.parametrize("model,hw_name,gpus,seq,gbs,stack,verdict", [
    ("llama-3.1-8b", "h100-sxm-80gb", 16, 4096, 64, DEFAULT_STACK, True),
    ("mixtral-8x7b", "h100-sxm-80gb", 32, 4096, 256, DEFAULT_STACK, False),  # MoE: expert parallelism
    ("llama-3.1-70b", "a100-sxm-40gb", 16, 4096, 32, "deepspeed", True),  # tight: offloaded variants, host RAM
    ("qwen2.5-7b", "a100-sxm-40gb", 8, 4096, 32, "megatron", True),
])
def test_training_is_unchanged(monkeypatch, model, hw_name, gpus, seq, gbs, stack, verdict):
    fast, reference, fast_calls, ref_calls = _both(
        monkeypatch, _training(model, hw_name, seq_len=seq, gbs=gbs, stack=stack), num_gpus=gpus)
    _same(fast, reference)
    assert fast.feasible == reference.feasible
    assert 0 < fast_calls["_stage_memory"] <= ref_calls["_stage_memory"]
    assert ref_calls["stopped_over_gpu"] == 0  # the reference path costs every layout in full
    if verdict:
        assert fast_calls["stopped_over_gpu"] > 0
    else:
        assert fast_calls["stopped_over_gpu"] == 0
        assert fast_calls["_stage_memory"] == ref_calls["_stage_memory"]


def test_the_reference_switch_restores_itself_after_an_error():
    with pytest.raises(RuntimeError):
        with memo.reference_path():
            assert not memo.ENABLED
            raise RuntimeError
    assert memo.ENABLED


def test_pass_time_field_sums_cover_every_field():
    """PassTime's written-out `+` and `scaled` (cost/compute.py) must name every field."""
    from dataclasses import fields

    from shardplan.cost.compute import PassTime

    names = [f.name for f in fields(PassTime)]
    a = PassTime(*[float(i + 1) for i in range(len(names))])
    b = PassTime(*[10.0 * (i + 1) for i in range(len(names))])
    assert [getattr(a + b, n) for n in names] == [11.0 * (i + 1) for i in range(len(names))]
    assert [getattr(a.scaled(3.0), n) for n in names] == [3.0 * (i + 1) for i in range(len(names))]


def test_training_memory_verdict_agrees_with_the_full_model():
    """`training_memory_unless_over_gpu` is None only where `training_memory` rejects for GPU memory
    alone, and is `training_memory` itself everywhere else."""
    from shardplan.search.space import memory_reason, topology
    from shardplan.search.training import degree_candidates, shape_candidates, state_variants, with_variant

    spec, hw, wl, space, goal = _training("llama-3.1-70b", "a100-sxm-40gb", seq_len=4096, gbs=32, stack="deepspeed")
    hwc = topology(hw, 16)
    res = SearchResult(training=True, goal=goal, gpu_counts=[16])
    seen = Counter()
    for deg in degree_candidates(spec, hwc, wl, space, res):
        for shape in list(shape_candidates(spec, wl, space, deg))[:6]:
            plain, offloaded = state_variants(shape, hwc, space)
            for v in plain + offloaded:
                layout = with_variant(shape, v)
                early = memory_training.training_memory_unless_over_gpu(spec, hwc, layout, wl)
                verdict = early is None
                tm = memory_training.training_memory(spec, hwc, layout, wl)
                if verdict:
                    assert not tm.fits and memory_reason(tm.reason) == "does not fit in GPU memory"
                else:
                    assert early == tm
                seen[(verdict, tm.fits)] += 1
    assert seen[(True, False)] > 0 and seen[(False, True)] > 0
