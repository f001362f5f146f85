"""Issue 25: published expert layouts are among the top 10 distinct parallel shapes of the search
for their own setting, with their stack's capabilities pinned.

Llama 3 405B (arXiv:2407.21783 Table 4; tests/data/validation/llama3_layouts.yaml): 8,192 and
16,384 H100s at 8K context, and 16,384 at 131K, searched with Megatron's capabilities (the
distributed optimizer, sequence parallelism, interleaving; what knowledge/targets.yaml says the
megatron stack runs). The 8K stage ran without context parallelism (the paper introduces it for
the long-context stage), so cp = 1 is part of that setting.

Megatron-LM 2021 (Narayanan et al., SC'21, arXiv:2104.04473, Table 1, weak scaling; rows in
tests/data/validation/training_throughput.yaml with the paper's model, GPU count, batch and
(tp, pp, dp)): GPT models of 1.7B to 1T parameters on 32 to 3,072 A100 80GB. The 2021 stack:
full activation recomputation, fp16, no ZeRO or distributed optimizer, no sequence or context
parallelism (both came later), unfused softmax attention with dropout; the interleaved schedule
and the micro-batch are left to the search (the paper does not state them per row).
"""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO
from shardplan.cost.layout import Recompute
from shardplan.cost.workload import TrainingWorkload
from shardplan.search import Goal, Objective, Space, search
from shardplan.specs.loading import load_hardware
from shardplan.units import DType
from test_time_golden import TRAINING_ROWS, _gpt

TOP = 10
ROWS = [r for r in TRAINING_ROWS if r["kind"] == "weak_scaling"]
# A published layout the search ranks outside its top 10, with why.
NOT_YET = {
    "megatron21_t1_18.4B": "tp=8 pp=1 dp=32 for an 18B model: the search prefers tp=2-4 with two to four stages, "
                           "which it costs within a few percent; the paper kept pipelines off at this size",
}


def _shapes(row: dict) -> list[tuple[int, int, int]]:
    b = row["batch"]
    wl = TrainingWorkload(seq_len=row["model"]["seq_len"], global_batch_size=b["global_batch_seqs"],
                          flash_attention=False, dropout=True, param_dtype=DType.FP16, activation_dtype=DType.FP16)
    space = Space(recompute=Recompute.FULL, zero_stage=0, sequence_parallel=False, cp=1, ep=1)
    return _top_shapes(_gpt(row), "a100-sxm-80gb", wl, space, row["hardware"]["num_gpus"], ("tp", "pp", "dp"))


def _top_shapes(spec, hardware: str, wl, space: Space, num_gpus: int, degrees: tuple[str, ...]) -> list[tuple[int, ...]]:
    """The search's top TOP plans as their `degrees`, each a distinct shape (not variants of one)."""
    res = search(spec, load_hardware(hardware), wl, space, Goal(Objective.STEP_TIME, top_k=TOP), num_gpus=num_gpus)
    shapes = [tuple(getattr(e.layout, d) for d in degrees) for e in res.top]
    assert len(shapes) == len(set(shapes))
    return shapes


def _published(row: dict) -> tuple[int, int, int]:
    p = row["parallel"]
    return p["tp"], p["pp"], p["dp"]


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r["id"] not in NOT_YET], ids=lambda r: r["id"])
def test_the_published_layout_is_among_the_top_ten_distinct_shapes(row):
    assert _published(row) in _shapes(row)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROWS if r["id"] in NOT_YET], ids=lambda r: r["id"])
def test_known_misses_still_miss(row):
    assert _published(row) not in _shapes(row), f"{row['id']} is now in the top {TOP}: move it out of NOT_YET"


def test_enough_published_layouts_are_held():
    assert len([r for r in ROWS if r["id"] not in NOT_YET]) >= 3


LLAMA3 = yaml.safe_load((REPO / "tests" / "data" / "validation" / "llama3_layouts.yaml").read_text())["rows"]
# A published layout the search ranks outside its top 10, with why.
LLAMA3_NOT_YET = {
    "llama3_405b_16384gpu_131k": "tp=8 cp=16 pp=16 dp=8 at 131K fits only with full recomputation in shardplan's "
                                 "activation model (8K tokens a GPU a micro-batch), 34% slower than cp=32 without it; "
                                 "Meta's stack ran it without, so its activations are smaller than modelled",
}


def _llama3_shapes(row: dict) -> list[tuple[int, int, int, int]]:
    from shardplan.cost.inputs import training_workload
    from shardplan.knowledge.load import stack_rules
    from shardplan.specs.loading import load_model
    from shardplan.tasks._targets import search_rules

    spec = load_model("llama-3.1-405b").spec
    wl = training_workload(seq_len=row["seq_len"], global_batch_size=row["batch_per_dp"] * row["parallel"]["dp"],
                           optimizer="adamw", framework=None, flash_attention=None, dropout=False,
                           stack=stack_rules("megatron"), spec=spec)
    pins = {"cp": 1} if row["parallel"]["cp"] == 1 else {}
    space = Space(rules=search_rules(None, spec, wl), **pins)
    return _top_shapes(spec, "h100-sxm-80gb", wl, space, row["num_gpus"], ("tp", "cp", "pp", "dp"))


def _llama3_published(row: dict) -> tuple[int, int, int, int]:
    p = row["parallel"]
    return p["tp"], p["cp"], p["pp"], p["dp"]


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in LLAMA3 if r["id"] not in LLAMA3_NOT_YET], ids=lambda r: r["id"])
def test_llama3_published_layout_is_among_the_top_ten_distinct_shapes(row):
    assert _llama3_published(row) in _llama3_shapes(row)


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in LLAMA3 if r["id"] in LLAMA3_NOT_YET], ids=lambda r: r["id"])
def test_llama3_known_misses_still_miss(row):
    assert _llama3_published(row) not in _llama3_shapes(row), f"{row['id']} is now in the top {TOP}"


def test_llama3_layouts_are_consistent_with_their_gpu_counts():
    for r in LLAMA3:
        p = r["parallel"]
        assert p["tp"] * p["cp"] * p["pp"] * p["dp"] == r["num_gpus"], r["id"]
        assert r["batch_per_dp"] * p["dp"] * r["seq_len"] == pytest.approx(16.8e6, rel=0.01)  # 16M tokens a batch


PUBLISHED = yaml.safe_load((REPO / "tests" / "data" / "validation" / "published_layouts.yaml").read_text())["rows"]


def _recipe_workload(row: dict):
    """The model and the training workload of a row whose recipe pins the stack, the recomputed
    modules, fp8 GEMMs and bf16 moments (DeepSeek-V3's)."""
    from shardplan.cost.inputs import training_workload
    from shardplan.knowledge.load import stack_rules
    from shardplan.specs.loading import load_model

    r = row["recipe"]
    spec = load_model(row["model"]).spec
    wl = training_workload(seq_len=row["seq_len"], global_batch_size=row["global_batch_size"], optimizer="adamw",
                           framework=None, flash_attention=None, dropout=False, stack=stack_rules(r["stack"]),
                           spec=spec, matmul_dtype=r["matmul_dtype"], moment_dtype=r["moment_dtype"],
                           recompute_modules=",".join(r["recompute_modules"]))
    return spec, wl


def _recipe_args(row: dict) -> list[str]:
    """The row's setting and its recipe's pins as `recommend` takes them."""
    r = row["recipe"]
    args = [row["model"], "-H", row["hardware"], "--gpus", str(row["num_gpus"]), "--workload", "training",
            "--seq-len", str(row["seq_len"]), "--global-batch-size", str(row["global_batch_size"]),
            "--stack", r["stack"], "--zero-stage", str(r["zero_stage"]), "--cp", str(r["cp"])]
    if "recompute_modules" in r:
        args += ["--recompute-modules", ",".join(r["recompute_modules"])]
    for key in ("recompute", "matmul_dtype", "moment_dtype"):
        if key in r:
            args += [f"--{key.replace('_', '-')}", r[key]]
    for key in ("flash_attention", "sequence_parallel"):
        if key in r:
            args.append(f"--{'' if r[key] else 'no-'}{key.replace('_', '-')}")
    return args


@pytest.mark.slow
@pytest.mark.parametrize("row", PUBLISHED, ids=lambda r: r["id"])
def test_published_recipe_layouts_are_among_the_top_ten_distinct_shapes(cli, row):
    """As `recommend` answers it: the top 10 distinct shapes, ties within the model's error band
    ordered by the documented secondary key (these plans are within 8% of each other)."""
    res = cli("recommend", *_recipe_args(row), "--top", str(TOP), "--json")
    assert res.exit_code == 0, res.stderr
    top = res.json()["top"]
    shapes = [tuple(e["plan"][d] for d in ("tp", "pp", "dp", "ep")) for e in top]
    assert len(shapes) == TOP and len(set(shapes)) == TOP
    p = row["parallel"]
    published = (p["tp"], p["pp"], p["dp"], p["ep"])
    assert published in shapes
    # and within the model's error in comparing two layouts of the pick: its predicted step is no
    # reason to prefer another (the ties are ordered by the secondary key, not by the step)
    assert top[shapes.index(published)]["tie"]


def test_deepseek_v3_step_on_2048_h800_is_near_the_reported_gpu_hours():
    """DeepSeek's own layout and recipe (tp 1, pp 16, ep 64, ZeRO-1, micro-batch 1): the step the
    report's 180K GPU hours per trillion tokens implies, 19.91 s, within 15% (DeepSeek's DualPipe
    overlaps the all-to-alls more than Megatron's schedule, which shardplan models)."""
    from shardplan.cost.layout import Layout, Recompute
    from shardplan.cost.time_training import training_time

    row = next(r for r in PUBLISHED if r["id"] == "deepseek_v3_2048xh800")
    spec, wl = _recipe_workload(row)
    p = row["parallel"]
    hw = load_hardware(row["hardware"])
    from shardplan.specs.cluster import cluster

    hw = cluster(hw, gpus=row["num_gpus"], nodes=None, gpus_per_node=None)
    layout = Layout(tp=p["tp"], pp=p["pp"], dp=p["dp"], ep=p["ep"], zero_stage=1, recompute=Recompute.SELECTIVE,
                    micro_batch_size=1)
    m = row["global_batch_size"] // p["dp"]
    step = training_time(spec, hw, layout, wl, m).step_seconds
    measured = row["measured"]
    assert measured["step_seconds_derived"] == pytest.approx(
        row["seq_len"] * row["global_batch_size"] / row["num_gpus"] / (1e12 / (measured["gpu_hours_per_trillion_tokens"] * 3600)),
        abs=0.01)
    assert step == pytest.approx(measured["step_seconds_derived"], rel=0.15)
