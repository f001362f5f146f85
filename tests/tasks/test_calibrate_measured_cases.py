"""Calibration closes the loop (issue 29, item 4): `calibrate` records what it was given as
measured cases in the profile it writes (`measured_cases:`), and predictions made with that
profile carry the band of its own cases where they match the prediction's group and quantity.

Golden case: the vLLM 0.10.1.1 start-up log of Qwen2-7B-Instruct on one A100 80GB at
gpu_memory_utilization 0.5 and max_model_len 16384 (shardplan/validation/corpus/engine_logs,
index.yaml: 'GPU KV cache size: 464,848 tokens'), with a plan made for that deployment. With one
case the p90 band is that case's |predicted / measured - 1|."""

from __future__ import annotations

import datetime
import json

import pytest
import yaml
from conftest import REPO

from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK
from shardplan.knowledge.load import bands_file
from shardplan.specs.cases import CaseFile, EngineLogCase, TrainingCase
from shardplan.specs.loading import load_hardware, read_structured
from shardplan.validation.predict import compare

CORPUS = REPO / "shardplan" / "validation" / "corpus"
LOG = CORPUS / "engine_logs" / "vllm_v1_a100-80gbx1_qwen2_7b_16k_util050.log"
MODEL = CORPUS / "models" / "qwen2-7b-instruct.yaml"
LOGGED_KV_TOKENS = 464_848  # the log's 'GPU KV cache size' (index.yaml kv_tokens)
SERVING = ("--gpus", "1", "--max-model-len", "16384", "--gpu-memory-utilization", "0.5",
           "--engine-version", "0.10.1.1")
GIB = 2**30


def _find(tree, key):
    """Every value under `key` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        return [v for k, v in tree.items() if k == key] + [x for v in tree.values() for x in _find(v, key)]
    return [x for v in tree for x in _find(v, key)] if isinstance(tree, list) else []


def _ok(r):
    assert r.exit_code == EXIT_OK, r.stderr
    return r.json()


@pytest.fixture
def plan(cli, tmp_path):
    path = tmp_path / "plan.yaml"
    _ok(cli("recommend", MODEL, "--hardware", "a100-sxm-80gb", "--tp", "1", *SERVING, "-o", path, "--json"))
    return path


@pytest.fixture
def calibrated(cli, tmp_path, plan):
    out = tmp_path / "my-a100.yaml"
    res = _ok(cli("calibrate", "--engine-log", LOG, "--plan", plan, "--hardware", "a100-sxm-80gb", "-o", out, "--json"))
    return out, res


def test_the_log_and_its_plan_are_recorded_as_a_case_that_round_trips(calibrated):
    out, res = calibrated
    assert res["measured_case"] == LOG.stem and res["num_measured_cases"] == 1
    assert any(n.startswith(f"recorded measured case {LOG.stem} (engine_log, KV capacity 464,848 tokens)")
               for n in res["notes"])
    data = yaml.safe_load(out.read_text())
    (case,) = CaseFile.model_validate({"cases": data["measured_cases"]}).cases  # the `validate --cases` schema
    assert isinstance(case, EngineLogCase)
    assert (case.kv_cache_tokens, case.started) == (LOGGED_KV_TOKENS, True)
    assert (case.engine, case.engine_version, case.tp, case.pp, case.gpus) == ("vllm", "0.10.1.1", 1, 1, 1)
    assert (case.flags.max_model_len, case.flags.gpu_memory_utilization) == (16384, 0.5)
    assert case.hardware == "my-a100.yaml" and case.model == str(MODEL)
    assert case.source == f"engine log {LOG.name}, calibrated {datetime.date.today().isoformat()}"
    # The loader points the case at the profile itself, wherever the file is now.
    moved = out.with_name("renamed.yaml")
    moved.write_text(out.read_text())
    (loaded,) = load_hardware(str(moved)).measured_cases
    assert loaded.hardware == str(moved.resolve()) and loaded.model_dump(exclude={"hardware"}) == \
        case.model_dump(exclude={"hardware"})


def test_an_estimate_with_the_profile_carries_the_band_of_its_own_case(cli, calibrated):
    out, _ = calibrated
    d = _ok(cli("estimate", MODEL, "--hardware", out, *SERVING, "--json"))
    (kv,) = d["bands"]
    predicted = d["kv_cache"]["capacity_tokens"]
    error = predicted / LOGGED_KV_TOKENS - 1  # one case: the band is its |error|
    assert (kv["group"], kv["num_cases"], kv["versions"], kv["measured_on"]) == ("vLLM V1", 1, ["0.10.1.1"], "my-a100")
    assert kv["band_abs_error"] == pytest.approx(abs(error), rel=1e-12)
    assert kv["mean_signed_error"] == pytest.approx(error, rel=1e-12)
    assert abs(error) < 0.005  # the calibrated profile predicts its own log closely
    shipped = bands_file().band("engine_log", "vLLM V1", "kv_capacity")
    assert shipped is not None and shipped.num_cases > 1 and kv["band_abs_error"] != shipped.band_abs_error
    assert kv["note"].endswith("(p90 of 1 vLLM V1 0.10.1.1 start-up log measured on this profile (my-a100))")
    edge = d["fit_at_band_edge"]
    assert edge["band_abs_error"] == kv["band_abs_error"]
    assert edge["at_band_edge"] == pytest.approx(predicted * (1 - abs(error)))
    # recommend and `validate --cases PROFILE` show the same band
    rec = _ok(cli("recommend", MODEL, "--hardware", out, "--tp", "1", *SERVING, "--json"))
    assert rec["bands"][0]["band_abs_error"] == kv["band_abs_error"]
    assert rec["top"][0]["bands"][0]["measured_on"] == "my-a100"
    cap = _ok(cli("capacity", MODEL, "--hardware", out, "--context", "16384", "--engine-version", "0.10.1.1",
                  "--json"))
    edges = [e for e in _find(cap, "fit_at_band_edge") if e is not None]
    assert edges and {e["band_abs_error"] for e in edges} == {kv["band_abs_error"]}
    v = _ok(cli("validate", "--cases", out, "--json"))
    (group,) = [g for g in v["groups"] if g["quantity"] == "kv_capacity"]
    assert group["band_abs_error"] == kv["band_abs_error"]


def test_other_quantities_and_profiles_without_cases_keep_the_shipped_band(cli, calibrated, tmp_path):
    out, _ = calibrated
    # training on the calibrated profile: no training case was measured on it
    t = cli("estimate", "llama-3.1-8b", "--hardware", out, "--workload", "training", "--stack", "torchtitan",
            "--gpus", "8", "--json").json()
    memory = t["bands"][0]
    assert memory["measured_on"] is None
    assert memory["band_abs_error"] == bands_file().band("training", "torchtitan", "peak_memory").band_abs_error
    # serving at another engine generation (vLLM V0): the profile's V1 case does not match
    v0 = _ok(cli("estimate", MODEL, "--hardware", out, "--gpus", "1", "--max-model-len", "16384",
                 "--engine-version", "0.6.4", "--json"))
    assert v0["bands"][0]["measured_on"] is None and v0["bands"][0]["group"] != "vLLM V1"
    # calibrated without --plan: no case, the output says so, and the band is the shipped one
    bare = tmp_path / "bare.yaml"
    res = _ok(cli("calibrate", "--engine-log", LOG, "--hardware", "a100-sxm-80gb", "-o", bare, "--json"))
    assert res["measured_case"] is None and res["num_measured_cases"] == 0
    assert any(n.startswith("no measured case: pass --plan") for n in res["notes"])
    assert "measured_cases" not in yaml.safe_load(bare.read_text())
    kv = _ok(cli("estimate", MODEL, "--hardware", bare, *SERVING, "--json"))["bands"][0]
    assert kv["measured_on"] is None
    assert kv["band_abs_error"] == bands_file().band("engine_log", "vLLM V1", "kv_capacity").band_abs_error


def test_recalibrating_a_calibrated_profile_keeps_its_cases(cli, calibrated, tmp_path, plan):
    out, _ = calibrated
    again = tmp_path / "again.yaml"
    res = _ok(cli("calibrate", "--engine-log", LOG, "--plan", plan, "--hardware", out, "-o", again, "--json"))
    assert res["num_measured_cases"] == 1  # the same log replaces its own case, not a second copy
    (case,) = yaml.safe_load(again.read_text())["measured_cases"]
    assert case["hardware"] == "again.yaml"


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(kv_cache_tokens="lots"), "measured_cases.0.engine_log.kv_cache_tokens"),
    (lambda c: c.update(colour="red"), "measured_cases.0.engine_log.colour"),
    (lambda c: c.pop("started"), "measured_cases.0.engine_log.started"),
    (lambda c: c.update(kind="benchmark"), "measured_cases.0"),
])
def test_a_malformed_measured_case_is_one_line_exit_2_naming_the_file_and_field(cli, calibrated, tmp_path, edit, field):
    out, _ = calibrated
    data = yaml.safe_load(out.read_text())
    edit(data["measured_cases"][0])
    bad = tmp_path / "bad-hw.yaml"
    bad.write_text(yaml.safe_dump(data, sort_keys=False))
    r = cli("estimate", MODEL, "--hardware", bad, *SERVING, "--json")
    assert r.exit_code == EXIT_BAD_INPUT and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "bad-hw.yaml" in r.stderr and f"field '{field}'" in r.stderr


def test_a_case_whose_model_is_gone_is_one_line_exit_2(cli, calibrated, tmp_path):
    out, _ = calibrated
    data = yaml.safe_load(out.read_text())
    data["measured_cases"][0]["model"] = "gone.yaml"
    bad = tmp_path / "gone-hw.yaml"
    bad.write_text(yaml.safe_dump(data, sort_keys=False))
    r = cli("estimate", MODEL, "--hardware", bad, *SERVING)
    assert r.exit_code == EXIT_BAD_INPUT and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "gone-hw.yaml" in r.stderr and "measured_cases.0" in r.stderr and LOG.stem in r.stderr


def test_plan_and_log_that_disagree_are_refused_and_nothing_written(cli, tmp_path, plan, training_plan):
    out = tmp_path / "my.yaml"
    r = cli("calibrate", "--engine-log", LOG, "--plan", training_plan, "--hardware", "a100-sxm-80gb", "-o", out)
    assert r.exit_code == EXIT_BAD_INPUT and "a training plan" in r.stderr and not out.exists()
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("calibrate", "--engine-log", LOG, "--plan", plan, "--tp", "2", "--hardware", "a100-sxm-80gb", "-o", out)
    assert r.exit_code == EXIT_BAD_INPUT and "--tp" in r.stderr and not out.exists()
    r = cli("calibrate", "--engine-log", LOG, "--plan", plan, "--hardware", "h100-sxm-80gb", "-o", out)
    assert r.exit_code == EXIT_BAD_INPUT and "hardware.profile_name" in r.stderr and not out.exists()


# --- a GPU verify report of a training plan -> a training case ---------------------------------


def _report(tmp_path, plan, peak_bytes: int, scale: str = "full"):
    path = tmp_path / "verify.json"
    path.write_text(json.dumps({
        "plan": str(plan), "status": "ok", "device": "cuda", "world_size": 8,
        "hardware": {"profile": "a100-sxm-80gb", "num_nodes": 1, "gpus_per_node": 8},
        "probes": [{"rank": 0, "device_name": "NVIDIA A100-SXM4-80GB", "matmul_dtype": "bf16", "matmul_size": 8192,
                    "matmul_flops_per_second": 250e12}],
        "run": {"kind": "training", "scale": scale, "dtype": "bf16", "plan_dtype": "bf16",
                "work": {"steps": 3, "seq_len": 4096, "micro_batch_size": 1}},
        "ranks": [{"rank": r, "memory_peak": {"allocated_peak_bytes": peak_bytes - r * 2**20}} for r in range(8)],
    }))
    return path


@pytest.fixture
def training_plan(cli, tmp_path):
    path = tmp_path / "train.yaml"
    _ok(cli("recommend", "llama-3.1-8b", "--workload", "training", "--stack", "torchtitan", "--gpus", "8",
            "--hardware", "a100-sxm-80gb", "--tp", "1", "--pp", "1", "-o", path, "--json"))
    return path


def test_a_training_report_is_a_case_and_bands_the_profiles_training_estimates(cli, tmp_path, training_plan):
    peak = 40 * GIB
    out = tmp_path / "my-train.yaml"
    res = _ok(cli("calibrate", _report(tmp_path, training_plan, peak), "--hardware", "a100-sxm-80gb", "-o", out,
                  "--json"))
    assert res["measured_case"] == "verify" and res["num_measured_cases"] == 1
    (case,) = CaseFile.model_validate({"cases": read_structured(out)["measured_cases"]}).cases
    assert isinstance(case, TrainingCase)
    assert case.stack == "torchtitan" and case.gpus == 8 and case.seq_len == 4096
    assert case.measured.memory_counter == "allocated"
    assert case.measured.peak_memory_gib == pytest.approx(40.0)  # the largest rank's peak
    (own,) = load_hardware(str(out)).measured_cases
    (cmp,) = [c for c in compare(own) if c.quantity == "peak_memory"]
    d = cli("estimate", "llama-3.1-8b", "--hardware", out, "--workload", "training", "--stack", "torchtitan",
            "--gpus", "8", "--tp", "1", "--pp", "1", "--json").json()
    memory, tokens = d["bands"]
    assert memory["measured_on"] == "my-train" and memory["num_cases"] == 1
    assert memory["band_abs_error"] == pytest.approx(abs(cmp.predicted / (40 * GIB) - 1), rel=1e-12)
    assert tokens["measured_on"] is None  # no throughput was measured


def test_a_proxy_run_makes_no_case(cli, tmp_path, training_plan):
    out = tmp_path / "proxy.yaml"
    res = _ok(cli("calibrate", _report(tmp_path, training_plan, 4 * GIB, scale="proxy"), "--hardware",
                  "a100-sxm-80gb", "-o", out, "--json"))
    assert res["measured_case"] is None
    assert any(n.startswith("no measured case: the run was at --scale proxy") for n in res["notes"])
