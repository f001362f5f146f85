"""Stack capabilities constrain the training search (issue: search): a search sized with --stack S
returns only layouts S runs, read from one declaration (knowledge/targets.yaml stack_targets: the
training rules of the target that runs S, less the rules about what its exporter writes). Each
returned plan is written to the manifest and exported with S's own exporter, which checks the same
rules and must accept it."""

from __future__ import annotations

import pytest

from shardplan.knowledge.load import targets_file
from shardplan.plan.manifest import load_manifest

EXPORT = {"deepspeed": "deepspeed", "hf": "accelerate", "megatron": "megatron", "torchtitan": "torchtitan"}
ARGS = ("recommend", "llama-3.1-70b", "--workload", "training", "--gpus", "64", "--seq-len", "4096",
        "--global-batch-size", "256")


def test_every_stack_declares_the_target_that_runs_it_and_its_rules_name_sources():
    f = targets_file()
    assert set(f.stack_targets) == {"torchtitan", "megatron", "deepspeed", "hf"}
    for stack in f.stack_targets:
        rules = f.stack_capabilities(stack)
        assert rules and all(r.source for r in rules), stack
    # what an exporter writes is not a capability: torchtitan and Megatron train LoRA adapters
    assert "fine-tuning adapters" not in {r.id for r in f.stack_capabilities("torchtitan")}
    assert "fine-tuning adapters" in {r.id for r in f.rules_of("torchtitan")}


@pytest.mark.parametrize("stack", sorted(EXPORT))
def test_recommend_returns_only_layouts_the_stack_runs_and_its_exporter_takes_them(cli, tmp_path, stack):
    plan = tmp_path / "plan.yaml"
    res = cli(*ARGS, "--stack", stack, "--json", "-o", str(plan))
    assert res.exit_code == 0, res.stderr
    top = res.json()["top"]
    assert top
    for entry in top:
        p = entry["plan"]
        if stack == "deepspeed":  # no context or sequence parallelism; its pipeline engine runs 1F1B, ZeRO <= 1
            assert p["cp"] == 1 and not p["sequence_parallel"] and p["ep"] == 1
            assert p["pp"] == 1 or (p["pp_schedule"] == "1f1b" and p["zero_stage"] <= 1 and p["tp"] == 1)
        elif stack == "hf":  # accelerate's FSDP: no pipeline or expert parallelism
            assert p["pp"] == 1 and p["ep"] == 1
        elif stack == "megatron":  # its distributed optimizer (ZeRO-1), no offload
            assert p["zero_stage"] <= 1 and p["offload"]["optimizer"] == "none"
        else:  # torchtitan: FSDP2 or DDP
            assert p["zero_stage"] in (0, 3) or p["dp"] == 1
    assert load_manifest(plan).workload.stack == stack
    out = cli("export", str(plan), "--to", EXPORT[stack], "-o", str(tmp_path / "out"))
    assert out.exit_code == 0, out.stderr


def test_without_the_stack_capabilities_the_same_search_returns_layouts_deepspeed_does_not_run(cli):
    """The constraint bites: the default torchtitan search on the same question returns context or
    sequence parallelism, which DeepSpeed's search never does."""
    plans = [e["plan"] for e in cli(*ARGS, "--json").json()["top"]]
    assert any(p["cp"] > 1 or p["sequence_parallel"] for p in plans)


def test_one_gpu_training_offloads_at_the_least_zero_stage_that_runs_it(cli, tmp_path):
    """One replica has nothing to shard over, but ZeRO-Offload needs stage 1 for optimizer offload
    and stage 3 for parameter offload (deepspeed.ai config-json): the search tries each offload at
    that stage, so DeepSpeed trains Llama 3.1 8B on one H100 with its optimizer in host memory, and
    the plan exports with DeepSpeed's own config."""
    plan = tmp_path / "ds.yaml"
    d = cli("recommend", "llama-3.1-8b", "--workload", "training", "--gpus", "1", "--stack", "deepspeed",
            "--json", "-o", str(plan)).json()
    p = d["top"][0]["plan"]
    assert (p["dp"], p["zero_stage"], p["offload"]["optimizer"]) == (1, 1, "cpu")
    assert cli("export", str(plan), "--to", "deepspeed", "-o", str(tmp_path / "out")).exit_code == 0


def test_when_the_stack_runs_nothing_the_stacks_that_do_are_suggested(cli):
    """torchtitan (the default) offloads only FSDP2 shards across ranks, so one GPU cannot train the
    8B model; the answer names the stacks that can, each with its layout and step."""
    res = cli("recommend", "llama-3.1-8b", "--workload", "training", "--gpus", "1", "--json")
    assert res.exit_code == 3
    changes = {s["change"]: s["detail"] for s in res.json()["suggestions"]}
    assert "--stack deepspeed" in changes and "offload=cpu" in changes["--stack deepspeed"]
    assert "step" in changes["--stack deepspeed"] and "--stack torchtitan" not in changes
