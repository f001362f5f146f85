"""Issue 25: nothing `recommend --target T` returns is refused by T's exporter or by verify's
up-front checks. Over a grid of models, GPU counts and every target (serving and training, as
the target runs them), each returned plan is built into a manifest, exported for its target and
run through verify's checks (`plan_run`: no process starts)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import inference_workload, training_workload
from shardplan.cost.layout import Offload
from shardplan.cost.workload import Quantization
from shardplan.errors import ShardplanError
from shardplan.exporters import export
from shardplan.knowledge.load import DEFAULT_ENGINE, DEFAULT_STACK, engine_rules, stack_rules, targets_file
from shardplan.plan.manifest import build_manifest
from shardplan.search import Goal, Objective, Space, search
from shardplan.specs.loading import load_hardware, load_model
from shardplan.tasks._targets import check_target, model_refusal, search_rules, verify_builds
from shardplan.verify.runspec import OFFLOAD_SERVING_HINT, plan_run

MODELS = ["debug", "llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b", "deepseek-v3"]
SERVING_GPUS = [1, 8, 16]  # one GPU (quantized and offloaded fallbacks), a node, two nodes
TRAINING_GPUS = [8, 16]
EXPORTER = {"fsdp": "torchrun"}  # torchrun runs `shardplan verify`'s rank program: verify's checks are its own
# The profile's host DRAM (llama.cpp runs offloaded layers on the CPU): one socket's 8 channels of DDR5.
HOST_BYTES_PER_SECOND = 307.2e9


def _hardware():
    hw = load_hardware("h100-sxm-80gb")
    return replace(hw, host_memory_bandwidth_bytes_per_second_or_none=HOST_BYTES_PER_SECOND,
                   host_memory_efficiency_or_none=0.7)


def _workload(spec, hw, target: str, kind: str):
    t = targets_file().targets[target]
    if kind == "inference":
        return inference_workload(
            engine=engine_rules(t.engine or DEFAULT_ENGINE), hw=hw, model_max_len=spec.max_position_embeddings,
            max_model_len=min(8192, spec.max_position_embeddings), max_num_seqs=None, max_num_batched_tokens=None,
            gpu_memory_utilization=None, block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None,
            enforce_eager=False, input_len=min(512, spec.max_position_embeddings - 64), output_len=64, batch_size=None)
    # 32 sequences of 1024 tokens: few enough per replica that deep pipelines meet the micro-batch rule
    return training_workload(seq_len=1024, global_batch_size=32, optimizer="adamw", framework=None, flash_attention=None,
                             dropout=False, stack=stack_rules(t.stack or DEFAULT_STACK), spec=spec)


def _space(target: str, spec, wl, kind: str) -> Space:
    """The space recommend searches for the target (cli/cmd_plan.py: the engine's smaller formats
    when nothing fits at the model's own)."""
    space = Space(rules=search_rules(target, spec, wl))
    if kind == "inference":
        fallback = tuple(Quantization(q) for q in wl.weight_formats if q not in ("awq", "gptq"))
        space = replace(space, quantizations=(wl.quantization,), kv_cache_dtypes=(wl.kv_cache_dtype,),
                        fallback_quantizations=fallback)
    return space


def _cases():
    f = targets_file()
    for target, t in f.targets.items():
        for kind in t.workloads:
            yield pytest.param(target, kind, id=f"{target}-{kind}")


@pytest.mark.parametrize("target,kind", list(_cases()))
def test_every_plan_a_target_search_returns_exports_and_passes_verifys_checks(target, kind):
    hw = _hardware()
    returned = 0
    for model in MODELS:
        loaded = load_model(model)
        spec = loaded.spec
        wl = _workload(spec, hw, target, kind)
        if model_refusal(target, spec) is not None:  # the target cannot build the model: said up front
            with pytest.raises(ShardplanError) as refused:
                check_target(target, spec, hw, wl)
            assert refused.value.field == "--target"
            continue
        check_target(target, spec, hw, wl)  # nothing else is refused before the search
        goal = Goal(Objective.THROUGHPUT if kind == "inference" else Objective.STEP_TIME, top_k=3)
        for n in SERVING_GPUS if kind == "inference" else TRAINING_GPUS:
            res = search(spec, hw, wl, _space(target, spec, wl, kind), goal, num_gpus=n)
            for e in res.top:
                returned += 1
                where = f"{model} on {n} GPUs: {e.layout}"
                m = build_manifest(loaded=loaded, hw=e.hw, layout=e.layout, workload=e.workload,
                                   report=estimate(spec, e.hw, e.layout, e.workload))
                try:
                    export(m, EXPORTER.get(target, target), spec=spec)
                except ShardplanError as ex:
                    pytest.fail(f"{target} refuses what --target {target} returned ({where}): {ex.one_line()}")
                if not verify_builds(spec):
                    continue  # verify builds no MLA model: its checks refuse the model, not the plan
                try:
                    plan_run(m, spec, scale="proxy")
                except ShardplanError as ex:
                    offloaded = kind == "inference" and e.layout.offload_params is not Offload.NONE
                    if offloaded and ex.hint == OFFLOAD_SERVING_HINT:
                        continue  # verify takes offloaded serving plans through --checkpoint, not torchrun
                    pytest.fail(f"verify refuses what --target {target} returned ({where}): {ex.one_line()}")
    assert returned > 0, f"--target {target} returned no {kind} plan over the whole grid"
