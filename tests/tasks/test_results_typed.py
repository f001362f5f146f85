"""Typed results of capacity, export, replan and verify: progress callbacks (tasks never
print), keys absent stay absent, and log lines go to stderr, never into --json."""

from __future__ import annotations

import json

from conftest import build_plan
from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import EXIT_OK
from shardplan.plan import manifest as mf
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model


def test_training_capacity_reports_progress_once_per_search(capsys):
    from shardplan.tasks.capacity import CapacityResult, TrainingCapacity, training_capacity, training_choices

    hw = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=1)
    calls: list[tuple[int, int]] = []
    res = training_capacity(load_model("debug").spec, hw, TrainingWorkload(seq_len=256, global_batch_size=8),
                            max_gpus=2, progress=lambda done, total: calls.append((done, total)))
    n = len(training_choices())
    assert calls == [(i, n) for i in range(1, n + 1)]
    assert isinstance(res, TrainingCapacity) and len(res.rows) == n
    assert capsys.readouterr() == ("", "")  # a task never prints
    dumped = CapacityResult(res).model_dump(mode="json")
    assert dumped["workload"] == "training" and dumped["rows"][0]["min_num_gpus"] == 1
    assert "step_seconds" in dumped["rows"][0]


def test_a_format_not_found_has_no_layout_keys():
    from shardplan.tasks.capacity import FormatRow

    row = FormatRow(weight_dtype="bf16", quantization="none", min_num_gpus=None, num_nodes=None,
                    not_found="no layout", per_tp=[]).model_dump(mode="json")
    assert row == {"weight_dtype": "bf16", "quantization": "none", "min_num_gpus": None, "num_nodes": None,
                   "not_found": "no layout", "per_tp": []}


def _plan(tmp_path, gpus, workload, **layout):
    m, _ = build_plan("debug", gpus, Layout(**layout), workload)
    path = tmp_path / "plan.yaml"
    mf.write_manifest(m, path)
    return path


def test_replan_reports_progress_and_a_typed_result(tmp_path, capsys):
    from shardplan.tasks.replan import ReplanResult, replan

    path = _plan(tmp_path, 4, InferenceWorkload(max_model_len=512, input_len=384, output_len=128), tp=2, dp=2)
    old = mf.load_manifest(path)
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=2, nodes=None, gpus_per_node=8)
    calls: list[tuple[int, int]] = []
    res = replan(old, source=str(path), hw=hw, num_gpus=2, margin=0.05, top_k=3,
                 progress=lambda done, total: calls.append((done, total)))
    assert isinstance(res, ReplanResult) and res.chosen is not None
    assert calls and calls[-1][0] == calls[-1][1]  # the last call says all done
    assert capsys.readouterr() == ("", "")
    dumped = res.model_dump(mode="json")
    assert dumped["from"]["num_gpus"] == 4 and "from_" not in dumped  # the JSON key is `from`
    assert sum(c["chosen"] for c in dumped["candidates"]) == 1


def test_replan_and_export_say_what_they_wrote_on_stderr_only(cli, tmp_path):
    path = _plan(tmp_path, 4, InferenceWorkload(max_model_len=512, input_len=384, output_len=128), tp=2, dp=2)
    out = tmp_path / "new.yaml"
    res = cli("replan", path, "--gpus", "2", "-o", out, "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    data = res.json()  # stdout is only the JSON
    assert data["manifest"] == str(out) and f"manifest written to {out}" in res.stderr
    assert "move list written to" in res.stderr
    res = cli("export", path, "--to", "vllm", "-o", tmp_path / "ex")
    assert res.exit_code == EXIT_OK, res.stderr
    assert res.stdout == "" and "vllm: wrote" in res.stderr
    res = cli("export", path, "--to", "vllm", "--json")
    assert all("path" not in f for f in res.json()["files"])  # not written: no path key


def test_verify_status_lines_follow_each_rank_and_phase():
    from shardplan.verify.launch import status_events

    seen: dict = {}
    assert status_events(seen, [{"rank": 0, "state": "not started"}, {"rank": 1, "state": "not started"}], 2) == []
    lines = status_events(seen, [{"rank": 0, "state": "started"}, {"rank": 1, "state": "started"}], 2)
    assert lines == ["rank 0 started (1/2)", "rank 1 started (2/2)"]
    assert status_events(seen, [{"rank": 0, "state": "started"}, {"rank": 1, "state": "started"}], 2) == []
    # rank 0 finished and entered the reference between two looks: both lines still come
    lines = status_events(seen, [{"rank": 0, "state": "done", "phase": "reference"},
                                 {"rank": 1, "state": "error", "error": "RuntimeError: boom\nmore"}], 2)
    assert lines == ["rank 0 finished its run (1/2)", "rank 0: running the unsharded single-process reference",
                     "rank 1 failed: RuntimeError: boom"]


def test_the_verify_report_keeps_the_report_file_shape(tmp_path):
    """A report as the ranks write it validates as VerifyReport and dumps back unchanged
    (`note` and the launcher's keys absent when absent, NaN kept)."""
    from shardplan.verify.report import VerifyReport

    comp = {"component": "weights", "measured_bytes": 10, "predicted_bytes": 10.0, "relative_error": 0.0,
            "tolerance": 0.02, "ok": True}
    report = {"plan": "p.yaml", "status": "mismatch", "backend": "gloo", "device": "cpu", "world_size": 1,
              "run": {"scale": "proxy", "notes": []}, "layout": {"tp": 1}, "tolerances": {"weights": 0.02, "temporary": None},
              "ranks": [{"rank": 0, "pp": 0, "dp": 0, "tp": 0, "stage": 0, "cp": 0,
                         "components": [comp, comp | {"component": "activations", "note": "peak"}],
                         "step_seconds": [0.1], "wall_seconds": 1.0, "extra_measured_bytes": {}}],
              "numerics": {"check": "loss per step", "measured": [7.0, float("nan")], "ok": False, "checked": True},
              "time": {"measured": {}, "predicted": {}, "compared": False, "reason": "cpu"},
              "hardware": {"profile": "h100-sxm-80gb", "num_nodes": 1, "gpus_per_node": 8},
              "probes": [], "mismatches": ["numerics"]}
    dumped = VerifyReport.model_validate(report).model_dump(mode="json")
    assert json.dumps(dumped) == json.dumps(report)
    launched = VerifyReport.model_validate(report | {"pids": [1], "run_dir": "/tmp/x"}).model_dump(mode="json")
    assert launched["pids"] == [1] and launched["run_dir"] == "/tmp/x"
