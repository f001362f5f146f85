"""`shardplan calibrate`: a GPU verify report's probes -> a hardware profile that later
estimates use. The GPU report is synthetic (this machine has no GPU); the probes themselves
run here on the CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK
from shardplan.specs.loading import load_hardware

# H100 SXM figures of the size public measurements show (bf16 GEMM ~750-790 TFLOP/s, HBM3 copy
# ~2.9 TB/s, NVLink4 all-reduce busBw ~360 GB/s over 8 GPUs).
MATMUL = 750e12
MEMORY = 2.9e12
BUS = 360e9


def _gpu_report(path: Path, *, num_nodes: int = 1, matmul: float = MATMUL, **extra) -> Path:
    ranks = 8 * num_nodes
    probes = [{"rank": r, "device_name": "NVIDIA H100 80GB HBM3", "matmul_dtype": "bf16",
               "matmul_size": 8192, "matmul_flops_per_second": matmul * (1 - 0.001 * r),
               "memory_bytes_per_second": MEMORY, "all_reduce_bus_bytes_per_second": BUS, "all_reduce_ranks": ranks}
              for r in range(ranks)]
    report = {"plan": "plan.yaml", "status": "ok", "backend": "nccl", "device": "cuda", "world_size": ranks,
              "run": {"scale": "full"}, "ranks": [], "numerics": {}, "time": {"compared": True},
              "hardware": {"profile": "h100-sxm-80gb", "num_nodes": num_nodes, "gpus_per_node": 8},
              "probes": probes, "mismatches": []} | extra
    path.write_text(json.dumps(report))
    return path


def test_measured_efficiencies_replace_the_profile_ones_with_their_sources(cli, tmp_path):
    out = tmp_path / "my-h100.yaml"
    res = cli("calibrate", _gpu_report(tmp_path / "r.json"), "--hardware", "h100-sxm-80gb", "-o", out, "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    changes = {c["field"]: c for c in res.json()["changes"]}
    share = (8192 / (8192 + 16)) ** 3  # the cost model's shape share of an 8192^3 GEMM (half_dim 16)
    median_matmul = MATMUL * (1 - 0.001 * 3.5)  # median of the 8 ranks
    assert changes["efficiency.matmul"]["new"] == pytest.approx(median_matmul / (989.4e12 * share), abs=1e-4)
    assert changes["efficiency.memory_bandwidth"]["new"] == pytest.approx(2900 / 3350, abs=1e-4)
    assert changes["efficiency.intra_node_link"]["new"] == pytest.approx(360 / 450, abs=1e-4)
    assert "efficiency.inter_node_link" not in changes  # one node: the ring never left it

    hw = load_hardware(str(out))
    assert hw.name == "my-h100"
    assert hw.matmul_efficiency == pytest.approx(changes["efficiency.matmul"]["new"])
    assert hw.memory_bandwidth_efficiency == pytest.approx(2900 / 3350, abs=1e-4)
    assert hw.intra_node.efficiency == pytest.approx(0.8, abs=1e-4)
    base = load_hardware("h100-sxm-80gb")
    assert hw.inter_node.efficiency == base.inter_node.efficiency and hw.peak_flops == base.peak_flops
    assert "measured by shardplan verify" in hw.sources["efficiency.matmul"]
    assert yaml.safe_load(out.read_text())["sources"]["efficiency.matmul"] == hw.sources["efficiency.matmul"]


def test_later_estimates_use_the_calibrated_profile(cli, tmp_path):
    """Decode is bound by memory bandwidth and a training step by matmul throughput: with the
    calibrated profile each moves by the ratio of the efficiencies."""
    out = tmp_path / "my-h100.yaml"
    assert cli("calibrate", _gpu_report(tmp_path / "r.json"), "-o", out).exit_code == EXIT_OK
    common = ("llama-3.1-8b", "--json")

    def serve(hw: str) -> dict:
        return cli("estimate", *common, "--hardware", hw, "--batch-size", "1").json()["time"]

    def train(hw: str) -> dict:
        return cli("estimate", *common, "--hardware", hw, "--workload", "training", "--gpus", "8",
                   "--zero-stage", "3", "--global-batch-size", "64").json()["time"]

    old, new = serve("h100-sxm-80gb"), serve(str(out))
    ratio = new["tpot_seconds"] / old["tpot_seconds"]
    # bandwidth 0.85 -> 0.866: 1.8% faster (launch and kernel overheads do not scale)
    assert ratio < 0.995 and ratio == pytest.approx(0.85 / (2900 / 3350), rel=0.01), ratio
    old_t, new_t = train("h100-sxm-80gb"), train(str(out))
    step_ratio = new_t["step_seconds"] / old_t["step_seconds"]
    assert 1.02 < step_ratio < 0.80 / 0.76, step_ratio  # matmul 0.80 -> 0.76: slower, at most by that ratio


def test_over_nodes_the_all_reduce_calibrates_the_inter_node_link(cli, tmp_path):
    out = tmp_path / "two-nodes.yaml"
    res = cli("calibrate", _gpu_report(tmp_path / "r.json", num_nodes=2), "-o", out, "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    changes = {c["field"]: c for c in res.json()["changes"]}
    assert changes["efficiency.inter_node_link"]["new"] == 1.0  # 360 GB/s over 50 GB/s links: capped
    assert any("inter_node_link" in n and "capped" in n for n in res.json()["notes"])
    assert "efficiency.intra_node_link" not in changes


def test_a_figure_above_the_peak_is_capped_and_said(cli, tmp_path):
    res = cli("calibrate", _gpu_report(tmp_path / "r.json", matmul=1200e12), "-o", tmp_path / "x.yaml", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    changes = {c["field"]: c for c in res.json()["changes"]}
    assert changes["efficiency.matmul"]["new"] == 1.0
    assert any("matmul" in n and "check the profile's peak" in n for n in res.json()["notes"])


@pytest.mark.parametrize("edit,field", [
    ({"device": "cpu"}, "device"),
    ({"status": "failed"}, "status"),
    ({"probes": []}, "probes"),
    ({"hardware": {"profile": "x", "num_nodes": 0, "gpus_per_node": 8}}, "hardware.num_nodes"),
])
def test_reports_it_cannot_use_are_refused_with_the_field(cli, tmp_path, edit, field):
    out = tmp_path / "x.yaml"
    res = cli("calibrate", _gpu_report(tmp_path / "r.json", **edit), "-o", out)
    assert res.exit_code == EXIT_BAD_INPUT
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "r.json" in line and f"'{field}'" in line
    assert not out.exists()


def test_a_report_that_is_not_json_is_refused(cli, tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text('{"plan": ')
    res = cli("calibrate", bad, "-o", tmp_path / "x.yaml")
    assert res.exit_code == EXIT_BAD_INPUT and "r.json" in res.stderr and "JSON" in res.stderr


def test_the_probes_run_on_this_machine():
    """The same code a GPU rank runs after its work, on the CPU with small sizes."""
    import torch

    from shardplan.verify.probes import run_probes

    p = run_probes(torch.device("cpu"), torch.float32)
    assert p["device_name"] == "cpu" and p["matmul_dtype"] == "fp32" and p["matmul_size"] == 256
    for key in ("matmul_flops_per_second", "memory_bytes_per_second"):
        assert math.isfinite(p[key]) and p[key] > 1e6, (key, p[key])
    assert "all_reduce_bus_bytes_per_second" not in p  # no process group: nothing to reduce over


# ----- a run that ran out of memory ------------------------------------------------------------

def _oom_report(tmp_path: Path) -> dict:
    """The report `verify` writes when a GPU rank runs out of memory (built by the same code
    from what a rank hands over): the failed rank ran the matmul and copy probes alone after
    freeing its memory, no all-reduce."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import build_plan

    from shardplan.cost.layout import Layout
    from shardplan.cost.workload import TrainingWorkload
    from shardplan.plan.readback import plan_spec
    from shardplan.verify.outofmemory import hardware_for, oom_report
    from shardplan.verify.report import VerifyReport
    from shardplan.verify.runspec import plan_run

    m, _ = build_plan("llama-3.1-8b", 8, Layout(tp=2, dp=4, micro_batch_size=4),
                      TrainingWorkload(seq_len=4096, global_batch_size=64))
    run = plan_run(m, plan_spec(m), scale="full")
    hw, _ = hardware_for(m, run)
    probe = {"device_name": "NVIDIA H100 80GB HBM3", "matmul_dtype": "bf16", "matmul_size": 8192,
             "matmul_flops_per_second": MATMUL, "memory_bytes_per_second": MEMORY}
    details = {"rank": 1, "pp": 0, "dp": 0, "tp": 1, "cp": 0, "stage": 0, "step": 0, "steps_completed": 0,
               "measured": {"weights_at_rest_bytes": 8 * 2**30}, "wall_seconds": 12.0, "error": "OutOfMemoryError: ...",
               "failure": {"op": "aten.mm.default", "shape": [16384, 128256], "dtype": "bfloat16",
                           "allocation_bytes": 16384 * 128256 * 2, "live_bytes": 70 * 2**30, "live_forward_bytes": 40 * 2**30,
                           "limit_bytes": None, "component": "loss", "simulated": False,
                           "message": "CUDA out of memory. Tried to allocate 3.91 GiB."},
               "device_total_bytes": 85_000_000_000, "probes": probe}
    report = oom_report(run, hw, [details], plan="plan.yaml", backend="nccl", device="cuda")
    VerifyReport.model_validate(report)  # what `verify --json` prints
    return report


def test_a_run_that_ran_out_of_memory_calibrates_what_its_probes_measured(cli, tmp_path):
    report = _oom_report(tmp_path)
    path = tmp_path / "oom.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "my-h100.yaml"
    res = cli("calibrate", path, "-o", out, "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    data = res.json()
    changes = {c["field"]: c for c in data["changes"]}
    assert set(changes) == {"efficiency.matmul", "efficiency.memory_bandwidth"}  # no all-reduce ran
    assert changes["efficiency.memory_bandwidth"]["new"] == pytest.approx(2900 / 3350, abs=1e-4)
    notes = " ".join(data["notes"])
    assert "ran out of memory on rank 1" in notes and "aten.mm.default" in notes
    assert "efficiency.intra_node_link: not measured" in notes
    assert "not measured: gradients, optimizer_states, activations" in notes  # what the run never got to
    hw = load_hardware(str(out))
    assert hw.intra_node.efficiency == load_hardware("h100-sxm-80gb").intra_node.efficiency


@pytest.mark.parametrize("edit,field", [
    ({"oom": None}, "oom"),  # says it ran out of memory, but not where
    ({"probes": []}, "probes"),  # the failed rank's probes did not run
    ({"device": "cpu"}, "device"),  # a simulated out-of-memory on a CPU
    ({"status": "failed"}, "status"),
])
def test_out_of_memory_reports_it_cannot_use_are_refused(cli, tmp_path, edit, field):
    report = _oom_report(tmp_path) | edit
    path = tmp_path / "oom.json"
    path.write_text(json.dumps({k: v for k, v in report.items() if v is not None}))
    out = tmp_path / "x.yaml"
    res = cli("calibrate", path, "-o", out)
    assert res.exit_code == EXIT_BAD_INPUT
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and f"'{field}'" in line, line
    assert not out.exists()
