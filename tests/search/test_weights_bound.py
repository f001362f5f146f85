"""`search.serving.weights_exceed_memory`: a serving search that is certain to find nothing, because
the model's weights alone, in the lightest format the space tries, exceed what all its GPUs (and,
where it may offload, their nodes' host memory) hold. recommend skips such searches among its
suggestions (a shorter context, another format, another engine); a hostile config of a thousand
layers and tens of thousands of experts had spent a minute in them. The skip must be exact: where
the bound says so, the search finds nothing, and the suggestions are those of searching anyway."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from shardplan.cost import inputs
from shardplan.cost.layout import Layout
from shardplan.cost.params import count_params
from shardplan.cost.weights import stage_weights
from shardplan.cost.workload import Quantization
from shardplan.knowledge.load import engine_rules
from shardplan.search import Goal, Objective, Space, search
from shardplan.search import serving as serving_search
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model
from shardplan.tasks import recommend as recommend_task


def _case(model: str, gpu: str, engine: str, gpus: int, offload: bool):
    spec = load_model(model).spec
    hw = cluster(load_hardware(gpu), gpus=gpus, nodes=None, gpus_per_node=None)
    wl = inputs.inference_workload(
        engine=engine_rules(engine, None), hw=hw, model_max_len=spec.max_position_embeddings, max_model_len=4096,
        max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
        kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False, input_len=1024, output_len=128,
        batch_size=None)
    # The engine's own format first, its others as the fallback (as recommend searches a model it is not told the format of).
    space = replace(Space(), quantizations=(wl.quantization,), kv_cache_dtypes=(None,), allow_offload=offload,
                    fallback_quantizations=tuple(Quantization(f) for f in wl.weight_formats))
    return spec, hw, wl, space


GRID = list(itertools.product(["llama-3.1-70b", "deepseek-v3", "mixtral-8x7b"], ["l4-24gb", "h100-sxm-80gb"],
                              ["vllm", "llamacpp"], [1, 8], [False, True]))


def test_where_the_bound_says_nothing_fits_the_search_finds_nothing():
    said = 0
    for model, gpu, engine, gpus, offload in GRID:
        spec, hw, wl, space = _case(model, gpu, engine, gpus, offload)
        exceeds = serving_search.weights_exceed_memory(spec, hw, wl, space, gpus)
        res = search(spec, hw, wl, space, Goal(Objective.THROUGHPUT, top_k=1), num_gpus=gpus)
        assert not (exceeds and res.top), (model, gpu, engine, gpus, offload)
        said += exceeds
    # Not vacuous: DeepSeek-V3 (671B) on one or eight L4s, Llama 3.1 70B on one L4, in their lightest
    # formats on the GPUs alone, and more.
    assert said >= 8, said


def test_the_bound_is_the_whole_model_in_its_lightest_format():
    spec, hw, wl, space = _case("llama-3.1-70b", "l4-24gb", "vllm", 1, False)
    # bf16: two bytes for each of the model's parameters (70,553,706,496: tests/cost count them on the meta device).
    assert stage_weights(spec, Layout(), 0, quantization=Quantization.NONE, dense_dtype=wl.activation_dtype).bytes == \
        2 * count_params(spec).total == 2 * 70_553_706_496
    # One 24 GB L4 cannot hold even int4 weights (about 35-40 GB with their scales)...
    assert serving_search.weights_exceed_memory(spec, hw, wl, space, 1)
    # ... two of them can (whether anything else fits is the search's to say), and so can one with
    # the host's memory beside it, offloading as vLLM does (cpu_offload_gb).
    assert not serving_search.weights_exceed_memory(spec, hw, wl, space, 2)
    assert not serving_search.weights_exceed_memory(spec, hw, wl, replace(space, allow_offload=True), 1)


def _hostile_config(tmp_path) -> str:
    """A Mixtral-shaped config of 256 layers and 16,384 experts: 7.4e14 parameters, which no
    suggestion's search can place on 64 GPUs."""
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 256,
           "num_local_experts": 16384, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-5, "rope_theta": 1e6, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_recommend_skips_the_suggestions_that_cannot_fit_and_suggests_the_same(cli, tmp_path, monkeypatch):
    config = _hostile_config(tmp_path)
    searched: list[int | None] = []
    real_search = recommend_task.search

    def counted(*args, **kwargs):
        searched.append(kwargs.get("num_gpus"))
        return real_search(*args, **kwargs)

    monkeypatch.setattr(recommend_task, "search", counted)
    args = ("recommend", config, "-H", "h100-sxm-80gb", "--max-gpus", "64", "--json")
    skipped = cli(*args)
    assert skipped.exit_code == 3, skipped.stderr
    # The search as asked alone: not "more GPUs" (up to 64 x 64 GPUs: 4,096 H100s hold 3.5e14 bytes, its
    # int4 weights are 3.8e14), the formats, the KV cache, the context halvings or llama.cpp's formats.
    assert searched == [None], searched
    searched.clear()
    monkeypatch.setattr(serving_search, "weights_exceed_memory", lambda *a, **k: False)
    monkeypatch.setattr(recommend_task, "weights_exceed_memory", lambda *a, **k: False)
    every = cli(*args)
    assert every.exit_code == 3 and len(searched) > 8, searched
    drop = ("elapsed_seconds", "evaluated_per_second")
    assert {k: v for k, v in skipped.json().items() if k not in drop} == {k: v for k, v in every.json().items() if k not in drop}
