"""`shardplan calibrate --serving-run` on the command line: the table and --json from one result,
the profile usable with --hardware at once, and bad input as one line with exit 2."""

from __future__ import annotations

import yaml

import pytest

from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK

RUN = dict(kind="serving_load", id="burst-2k", source="test", model="llama-3.1-8b", hardware="h100-sxm-80gb", gpus=1,
           engine="vllm", engine_version="0.11.0", dataset="random", input_len=2000, output_len=50, num_requests=200,
           total_input_tokens=400_000, total_output_tokens=10_000,
           measured=dict(median_ttft_ms=9000.0, median_tpot_ms=300.0, output_tokens_per_second=600.0))


def _runs(tmp_path):
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"cases": [RUN]}))
    return path


def test_json_and_table_and_the_profile_in_use(cli, tmp_path):
    out = tmp_path / "lab-h100.yaml"
    j = cli("calibrate", "--serving-run", _runs(tmp_path), "-o", out, "--json").json()
    assert j["measured_by"] == "serving-run" and j["name"] == "lab-h100"
    (change,) = j["changes"]
    assert change["field"] == "gpu.power_limited_compute_fraction" and 0.3 < change["new"] < 0.9
    figures = {f["figure"]: f for f in j["fit_figures"]}
    assert set(figures) == {"output_tokens_per_second", "median_ttft_ms", "median_tpot_ms"}
    assert figures["output_tokens_per_second"]["after"] == pytest.approx(600.0, rel=0.01)
    assert figures["output_tokens_per_second"]["before"] > 600.0
    t = cli("calibrate", "--serving-run", _runs(tmp_path), "-o", out)
    assert t.exit_code == EXIT_OK, t.stderr
    assert "gpu.power_limited_compute_fraction 1 ->" in t.stdout and "predicted after" in t.stdout
    # the written profile is a hardware profile: an estimate on it prefills slower than on the bundled one
    slow = cli("estimate", "llama-3.1-8b", "--hardware", out, "--input-len", "2000", "--output-len", "50",
               "--batch-size", "64", "--json").json()
    full = cli("estimate", "llama-3.1-8b", "--hardware", "h100-sxm-80gb", "--input-len", "2000", "--output-len", "50",
               "--batch-size", "64", "--json").json()
    assert slow["time"]["ttft_seconds"] > 1.2 * full["time"]["ttft_seconds"]


@pytest.mark.parametrize("case", ["case_without_run", "tp", "plan", "with_log", "not_a_case_file"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(cli, tmp_path, case):
    out = tmp_path / "p.yaml"
    runs = _runs(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("cases: [{kind: serving_load, id: x}]\n")
    args = {"case_without_run": ["--case", "burst-2k"], "tp": ["--serving-run", runs, "--tp", "2"],
            "plan": ["--serving-run", runs, "--plan", tmp_path / "plan.yaml"],
            "with_log": ["--serving-run", runs, "--engine-log", tmp_path / "x.log"],
            "not_a_case_file": ["--serving-run", bad]}[case]
    r = cli("calibrate", *args, "-o", out, "--json")
    assert r.exit_code == EXIT_BAD_INPUT, (case, r.stderr)
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()
    expected = {"case_without_run": "--case", "tp": "--tp", "plan": "--plan", "with_log": "not both",
                "not_a_case_file": "bad.yaml"}[case]
    assert expected in r.stderr
