"""Every prediction carries its measured error band, and "fits" is decided at the band's edge,
through the real CLI (`estimate`, `recommend`, `capacity`, the manifest), parsing `--json`.

The real cases: Llama 3.1 8B trained on 8 H100s with ZeRO-3 and micro-batch 4 (1,792-token
sequences) reserves 73.3 GiB of the 79.1 GiB, between capacity / (1 + torchtitan's peak-memory
band) and capacity: tight. Llama 3.1 70B served on 2 H100s (tp=2) holds 20,768 KV tokens, so a
20,000-token max_model_len fits at the prediction but not at vLLM V1's KV band's edge: tight."""

from __future__ import annotations

import pytest
import yaml

from shardplan.knowledge.load import bands_file
from shardplan.plan.manifest import load_manifest
from shardplan.search.space import TIGHT

TRAIN = ("llama-3.1-8b", "--workload", "training", "--gpus", "8", "--zero-stage", "3", "--seq-len", "1792",
         "--global-batch-size", "64")
TIGHT_TRAIN = (*TRAIN, "--micro-batch-size", "4")
PINNED_TIGHT = ("--tp", "1", "--pp", "1", "--cp", "1", "--micro-batch-size", "4", "--recompute", "none",
                "--offload", "none")
# 0.9 of each GPU (vLLM's default to 0.19; 0.92 from 0.20.0) leaves the KV cache just above 20,000 tokens
SERVE = ("llama-3.1-70b", "--gpus", "2", "--max-model-len", "20000", "--gpu-memory-utilization", "0.9")


def _json(res, code=0):
    assert res.exit_code == code, (res.exit_code, res.stderr[-800:])
    return res.json()


def _band(kind, group, quantity):
    b = bands_file().band(kind, group, quantity)
    assert b is not None, (kind, group, quantity)
    return b


def test_a_training_plan_within_the_band_is_tight_and_estimate_still_exits_0(cli):
    d = _json(cli("estimate", *TIGHT_TRAIN, "--json"))
    band = _band("training", "torchtitan", "peak_memory").band_abs_error
    cap = d["hardware"]["memory_capacity_bytes"]
    peak = max(r["reserved_bytes"] for r in d["memory"]["per_rank"])
    assert d["fits"] and cap / (1 + band) < peak <= cap  # the case really is between the two
    edge = d["fit_at_band_edge"]
    assert edge["verdict"] == "tight"
    assert (edge["quantity"], edge["unit"], edge["band_abs_error"]) == ("peak_memory", "bytes", band)
    assert edge["predicted"] == pytest.approx(peak) and edge["limit"] == cap
    assert edge["at_band_edge"] == pytest.approx(peak * (1 + band)) and edge["at_band_edge"] > cap
    memory, speed = d["bands"]
    assert (memory["quantity"], memory["group"], memory["band_abs_error"]) == ("peak_memory", "torchtitan", band)
    assert (speed["quantity"], speed["group"]) == ("tokens_per_second", "torchtitan")
    assert speed["band_abs_error"] == _band("training", "torchtitan", "tokens_per_second").band_abs_error
    assert memory["num_cases"] == _band("training", "torchtitan", "peak_memory").num_cases > 0
    # the table says it, with the band
    out = cli("estimate", *TIGHT_TRAIN)
    assert out.exit_code == 0
    assert "tight: fits at the prediction, not at the band's edge" in out.stdout
    assert f"+{100 * band:.1f}% p90 on {memory['num_cases']} torchtitan runs" in out.stdout


def test_the_same_layout_with_micro_batch_2_fits_at_the_edge(cli):
    d = _json(cli("estimate", *TRAIN, "--micro-batch-size", "2", "--json"))
    band = d["fit_at_band_edge"]["band_abs_error"]
    assert d["fit_at_band_edge"]["verdict"] == "fits"
    assert max(r["reserved_bytes"] for r in d["memory"]["per_rank"]) * (1 + band) <= d["hardware"]["memory_capacity_bytes"]


def test_recommend_ranks_a_tight_plan_last_and_strict_fit_excludes_it(cli):
    d = _json(cli("recommend", *TRAIN, *PINNED_TIGHT, "--json"))
    verdicts = [t["fit_at_band_edge"]["verdict"] for t in d["top"]]
    assert verdicts and set(verdicts) == {"tight"}  # still recommended (ranked last), exit 0
    assert d["strict_fit"] is False and d["bands"][0]["group"] == "torchtitan"
    # unpinned offload, --strict-fit costs the offloaded variants the tight one had made unnecessary
    offloaded = _json(cli("recommend", *TRAIN, *PINNED_TIGHT[:-2], "--strict-fit", "--json"))
    assert offloaded["top"] and all(t["plan"]["offload"]["optimizer"] != "none" for t in offloaded["top"])
    assert all(t["fit_at_band_edge"]["verdict"] == "fits" for t in offloaded["top"])
    strict = _json(cli("recommend", *TRAIN, *PINNED_TIGHT, "--strict-fit", "--json"), code=3)
    assert strict["top"] == [] and strict["strict_fit"] is True
    assert strict["rejected"][TIGHT] >= 1
    # the table gives the reason in one line, and exits 3
    out = cli("recommend", *TRAIN, *PINNED_TIGHT, "--strict-fit")
    assert out.exit_code == 3
    lines = [line for line in out.stdout.splitlines() if "no layout fits at the error band's edge" in line]
    assert len(lines) == 1 and "without --strict-fit" in lines[0]


def test_recommend_puts_plans_that_fit_at_the_edge_first(cli):
    # One shape (tp 1, ZeRO-3 over 8 GPUs, no recomputation) in its micro-batch variants: 1 and 2
    # fit at the band's edge, 4 only at the prediction (and is the fastest)
    pins = ("--tp", "1", "--pp", "1", "--cp", "1", "--recompute", "none", "--offload", "none", "--expand")
    d = _json(cli("recommend", *TRAIN, *pins, "--json"))
    verdicts = [t["fit_at_band_edge"]["verdict"] for t in d["top"]]
    assert "tight" in verdicts and "fits" in verdicts  # a real mix: the ranking is tested, not assumed
    assert verdicts == sorted(verdicts, key=lambda v: v == "tight")
    fastest_tight = min(t["time"]["step_seconds"] for t in d["top"] if t["fit_at_band_edge"]["verdict"] == "tight")
    assert d["top"][0]["time"]["step_seconds"] > fastest_tight  # ranked after despite being faster
    assert "tight" in d["why"]
    # Unpinned, more shapes fit at the edge than are shown: none that fits only at the prediction
    # takes the place of one that fits at the edge, however much faster
    d = _json(cli("recommend", *TRAIN, "--json"))
    assert [t["fit_at_band_edge"]["verdict"] for t in d["top"]] == ["fits"] * 5
    strict = _json(cli("recommend", *TRAIN, "--strict-fit", "--json"))
    assert strict["top"] and all(t["fit_at_band_edge"]["verdict"] == "fits" for t in strict["top"])
    assert strict["rejected"][TIGHT] >= 1


def test_a_serving_plan_within_the_kv_band_is_tight(cli):
    d = _json(cli("estimate", *SERVE, "--tp", "2", "--json"))
    band = _band("engine_log", "vLLM V1", "kv_capacity")
    tokens = d["kv_cache"]["capacity_tokens"]
    assert d["fits"] and tokens * (1 - band.band_abs_error) < 20_000 <= tokens
    assert d["fit_at_band_edge"]["verdict"] == "tight"
    (kv,) = d["bands"]
    assert (kv["quantity"], kv["kind"], kv["group"], kv["band_abs_error"]) == (
        "kv_capacity", "engine_log", "vLLM V1", band.band_abs_error)
    assert kv["versions"] == list(band.versions) and kv["num_cases"] == band.num_cases
    assert kv["note"].startswith(f"±{100 * band.band_abs_error:.1f}% (p90 of {band.num_cases} vLLM V1 ")
    # pinned to bf16 on the GPUs alone (no fallback to smaller formats or host memory)
    assert _json(cli("recommend", *SERVE, "--strict-fit", "--quantization", "none", "--no-allow-offload", "--json"),
                 code=3)["top"] == []
    assert _json(cli("estimate", *SERVE, "--tp", "2", "--max-model-len", "18000", "--json"))[
        "fit_at_band_edge"]["verdict"] == "fits"


@pytest.mark.parametrize("args, group", [
    (("--engine-version", "0.6.4"), "vLLM V0"),
    (("--engine", "sglang"), "SGLang"),
])
def test_the_kv_band_is_the_engine_generations(cli, args, group):
    d = _json(cli("estimate", "llama-3.1-8b", *args, "--json"))
    (kv,) = d["bands"]
    assert kv["group"] == group
    assert kv["band_abs_error"] == _band("engine_log", group, "kv_capacity").band_abs_error


def test_an_engine_generation_without_cases_says_band_unknown(cli):
    d = _json(cli("estimate", "llama-3.1-8b", "--engine", "tgi", "--json"))  # the newest TGI: v3, no logs shipped
    (kv,) = d["bands"]
    assert (kv["group"], kv["band_abs_error"], kv["num_cases"]) == ("TGI v3", None, 0)
    assert kv["note"] == "no measured cases for TGI v3: band unknown"
    edge = d["fit_at_band_edge"]
    assert edge["verdict"] == "fits" and edge["at_band_edge"] is None and "band unknown" in edge["note"]


@pytest.mark.parametrize("args, kind, group", [
    (("--stack", "megatron"), "training", "megatron"),
    (("--stack", "hf", "--finetune", "qlora"), "finetune", "hf qlora"),
])
def test_the_memory_band_is_the_stacks(cli, args, kind, group):
    res = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", *args, "--json")
    assert res.exit_code in (0, 3), res.stderr  # the band is there whether or not it fits
    d = res.json()
    memory = d["bands"][0]
    assert (memory["quantity"], memory["kind"], memory["group"]) == ("peak_memory", kind, group)
    assert memory["band_abs_error"] == _band(kind, group, "peak_memory").band_abs_error


def test_the_manifest_records_the_bands_and_old_plans_still_read_back(cli, tmp_path):
    plan = tmp_path / "plan.yaml"
    _json(cli("recommend", "llama-3.1-8b", "--gpus", "1", "-o", str(plan), "--json"))
    data = yaml.safe_load(plan.read_text())
    kv, *under = data["predicted"]["bands"]
    assert (kv["group"], kv["band_abs_error"]) == ("vLLM V1", _band("engine_log", "vLLM V1", "kv_capacity").band_abs_error)
    # the plan is judged under traffic (goodput within the SLA): its figures there carry their bands too
    assert [b["quantity"] for b in under] == ["ttft_p50", "tpot_p50", "itl_p50", "output_tokens_per_second"]
    assert {b["group"] for b in under} <= {"vLLM V1, below saturation", "vLLM V1, saturated"}
    text = " ".join(cli("recommend", "llama-3.1-8b", "--gpus", "1").stdout.split())
    assert (f"#1: measured error of the model under traffic (p90 of {under[0]['num_cases']} vLLM V1 "
            f"{under[0]['versions'][0]}-{under[0]['versions'][-1]} serving benchmark runs") in text
    assert data["predicted"]["fit_at_band_edge"]["verdict"] == "fits"
    assert load_manifest(plan).predicted.bands[0].group == "vLLM V1"
    del data["predicted"]["bands"], data["predicted"]["fit_at_band_edge"]  # a plan written before bands
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(data, sort_keys=False))
    m = load_manifest(old)
    assert m.predicted.bands == [] and m.predicted.fit_at_band_edge is None


def test_capacity_rows_carry_the_verdict(cli):
    d = _json(cli("capacity", "llama-3.1-8b", "--json"))
    assert all(r["fit_at_band_edge"]["verdict"] in ("fits", "tight") for r in d["formats"] if r["min_num_gpus"])


@pytest.mark.parametrize("load,regime", [
    (("--request-rate", "2"), "below saturation"),  # far below what 8 replicas sustain
    (("--request-rate", "inf", "--num-prompts", "2000"), "saturated"),  # every request at once waits in the queue
])
def test_figures_under_traffic_carry_their_engine_and_regimes_band(cli, load, regime):
    d = _json(cli("estimate", "llama-3.1-8b", "--engine-version", "0.11.0", *load, "--json"))
    assert d["load"]["saturated"] is (regime == "saturated")
    kv, *under = d["bands"]
    assert kv["quantity"] == "kv_capacity"  # "fits" is still decided on the KV capacity's band
    assert [b["quantity"] for b in under] == ["ttft_p50", "tpot_p50", "itl_p50", "output_tokens_per_second"]
    for b in under:
        shipped = _band("serving_load", f"vLLM V1, {regime}", b["quantity"])
        assert (b["kind"], b["group"]) == ("serving_load", f"vLLM V1, {regime}")
        assert (b["band_abs_error"], b["mean_signed_error"], b["num_cases"]) == (
            shipped.band_abs_error, shipped.mean_signed_error, shipped.num_cases)
        assert b["num_cases"] >= 5 and b["versions"] == list(shipped.versions)
    ttft = under[0]
    out = cli("estimate", "llama-3.1-8b", "--engine-version", "0.11.0", *load)
    assert out.exit_code == 0
    text = " ".join(out.stdout.split())
    assert (f"serving benchmark runs {regime}, `shardplan validate`): median TTFT ±{100 * ttft['band_abs_error']:.0f}% "
            f"(mean {100 * ttft['mean_signed_error']:+.0f}%)") in text



def test_the_band_line_names_the_cases_of_each_figure_when_they_differ():
    """A calibrated profile's own serving runs may measure only some figures under traffic, and a
    figure may have no measured case: each is named with the cases it is over, none hidden."""
    from shardplan.cli.render_common import load_band_line
    from shardplan.cost.report import PredictionBand

    def band(q, err, on=None):
        return PredictionBand(quantity=q, kind="serving_load", group="vLLM V1, saturated", band_abs_error=err,
                              percentile=90, mean_signed_error=None if err is None else -0.1,
                              num_cases=0 if err is None else 5, versions=[] if err is None else ["0.11.0"],
                              measured_on=on, note="no measured cases for vllm: band unknown" if err is None else "")

    same = load_band_line([band("ttft_p50", 0.5), band("tpot_p50", 0.2)])
    assert same == ("measured error of the model under traffic (p90 of 5 vLLM V1 0.11.0 serving benchmark runs "
                    "saturated, `shardplan validate`): median TTFT ±50% (mean -10%), median TPOT ±20% (mean -10%)")
    mixed = load_band_line([band("ttft_p50", 0.5, on="my-hw"), band("tpot_p50", 0.2), band("itl_p50", None)])
    assert "median TTFT ±50% (mean -10%) (p90 of 5 vLLM V1 0.11.0 serving benchmark runs saturated measured on this " \
           "profile (my-hw))" in mixed
    assert "median TPOT ±20% (mean -10%) (p90 of 5 vLLM V1 0.11.0 serving benchmark runs saturated)" in mixed
    assert "median ITL: no measured cases for vllm: band unknown" in mixed
    assert load_band_line([]) == ""
