"""Typed results: throughput counted the same way by estimate, recommend, show and the
manifest; `schema --output`; recommend's table at 80 columns; interleaved layer chunks."""

from __future__ import annotations

import json

import pytest

from shardplan.cli import render_common
from shardplan.cli.schemas import OUTPUTS
from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout, PipelineSchedule
from shardplan.cost.report import CostReport
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.search.explain import describe
from shardplan.specs import cluster, loading


def _ok(r, code: int = 0):
    assert r.exit_code == code, r.stderr
    return json.loads(r.stdout)


def test_throughput_is_the_whole_plan_everywhere(cli, tmp_path):
    est = _ok(cli("estimate", "llama-3.1-70b", "--gpus", "8", "--tp", "4", "--dp", "2", "--json"))["time"]
    assert est["throughput_tokens_per_second"] == pytest.approx(2 * est["throughput_tokens_per_second_per_replica"], rel=1e-12)
    assert est["throughput_tokens_per_second_per_gpu"] * 8 == pytest.approx(est["throughput_tokens_per_second"], rel=1e-12)
    assert est["best_throughput_tokens_per_second"] >= est["throughput_tokens_per_second"] * (1 - 1e-12)

    plan = tmp_path / "plan.yaml"
    rec = _ok(cli("recommend", "llama-3.1-70b", "--objective", "throughput", "--hardware", "h100-sxm-80gb", "--gpus", "8", "-o", str(plan), "--json"))
    win = rec["top"][0]
    shown = _ok(cli("show", str(plan), "--json"))["predicted"]["time"]
    assert shown["throughput_tokens_per_second"] == pytest.approx(win["time"]["throughput_tokens_per_second"], rel=1e-12)
    assert shown["throughput_tokens_per_second"] == pytest.approx(-win["objective_value"], rel=1e-12)
    replicas = win["plan"]["replicas"]
    assert shown["throughput_tokens_per_second_per_replica"] * replicas == pytest.approx(shown["throughput_tokens_per_second"], rel=1e-12)
    assert shown["throughput_tokens_per_second_per_gpu"] * win["num_gpus"] == pytest.approx(shown["throughput_tokens_per_second"], rel=1e-12)


def test_estimate_report_is_typed_and_keeps_kv_cache_out_of_training():
    spec = loading.load_model("llama-3.1-8b").spec
    hw = cluster.cluster(loading.load_hardware("h100-sxm-80gb"), gpus=8, nodes=None, gpus_per_node=None)
    serving = estimate(spec, hw, Layout(tp=8), InferenceWorkload(max_model_len=8192))
    training = estimate(spec, hw, Layout(dp=8, zero_stage=1), TrainingWorkload(seq_len=2048, global_batch_size=64))
    assert isinstance(serving, CostReport) and serving.kv_cache is not None and not serving.training
    assert training.kv_cache is None and training.training
    assert "kv_cache" in serving.model_dump(mode="json") and "kv_cache" not in training.model_dump(mode="json")
    assert training.model_dump(mode="json")["reason"] is None  # null keys stay present
    with pytest.raises(Exception):
        serving.fits = False  # frozen


def test_interleaved_stages_list_their_chunks(cli):
    args = ("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--tp", "2", "--pp", "4",
            "--virtual-stages", "2", "--pp-schedule", "interleaved", "--global-batch-size", "64")
    rep = _ok(cli(*args, "--json"))
    stage0 = rep["memory"]["per_rank"][0]
    assert stage0["layer_chunks"] == [[0, 3], [16, 19]]  # chunks 0 and 4 of 8 over 32 layers
    assert stage0["layers"] == [0, 19]
    r = cli(*args)
    assert r.exit_code == 0 and "0-3, 16-19" in r.stdout
    assert PipelineSchedule.INTERLEAVED.value == "interleaved"


def test_recommend_table_at_80_columns_shows_every_layout_in_full(cli, monkeypatch):
    monkeypatch.setattr(render_common.console, "width", 80)
    d = _ok(cli("recommend", "llama-3.1-70b", "--objective", "throughput", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--json"))
    r = cli("recommend", "llama-3.1-70b", "--objective", "throughput", "--hardware", "h100-sxm-80gb", "--gpus", "8")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0] == ("serving 1024-token prompts, 128 output tokens on vLLM 0.33.0; "
                        "best = most output tokens/s over all GPUs")
    for e in d["top"]:
        assert describe(e["plan"]) in r.stdout
    assert "…" not in r.stdout
    assert all(len(line) <= 80 for line in lines if "│" in line)  # the tables fit
    assert not any(set(line) <= set("│ ") and "│" in line for line in lines)  # no blank padding rows


def test_manifest_written_goes_to_stderr(cli, tmp_path):
    r = cli("recommend", "llama-3.1-8b", "--gpus", "1", "--max-model-len", "8192", "-o", str(tmp_path / "p.yaml"))
    assert r.exit_code == 0
    assert "manifest written to" in r.stderr and "manifest written to" not in r.stdout


def test_schema_output_names_each_command(cli):
    assert {"manifest", "estimate", "recommend"} <= set(OUTPUTS)
    assert _ok(cli("schema")) == _ok(cli("schema", "--output", "manifest"))
    est = _ok(cli("schema", "--output", "estimate"))
    assert {"model", "hardware", "plan", "memory", "time", "kv_cache"} <= set(est["properties"])
    rec = _ok(cli("schema", "--output", "recommend"))
    assert "top" in rec["properties"] and "pareto" in rec["properties"]
    bad = cli("schema", "--output", "nope")
    assert bad.exit_code == 2 and "--output" in bad.stderr and "estimate" in bad.stderr
