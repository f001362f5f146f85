"""`--overlap-scheduling/--no-overlap-scheduling`: whether the engine forms the next step's batch
while a step runs (vLLM's async scheduling, SGLang's overlap scheduler; cost/serving_load.py) is a
plan input, and the export passes the flag that makes the engine run as the plan was costed, only
where that differs from the version's default (knowledge/engines/*.yaml overlap_switch)."""

from __future__ import annotations

import json

import pytest
from test_export import check_flags, engine_commands

from shardplan.errors import EXIT_BAD_INPUT
from shardplan.exporters import ExportOptions, export
from shardplan.plan import manifest as mf

SGLANG_PROGRAM = "sglang"


def _plan(cli, tmp_path, *extra: str):
    path = tmp_path / "plan.yaml"
    res = cli("recommend", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", "--request-rate", "4",
              "--num-prompts", "200", "-o", str(path), *extra)
    assert res.exit_code == 0, res.stderr
    return mf.load_manifest(path)


def _engine_args(m, target: str, program: str) -> list[list[str]]:
    texts = {f.name: f.text for f in export(m, target, options=ExportOptions(plan_file="plan.yaml"))}
    return [args for text in texts.values() for table, args in engine_commands(text) if table == program]


@pytest.mark.parametrize("extra,batches,flag", [
    ((), 2, None),  # vLLM 0.33.0: async scheduling is its default, nothing to pass
    (("--no-overlap-scheduling",), 1, "--no-async-scheduling"),
    (("--engine-version", "0.11.0"), 1, None),  # 0.11.0 forms each batch when the step before ends
    (("--engine-version", "0.11.0", "--overlap-scheduling"), 2, "--async-scheduling"),
], ids=["default", "off", "0.11-default", "0.11-on"])
def test_vllm_plans_pass_async_scheduling_only_where_they_differ_from_the_version(cli, tmp_path, extra, batches, flag):
    m = _plan(cli, tmp_path, *extra)
    assert m.workload.batches_in_flight == batches
    commands = _engine_args(m, "vllm", "vllm")
    assert commands
    for args in commands:
        present = [a for a in args if "async-scheduling" in a]
        assert present == ([flag] if flag else [])
        assert check_flags("vllm-0.11.0" if "--engine-version" in extra else "vllm", args) > 0


def test_sglang_plans_pass_disable_overlap_schedule_when_asked(cli, tmp_path):
    off = _plan(cli, tmp_path, "--engine", "sglang", "--no-overlap-scheduling")
    on = _plan(cli, tmp_path, "--engine", "sglang")
    assert (off.workload.batches_in_flight, on.workload.batches_in_flight) == (1, 2)
    for m, expected in ((off, ["--disable-overlap-schedule"]), (on, [])):
        for args in _engine_args(m, "sglang", SGLANG_PROGRAM):
            assert [a for a in args if "overlap" in a] == expected
            assert check_flags("sglang", args) > 0


def test_the_predicted_ttft_follows_the_switch(cli, tmp_path):
    """16 clients with ShareGPT's lengths (requests end at different steps): costed with overlap, a
    request sent while a step runs waits for the batch already formed too, one decode step more of TTFT
    (about 7 ms for Llama 3.1 8B on an H100 at this batch); TPOT stays within a few percent."""
    figures = {}
    for switch in ("--overlap-scheduling", "--no-overlap-scheduling"):
        res = cli("estimate", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", "--concurrency", "16",
                  "--num-prompts", "300", "--dataset-lengths", "sharegpt", switch, "--json")
        assert res.exit_code == 0, res.stderr
        figures[switch] = json.loads(res.stdout)["load"]
    on, off = figures["--overlap-scheduling"], figures["--no-overlap-scheduling"]
    assert on["ttft_seconds"]["p50"] - off["ttft_seconds"]["p50"] == pytest.approx(off["tpot_seconds"]["p50"], rel=0.3)
    assert on["tpot_seconds"]["p50"] == pytest.approx(off["tpot_seconds"]["p50"], rel=0.05)


@pytest.mark.parametrize("extra,says", [
    (("--engine", "tgi", "--overlap-scheduling"), "TGI 3.3.0 has no switch for it"),
    (("--engine-version", "0.9.2", "--overlap-scheduling"), "vLLM 0.9.2 has no switch for it"),
    (("--engine", "sglang", "--engine-version", "0.3.6", "--no-overlap-scheduling"), "SGLang 0.3.6 has no switch"),
])
def test_an_engine_without_the_switch_refuses_it_in_one_line(cli, extra, says):
    res = cli("estimate", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", *extra)
    assert res.exit_code == EXIT_BAD_INPUT
    assert says in res.stderr and "--overlap-scheduling" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_a_plan_written_before_the_setting_was_recorded_exports_without_a_flag(cli, tmp_path):
    """Its engine ran the version's default, whatever that is; re-costed, it is read with one batch at a time."""
    from shardplan.plan.readback import plan_workload

    m = _plan(cli, tmp_path, "--no-overlap-scheduling")
    old = m.model_copy(update={"workload": m.workload.model_copy(update={"batches_in_flight": None})})
    for args in _engine_args(old, "vllm", "vllm"):
        assert not [a for a in args if "async-scheduling" in a]
    assert plan_workload(old).batches_in_flight == 1


def test_an_export_for_another_release_passes_what_that_release_needs(cli, tmp_path):
    """A plan costed on vLLM 0.11.0 (one batch at a time) exported for 0.33.0, which schedules ahead by
    default: the export turns that off."""
    m = _plan(cli, tmp_path, "--engine-version", "0.11.0")
    texts = {f.name: f.text for f in export(m, "vllm", options=ExportOptions(plan_file="plan.yaml",
                                                                            engine_version="0.33.0"))}
    commands = [args for text in texts.values() for table, args in engine_commands(text) if table == "vllm"]
    assert commands and all("--no-async-scheduling" in args for args in commands)


@pytest.mark.parametrize("extra,batches", [
    (("--speculative-method", "ngram", "--num-speculative-tokens", "3"), 1),
    (("--speculative-model", "llama-3.2-1b", "--num-speculative-tokens", "3"), 1),
    ((), 2),
], ids=["ngram", "draft-model", "none"])
def test_vllm_schedules_ahead_only_without_a_draft_model_or_ngram_lookup(cli, extra, batches):
    res = cli("estimate", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", *extra, "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["workload"]["batches_in_flight"] == batches
    if batches == 1:
        asked = cli("estimate", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", *extra, "--overlap-scheduling")
        assert asked.exit_code == EXIT_BAD_INPUT and "does not form batches ahead" in asked.stderr


@pytest.mark.parametrize("extra,line", [
    ((), "vLLM 0.33.0: forms the next step's batch while a step runs unless pp > 1"),
    (("--no-overlap-scheduling",), "vLLM 0.33.0: forms each step's batch when the step before ends "
                                   "(--no-overlap-scheduling), not its default"),
    (("--engine-version", "0.11.0", "--overlap-scheduling"), "vLLM 0.11.0: forms the next step's batch while a "
                                                             "step runs (--overlap-scheduling), not its default"),
], ids=["default", "off", "0.11-on"])
def test_the_assumptions_state_how_the_plan_forms_its_batches(cli, extra, line):
    res = cli("estimate", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", *extra, "--json")
    assert res.exit_code == 0, res.stderr
    said = [a for a in json.loads(res.stdout)["assumptions"] if "batch" in a and " forms " in a]
    assert len(said) == 1 and said[0].startswith(line)
