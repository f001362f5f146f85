"""--target: the one declaration of what each deployment target runs (knowledge/targets.yaml),
read by the search, the exporters and verify; the micro-batch rule of torch's 1F1B schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import build_plan
from shardplan.cost.layout import Layout
from shardplan.cost.workload import TrainingWorkload
from shardplan.errors import CannotVerify
from shardplan.exporters import TARGETS, CannotExpress, export
from shardplan.knowledge import load
from shardplan.knowledge.targets import FACTS, Rule
from shardplan.plan.manifest import load_manifest
from shardplan.search.targets import FACT_FUNCTIONS
from shardplan.specs.loading import load_model
from shardplan.verify.runspec import plan_run


# ----- the declaration ----------------------------------------------------------------------


def test_every_fact_the_rules_can_name_is_computed():
    assert set(FACTS) == set(FACT_FUNCTIONS)


def test_each_fact_reads_only_the_layout_fields_it_lists():
    """The search caches verdicts by the fields a stage's facts list (search/targets.py FACT_TABLE):
    changing any other field of a layout never changes a fact."""
    import random
    from dataclasses import fields

    from shardplan.cost.layout import Offload, PipelineSchedule, Recompute
    from shardplan.search.targets import FACT_TABLE, Setting, facts_of

    rng = random.Random(25)
    choices = {"tp": [1, 2, 4, 8], "pp": [1, 2, 4], "dp": [1, 2, 4, 8], "cp": [1, 2], "ep": [1, 2, 4, 8],
               "etp": [None, 1, 2], "zero_stage": [0, 1, 2, 3], "hybrid_shard": [False, True],
               "sequence_parallel": [False, True], "recompute": list(Recompute), "pp_schedule": list(PipelineSchedule),
               "virtual_stages": [1, 2, 3], "micro_batch_size": [1, 2, 4], "offload_optimizer": list(Offload),
               "offload_params": list(Offload), "offload_layers": [0, 3], "offload_expert_layers": [0, 2], "pp_embedding_as_layer": [False, True],
               "pp_loss_as_layer": [False, True], "pp_first_stage_layers": [None], "pp_last_stage_layers": [None]}
    assert set(choices) == {f.name for f in fields(Layout)}

    def random_layout(**fixed):
        return Layout(**{k: fixed.get(k, rng.choice(v)) for k, v in choices.items()})

    for workload in ("training", "inference"):
        s = Setting(workload=workload, gpus_per_node=8, num_nodes=2, num_layers=24, kv_heads=8, moe=True,
                    tied_embeddings=False, seq_len=1024, global_batch_size=64)
        for _ in range(300):
            a = random_layout()
            for name, (read, _) in FACT_TABLE.items():
                b = random_layout(**{f: getattr(a, f) for f in read})
                assert facts_of(a, s)(name) == facts_of(b, s)(name), (name, a, b)


def test_every_condition_compares_a_fact_with_values_of_its_type():
    """A condition on a bool fact with [1], or a comparison on a string fact, would never hold."""
    from shardplan.search.targets import Setting, facts_of

    f = load.targets_file()
    rules = [r for rs in f.rule_sets.values() for r in rs] + [r for t in f.targets.values() for r in t.rules]
    for workload in ("training", "inference"):
        fact = facts_of(Layout(tp=2, pp=2, dp=2, ep=2), Setting(workload=workload, gpus_per_node=8, num_nodes=1,
                                                                num_layers=8, kv_heads=8, moe=True, tied_embeddings=False))
        for rule in rules:
            for c in (*rule.when, *rule.require):
                kind = type(fact(c.fact))
                if c.values is not None:
                    assert {type(v) for v in c.values} == {kind}, (rule.id, c.fact)
                else:
                    assert kind is int, (rule.id, c.fact)


def test_the_option_lists_the_declared_targets_in_order():
    from shardplan.cli.targets import TARGET_NAMES

    assert TARGET_NAMES == list(load.targets_file().targets)


def test_each_target_names_real_exporters_engines_and_stacks_and_every_rule_a_source():
    f = load.targets_file()
    for name, t in f.targets.items():
        assert set(t.exports) <= set(TARGETS), name
        assert t.engine is None or t.engine in load.known_engines(), name
        assert t.stack is None or t.stack in load.known_stacks(), name
        for rule in f.rules_of(name):
            assert rule.source.strip() and rule.says.strip() and rule.hint.strip(), (name, rule.id)
            assert rule.field.split(".")[0] in ("layout", "workload", "hardware", "model"), (name, rule.id)
    assert set(f.stacks) == set(load.known_stacks())


@pytest.mark.parametrize("raw,words", [
    ({"require": {"tp_degree": [1]}}, "unknown fact 'tp_degree'"),
    ({"require": {"tp": "about one"}}, "a list of values or a comparison"),
    ({"require": {"zero_stage": [0], "micro_batch_size": [1]}}, "at most one of pipeline"),
    ({"require": {"tp": [1]}, "says": "no {tensor}"}, "'{tensor}' is not a fact"),
])
def test_a_rule_that_cannot_be_checked_is_refused_when_the_file_is_read(raw, words):
    base = {"id": "x", "field": "layout.tp", "says": "no", "hint": "fix", "source": "here"}
    with pytest.raises(ValidationError) as e:
        Rule.model_validate(base | raw)
    assert words in str(e.value)


def test_the_search_and_the_exporter_read_the_same_rule(cli, tmp_path, monkeypatch):
    """A rule added to the declaration narrows the search and is the exporter's refusal, at once."""
    original = load.TARGETS_PATH.read_text()
    text = original.replace(
        "    engine: vllm\n    uses: [engine_groups, host_experts]\n    rules:\n",
        "    engine: vllm\n    uses: [engine_groups, host_experts]\n    rules:\n"
        "      - id: one GPU a replica\n        require: {tp: [1]}\n        field: layout.tp\n"
        "        says: \"test rule (tp={tp})\"\n        hint: \"re-plan with --tp 1\"\n        source: \"a test\"\n")
    assert text != original  # the anchor still matches the declaration
    path = tmp_path / "targets.yaml"
    path.write_text(text)
    monkeypatch.setattr(load, "TARGETS_PATH", path)
    r = cli("recommend", "llama-3.1-70b", "--gpus", "8", "--objective", "throughput", "--target", "vllm", "--json")
    assert r.exit_code == 0, r.stderr
    assert {e["plan"]["tp"] for e in r.json()["top"]} == {1}  # int4/offload fallbacks on one GPU each
    m, _ = build_plan("llama-3.1-8b", 2, Layout(tp=2), _serving())
    with pytest.raises(CannotExpress) as e:
        export(m, "vllm")
    assert e.value.field == "layout.tp" and "test rule (tp=2)" in e.value.message


def _serving():
    from shardplan.cost.workload import InferenceWorkload

    return InferenceWorkload(max_model_len=4096)


# ----- the CLI --------------------------------------------------------------------------------


def test_unknown_target_is_one_line_naming_the_option_and_the_values(cli):
    r = cli("recommend", "debug", "--target", "vlm")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "'--target'" in r.stderr and "vllm, sglang, tgi, trtllm, llamacpp, deepspeed, fsdp" in r.stderr


@pytest.mark.parametrize("args,field,words", [
    (["--target", "deepspeed"], "--target", "deepspeed runs training, not inference"),
    (["--target", "sglang", "--engine", "vllm"], "--engine", "plans with sglang's rules"),
    (["--workload", "training", "--target", "megatron", "--stack", "torchtitan"], "--stack", "megatron stack"),
    (["--workload", "training", "--target", "torchtitan"], "--target", "none has this model's shape"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "2", "--target", "llamacpp"], "--target",
     "speculative decoding (ngram) is not exported"),
])
def test_what_no_layout_fixes_is_refused_up_front(cli, args, field, words):
    lengths = [] if "--workload" in args else ["--input-len", "256", "--output-len", "64"]  # debug holds 512 tokens
    r = cli("recommend", "debug", "--gpus", "2", *lengths, *args)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"field '{field}'" in r.stderr and words in r.stderr, r.stderr


def test_export_implies_the_target_and_the_plan_exports(cli, tmp_path):
    """`recommend --export tgi` used to pick a plan TGI refuses (pp > 1), write it and exit 2."""
    plan = tmp_path / "plan.yaml"
    r = cli("recommend", "llama-3.1-70b", "--gpus", "16", "--objective", "throughput", "-o", plan, "--export", "tgi",
            "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    assert out["target"] == "tgi" and out["export"]["target"] == "tgi" and (tmp_path / "serve.sh").is_file()
    assert all("tgi" in e["runs_on"] and e["plan"]["pp"] == 1 for e in out["top"])
    assert "tgi" in load_manifest(plan).runs_on


def test_export_and_target_must_agree(cli, tmp_path):
    r = cli("recommend", "debug", "--target", "vllm", "-o", tmp_path / "p.yaml", "--export", "sglang")
    assert r.exit_code == 2 and "field '--export'" in r.stderr and "vllm" in r.stderr


def test_without_target_each_plan_says_which_targets_run_it(cli, tmp_path):
    plan = tmp_path / "plan.yaml"
    r = cli("recommend", "llama-3.1-8b", "--gpus", "8", "--workload", "training", "--global-batch-size", "64",
            "--seq-len", "2048", "-o", plan, "--json")
    assert r.exit_code == 0, r.stderr
    top = r.json()["top"]
    assert all(isinstance(e["runs_on"], list) for e in top) and top[0]["runs_on"]
    assert load_manifest(plan).runs_on == top[0]["runs_on"]
    for target in top[0]["runs_on"]:  # each target it names exports it
        name = "torchrun" if target == "fsdp" else target
        export(load_manifest(plan), name, spec=load_model("llama-3.1-8b").spec)


def test_capacity_and_replan_take_a_target(cli, tmp_path):
    r = cli("capacity", "llama-3.1-8b", "--workload", "training", "--max-gpus", "8", "--target", "megatron", "--json")
    assert r.exit_code == 0, r.stderr
    rows = r.json()["rows"]
    found = [row for row in rows if row["min_num_gpus"]]
    assert found and all(row["zero_stage"] <= 1 or row["plan"]["dp"] * row["plan"]["cp"] == 1 for row in found)
    assert all(row["offload"] == "none" and "megatron" in row["runs_on"] for row in found)
    plan = tmp_path / "plan.yaml"
    assert cli("recommend", "llama-3.1-70b", "--gpus", "8", "--objective", "throughput", "-o", plan).exit_code == 0
    r = cli("replan", plan, "--gpus", "16", "--target", "jax", "--json")
    assert r.exit_code == 0, r.stderr
    assert all(c["plan"]["pp"] == 1 and "jax" in c["runs_on"] for c in r.json()["candidates"])
    r = cli("replan", plan, "--gpus", "16", "--target", "tgi")  # the plan is sized with vLLM's rules
    assert r.exit_code == 2 and "sized with vllm's rules" in r.stderr and "recommend --target tgi" in r.stderr


def test_help_says_what_target_does(cli):
    for command in ("recommend", "capacity", "replan"):
        out = cli(command, "--help").stdout
        assert "--target" in out and "runs_on" in out, command


# ----- issue 25: fewer micro-batches than pipeline stages -------------------------------------


def test_a_1f1b_pipeline_gets_at_least_as_many_micro_batches_as_stages(cli, tmp_path):
    """The issue's case: 8 sequences, dp = 1, two stages; micro-batch 8 would be one micro-batch,
    which torch's Schedule1F1B refuses at run time."""
    plan = tmp_path / "plan.yaml"
    r = cli("recommend", "debug", "--gpus", "4", "--workload", "training", "--tp", "2", "--pp", "2", "--seq-len", "256",
            "--global-batch-size", "8", "-o", plan, "--json", "--top", "10")
    assert r.exit_code == 0, r.stderr
    for e in r.json()["top"]:
        p = e["plan"]
        assert 8 // (p["dp"] * p["micro_batch_size"]) >= p["pp"], p
    plan_run(load_manifest(plan), load_model("debug").spec, scale="proxy")  # verify's up-front checks pass


def test_pinning_the_micro_batch_that_starves_the_pipeline_finds_nothing_and_says_why(cli):
    r = cli("recommend", "debug", "--gpus", "4", "--workload", "training", "--tp", "2", "--pp", "2", "--seq-len", "256",
            "--global-batch-size", "8", "--micro-batch-size", "8", "--json")
    assert r.exit_code == 3
    assert "torchtitan stack: fewer micro-batches than stages" in json.dumps(r.json()["invalid_degree_combinations"])


def test_verify_refuses_a_starved_1f1b_pipeline_before_it_starts():
    m, _ = build_plan("debug", 4, Layout(tp=2, pp=2, micro_batch_size=8), TrainingWorkload(seq_len=256, global_batch_size=8))
    with pytest.raises(CannotVerify) as e:
        plan_run(m, load_model("debug").spec, scale="proxy")
    assert e.value.field == "layout.micro_batch_size" and "1 micro-batches, pp=2" in e.value.message
    gpipe, _ = build_plan("debug", 4, Layout(tp=2, pp=2, micro_batch_size=8, pp_schedule="gpipe"),
                          TrainingWorkload(seq_len=256, global_batch_size=8))
    plan_run(gpipe, load_model("debug").spec, scale="proxy")  # GPipe takes one micro-batch


def test_the_declaration_is_in_the_package():
    assert load.TARGETS_PATH.is_file() and load.TARGETS_PATH.parent == Path(load.__file__).parent


# ----- what exporters dropped without a word is now refused, by the declaration --------------------


@pytest.mark.parametrize("target,update,field", [
    ("sglang", {"offload_layers": 4, "offload_params": "cpu"}, "layout.offload_layers"),
    ("tgi", {"offload_layers": 4, "offload_params": "cpu"}, "layout.offload_layers"),
    ("trtllm", {"offload_layers": 4, "offload_params": "cpu"}, "layout.offload_layers"),
    ("jax", {"offload_layers": 4, "offload_params": "cpu"}, "layout.offload_params"),
])
def test_serving_exporters_that_write_no_offload_refuse_an_offloaded_plan(target, update, field):
    m, _ = build_plan("llama-3.1-8b", 1, Layout(), _serving())
    m = m.model_copy(update={"layout": m.layout.model_copy(update=update)})
    with pytest.raises(CannotExpress) as e:
        export(m, target)
    assert e.value.field == field and e.value.message.startswith(f"{target} cannot express this plan: ")


def test_deepspeed_refuses_selective_recomputation_its_config_cannot_say():
    m, _ = build_plan("llama-3.1-8b", 8, Layout(dp=8, zero_stage=3, recompute="selective"),
                      TrainingWorkload(global_batch_size=64))
    with pytest.raises(CannotExpress) as e:
        export(m, "deepspeed")
    assert e.value.field == "layout.recompute" and "(selective)" in e.value.message


def test_megatron_refuses_expert_and_tensor_parallelism_without_sequence_parallelism():
    m, _ = build_plan("mixtral-8x7b", 32, Layout(tp=2, pp=4, dp=4, ep=2, zero_stage=1, recompute="full"),
                      TrainingWorkload(seq_len=2048, global_batch_size=64))
    with pytest.raises(CannotExpress) as e:
        export(m, "megatron", spec=load_model("mixtral-8x7b").spec)
    assert e.value.field == "layout.sequence_parallel" and "ep=2, tp=2" in e.value.message


def test_each_exporter_refuses_the_workloads_its_target_does_not_run():
    """The declaration's `workloads` are what the exporters' serving()/training() checks accept."""
    plans = {"inference": build_plan("llama-3.1-8b", 1, Layout(), _serving())[0],
             "training": build_plan("llama-3.1-8b", 8, Layout(dp=8, zero_stage=3), TrainingWorkload(global_batch_size=64))[0]}
    spec = load_model("llama-3.1-8b").spec
    for name, t in load.targets_file().targets.items():
        if name == "fsdp":
            continue  # torchrun runs `shardplan verify`, which takes any plan
        for kind, m in plans.items():
            if kind in t.workloads:
                try:
                    export(m, name, spec=spec)
                except CannotExpress as e:  # refused for its layout, never for its kind
                    assert e.field != "workload.kind", (name, kind)
            else:
                with pytest.raises(CannotExpress) as e:
                    export(m, name, spec=spec)
                assert e.value.field == "workload.kind", (name, kind)


@pytest.mark.parametrize("target,allowed", [("vllm", True), ("sglang", True), ("tgi", False), ("jax", False)])
def test_serving_pipeline_stages_are_searched_for_targets_that_run_them(cli, target, allowed):
    r = cli("recommend", "llama-3.1-70b", "--gpus", "4", "--pp", "2", "--objective", "throughput", "--target", target,
            "--json")
    assert (r.exit_code == 0) == allowed, r.stderr
    if allowed:
        assert all(e["plan"]["pp"] == 2 and target in e["runs_on"] for e in r.json()["top"])
    else:
        assert any(k.startswith(f"{target}: ") for k in r.json()["invalid_degree_combinations"])
