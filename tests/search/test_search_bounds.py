"""Bounded work: a search over an astronomically large space stops after Space.max_search_steps
bounds and costs, says what it left out, and keeps its counts consistent; searches inside the
budget are exact (the budget changes nothing)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.search import Goal, Objective, Space, search
from shardplan.search.space import BUDGET_SPENT
from shardplan.specs.loading import load_hardware, load_model

H100 = load_hardware("h100-sxm-80gb")
STEP = Goal(objective=Objective.STEP_TIME)


def _consistent(res) -> None:
    assert sum(res.rejected.values()) + res.num_feasible == res.num_evaluated
    assert res.num_evaluated <= res.num_candidates


def test_a_spent_budget_says_what_it_left_out_and_keeps_counts_consistent():
    spec = load_model("deepseek-v3").spec
    res = search(spec, H100, TrainingWorkload(), replace(Space(), max_search_steps=400), STEP, max_gpus=4096)
    assert res.gpu_counts[-1] == 4096
    assert res.rejected[BUDGET_SPENT] > 0 or res.unsearched_gpu_counts
    assert res.num_steps <= 400 + 2000  # one count's degree bounds may run past the budget, no further
    assert res.unsearched_gpu_counts == res.gpu_counts[len(res.gpu_counts) - len(res.unsearched_gpu_counts):]
    _consistent(res)


def test_inside_the_budget_the_search_is_unchanged():
    spec = load_model("llama-3.1-8b").spec
    wl = TrainingWorkload(seq_len=4096, global_batch_size=64)
    bounded = search(spec, H100, wl, Space(), STEP, num_gpus=16)
    unbounded = search(spec, H100, wl, replace(Space(), max_search_steps=10**9), STEP, num_gpus=16)
    assert bounded.num_steps < Space().max_search_steps and BUDGET_SPENT not in bounded.rejected
    assert [(e.layout, e.objective_value) for e in bounded.top] == [(e.layout, e.objective_value) for e in unbounded.top]


def test_a_million_gpus_for_serving_is_searched_within_the_budget():
    spec = load_model("llama-3.1-8b").spec
    res = search(spec, H100, InferenceWorkload(max_model_len=8192), Space(), Goal(objective=Objective.THROUGHPUT),
                 num_gpus=1_000_000)
    assert res.top and res.top[0].num_gpus == 1_000_000 and res.num_steps < Space().max_search_steps
    _consistent(res)


@pytest.mark.slow  # ~3 s here, ~5 s on a loaded machine: two full recommend runs
def test_recommend_reports_the_budget_in_json_and_the_table(cli, tmp_path, monkeypatch):
    import shardplan.search.space as space_mod

    monkeypatch.setattr(space_mod.Space, "__init__", _with_budget(space_mod.Space.__init__, 10000))
    res = cli("recommend", "deepseek-v3", "--max-gpus", "1024", "--workload", "training", "--stack", "megatron", "--json")
    assert res.exit_code == 0, res.stderr
    b = res.json()["search_budget"]
    assert b["spent"] and b["max_steps"] == 10000 and (b["num_layouts_not_searched"] > 0 or b["gpu_counts_not_searched"])
    table = cli("recommend", "deepseek-v3", "--max-gpus", "1024", "--workload", "training", "--stack", "megatron")
    assert "search budget of 10,000 steps spent" in " ".join(table.stdout.split())


def _with_budget(init, steps):
    def patched(self, *a, **kw):
        kw.setdefault("max_search_steps", steps)
        init(self, *a, **kw)
    return patched
