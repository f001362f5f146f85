"""Issue 25: the layouts NVIDIA's performance teams chose for their published training benchmarks
(NeMo 24.07, Megatron-Bridge 25.11 and 26.04, the DGX Cloud recipes, NeMo's recommended H100
recipes) and those of BLOOM and MT-NLG are among the top 10 distinct parallel shapes the search
shows for their own setting, with Megatron's capabilities (`--stack megatron`) and the row's
precision; tests/data/validation/nvidia_layouts.yaml holds each row with its source.

A row the search does not show yet is in NOT_YET with the mechanism that keeps it out, and a
test keeps each of those honest: the day it is shown, it must move out. The count of rows shown
is recorded in BENCHMARKS.md (23 of 29 at the time of writing, 12 of them the pick).
"""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Recompute
from shardplan.knowledge.load import stack_rules
from shardplan.search import Goal, Objective, Space, search
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model
from shardplan.specs.model import ModelSpec
from shardplan.tasks._bands import goal_at_edge
from shardplan.tasks._targets import search_rules

DATA = yaml.safe_load((REPO / "tests" / "data" / "validation" / "nvidia_layouts.yaml").read_text())
ROWS = DATA["rows"]
TOP = 10
DEGREES = ("tp", "pp", "dp", "cp", "ep")

# Published layouts the search ranks outside its top 10, with the mechanism that keeps each out
# (the published shape's best variant against the pick, from the search pinned to that shape).
_TIGHT = ("without recomputation the layout fits only at the prediction ({peak} GiB reserved with Megatron's fp32 "
          "main gradients, over the GPU at the +20% megatron memory band's edge), so it ranks after every plan that "
          "fits at the edge; its best variant that does recomputes every layer, {gap} behind the pick")
NOT_YET: dict[str, str] = {
    "nemo2407_gpt3_20b": "tp=2 dp=32 keeps a 10B-parameter shard: 20 GB of bf16 weights and 40 GB of fp32 main "
                         "gradients before activations, so it fits only with full recomputation (+27%); NeMo 24.07 "
                         "ran Apex's distributed Adam, whose gradient buckets follow the weights' dtype",
    "nemo2407_llama3_8b": _TIGHT.format(peak=76.6, gap="+15%") + " (NeMo 24.07 ran Apex's distributed Adam, whose "
                                                                  "gradient dtype the table does not state)",
    "bridge2511_h100_llama31_405b": _TIGHT.format(peak=73.1, gap="+44%"),
    "dgxc2505_llama31_405b_512": "with its recipe (bf16 gradients, TP overlap) tp=8 pp=8 cp=2 (vp 8) ties with the pick "
                                 "(15.83 s against tp=8 pp=16 cp=2's 15.75 s) but fits only at the prediction (70.1 "
                                 "GiB reserved; at the +20% megatron memory band's edge 84.2 GiB), so it ranks after "
                                 "the plans that fit at the edge",
    "bridge2511_b200_llama31_405b": _TIGHT.format(peak=173.2, gap="+41%"),
    "bridge2511_h100_qwen3_235b_a22b": "a tie (+2.9%, fits at the edge), but more than ten distinct shapes are "
                                       "faster in the model (ep 16-64 with cp 2-4, shallower pipelines)",
}


# Rows whose published layout is the pick (`recommend`'s first plan), kept so.
PICKED = {"nemo2407_gpt3_5b", "nemo2407_gpt3_175b_128", "nemo2407_gpt3_175b_512", "nemo2407_llama2_7b",
          "nemo2407_llama3_70b", "bridge2511_b200_llama3_8b", "bridge2604_h100_qwen3_30b_a3b", "dgxc2505_deepseek_v3",
          "nemocsv_mixtral_8x22b", "dgxc2411_llama31_405b_576", "dgxc2505_nemotron4_15b", "dgxc2505_nemotron4_340b"}


def _spec(name: str) -> ModelSpec:
    arch = DATA["architectures"].get(name)
    return ModelSpec(name=name, **arch) if arch is not None else load_model(name).spec


def _shapes(row: dict) -> list[tuple[int, ...]]:
    """The search's top TOP distinct shapes, as (tp, pp, dp, cp, ep)."""
    spec = _spec(row["model"])
    recipe = row.get("recipe", {})  # what the row's own configuration sets beyond Megatron's defaults
    wl = training_workload(seq_len=row["seq_len"], global_batch_size=row["global_batch_size"], optimizer="adamw",
                           framework=None, flash_attention=None, dropout=spec.trains_with_dropout,
                           stack=stack_rules("megatron"), spec=spec,
                           matmul_dtype="fp8" if row["precision"] == "fp8" else None,
                           grad_reduce_dtype=recipe.get("grad_reduce_dtype"),
                           tp_comm_overlap=recipe.get("tp_comm_overlap", False))
    pins = {"recompute": Recompute(row["recompute"])} if "recompute" in row else {}
    space = Space(rules=search_rules(None, spec, wl), **pins)
    hw = cluster(load_hardware(row["hardware"]), gpus=row["num_gpus"], nodes=None, gpus_per_node=None)
    # As `recommend` ranks: tight plans after those that fit at the memory band's edge, ties within
    # the layout band marked, the pick among them by the secondary key
    goal = goal_at_edge(Goal(Objective.STEP_TIME, top_k=TOP), wl, hw, strict_fit=False)
    res = search(spec, hw, wl, space, goal, num_gpus=row["num_gpus"])
    shapes = [tuple(getattr(e.layout, d) for d in DEGREES) for e in res.top]
    assert len(shapes) == len(set(shapes))
    return shapes


def _published(row: dict) -> tuple[int, ...]:
    return tuple(row["parallel"][d] for d in DEGREES)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r["id"] not in NOT_YET], ids=lambda r: r["id"])
def test_the_published_layout_is_among_the_top_ten_distinct_shapes(row):
    assert _published(row) in _shapes(row)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r["id"] in PICKED], ids=lambda r: r["id"])
def test_the_published_layout_is_the_pick(row):
    assert _shapes(row)[0] == _published(row)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r["id"] in NOT_YET], ids=lambda r: r["id"])
def test_known_misses_still_miss(row):
    assert _published(row) not in _shapes(row), f"{row['id']} is now in the top {TOP}: move it out of NOT_YET"


def test_rows_are_consistent_and_sourced():
    assert len(ROWS) >= 25
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    for r in ROWS:
        p = r["parallel"]
        assert p["tp"] * p["pp"] * p["dp"] * p["cp"] == r["num_gpus"], r["id"]
        assert p["dp"] * p["cp"] * p["tp"] % p["ep"] == 0 or p["ep"] == 1, r["id"]
        assert r["source"] in DATA["sources"], r["id"]
        assert "recipe" not in r or r["recipe"]["source"] in DATA["sources"], r["id"]
        assert r["precision"] in ("fp8", "bf16"), r["id"]
        assert r["model"] in DATA["architectures"] or load_model(r["model"]).spec.name
    for s in DATA["sources"].values():
        assert s["url"].startswith("https://") and s["citation"] and s["locator"]
