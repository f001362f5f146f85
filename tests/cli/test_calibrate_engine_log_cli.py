"""`shardplan calibrate --engine-log` on the command line: bad input is one line on stderr,
exit 2, and no profile written (an existing file is left as it was)."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK

LOGS = REPO / "shardplan" / "validation" / "corpus" / "engine_logs"
LOG_20K = LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log"


def _report(tmp_path):
    path = tmp_path / "verify.json"
    path.write_text(json.dumps({"plan": "p.yaml", "status": "ok", "device": "cuda", "world_size": 1,
                                "hardware": {"profile": "rtx-3090-24gb", "num_nodes": 1, "gpus_per_node": 1},
                                "probes": [{"rank": 0, "device_name": "NVIDIA GeForce RTX 3090", "matmul_dtype": "bf16",
                                            "matmul_size": 8192, "matmul_flops_per_second": 60e12}]}))
    return path


@pytest.mark.parametrize("case", ["no_memory_figures", "sglang", "both", "neither", "tp_with_report", "tp_zero"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(cli, tmp_path, case):
    out = tmp_path / "my-hw.yaml"
    fresh = tmp_path / "fresh.yaml"
    out.write_text("sentinel\n")
    args = {
        "no_memory_figures": ["--engine-log", LOGS / "vllm_v0_l4x2_ray_7878.log"],
        "sglang": ["--engine-log", LOGS / "sglang_l4x4_qwq32b_tp4.log"],
        "both": [_report(tmp_path), "--engine-log", LOG_20K],
        "neither": [],
        "tp_with_report": [_report(tmp_path), "--tp", "2"],
        "tp_zero": ["--engine-log", LOG_20K, "--tp", "0"],
    }[case]
    for target in (out, fresh):
        r = cli("calibrate", *args, "--hardware", "rtx-3090-24gb", "-o", target, "--json")
        assert r.exit_code == EXIT_BAD_INPUT, (case, r.stderr)
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert out.read_text() == "sentinel\n" and not fresh.exists()
    expected = {"no_memory_figures": "missing 'total_gpu_memory', 'non_torch_memory'", "sglang": "SGLang log",
                "both": "not both", "neither": "give a verify REPORT, --engine-log FILE or --serving-run FILE",
                "tp_with_report": "--tp", "tp_zero": "--tp"}[case]
    assert expected in r.stderr


def test_table_and_json_come_from_the_same_result(cli, tmp_path):
    out = tmp_path / "my-3090.yaml"
    r = cli("calibrate", "--engine-log", LOG_20K, "--hardware", "rtx-3090-24gb", "-o", out, "--name", "home-3090")
    assert r.exit_code == EXIT_OK, r.stderr
    assert "runtime.cuda_context_gib" in r.stdout and "gpu.memory_capacity_gib" in r.stdout
    assert "profile written to" in r.stderr and "profile written" not in r.stdout
    j = cli("calibrate", "--engine-log", LOG_20K, "--hardware", "rtx-3090-24gb", "-o", out, "--name", "home-3090",
            "--json").json()
    assert j["name"] == "home-3090" and j["input_file"] == str(LOG_20K)
    assert [c["new_gib"] for c in j["profile_changes"]] == [23.58, 0.35]
