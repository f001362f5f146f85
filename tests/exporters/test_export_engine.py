"""Exports say which engine version the plan's memory was sized for, and warn when the flags
they are checked against, or the target engine, follow other rules."""

from __future__ import annotations


def _plan(cli, tmp_path, *engine: str):
    path = tmp_path / "plan.yaml"
    res = cli("recommend", "llama-3.1-8b", "--hardware", "rtx-3090-24gb", "--gpus", "1", "--max-model-len", "8192",
              *engine, "-o", str(path), "--json")
    assert res.exit_code == 0, res.stderr
    return path


def _header(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("# ")]


def test_a_plan_for_an_older_vllm_gets_the_oldest_bundled_flags_and_says_so(cli, tmp_path):
    plan = _plan(cli, tmp_path, "--engine-version", "0.6.4")
    head = _header(cli("export", str(plan), "--to", "vllm").stdout)
    assert "# memory sized for vllm 0.6.4's rules" in head
    assert any(line.startswith("# flags checked against vLLM 0.11.0 (the oldest bundled list: the plan's "
                               "--engine-version 0.6.4 is older than every bundled list;") for line in head)


def test_a_plan_for_a_bundled_vllm_gets_its_flags_and_image(cli, tmp_path):
    plan = _plan(cli, tmp_path, "--engine-version", "0.11.0")
    head = _header(cli("export", str(plan), "--to", "vllm").stdout)
    assert any(line.startswith("# flags checked against vLLM 0.11.0 (the plan's --engine-version 0.11.0;") for line in head)
    assert not any(line.startswith("# note:") for line in head)
    assert "image: vllm/vllm-openai:v0.11.0" in cli("export", str(plan), "--to", "kubernetes").stdout


def test_the_pinned_version_itself_needs_no_note(cli, tmp_path):
    # the cost model's rules stop at an older release than the pinned flags (0.33.0), so the plan's
    # version is set to the pinned one after planning
    from shardplan.exporters.base import engine_lines, flag_table
    from shardplan.plan.manifest import load_manifest

    m = load_manifest(_plan(cli, tmp_path, "--engine-version", "0.11.0"))
    m = m.model_copy(update={"workload": m.workload.model_copy(update={"engine_version": flag_table("vllm").version})})
    lines = engine_lines(m, "vllm", flag_table("vllm"))
    assert lines == ["memory sized for vllm 0.33.0's rules"]


def test_exporting_to_another_engine_warns_that_its_memory_rules_differ(cli, tmp_path):
    plan = _plan(cli, tmp_path)
    head = _header(cli("export", str(plan), "--to", "sglang").stdout)
    assert any(line.startswith("# warning: planned with vllm's memory rules, exported for sglang") for line in head)
    sg = _plan(cli, tmp_path, "--engine", "sglang")
    assert not any("warning" in line for line in _header(cli("export", str(sg), "--to", "sglang").stdout))
