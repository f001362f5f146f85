"""Inputs a scripted sweep of the CLI (1,773 invocations over every command) found mishandled: each is
now a one-line error with exit 2 naming the option, or the answer a user expects."""

from __future__ import annotations

import pytest

SHORT = ("--input-len", "256", "--output-len", "64")  # the debug model holds 512 tokens


def _one_line_exit_2(r, *words: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_min_throughput_zero_is_no_limit(cli):
    r = cli("recommend", "debug", "--gpus", "1", *SHORT, "--min-throughput", "0", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["binding_constraint"]["constraint"] != "min_throughput"


@pytest.mark.parametrize("command", [("recommend", "debug", "--gpus", "1", *SHORT),
                                     ("capacity", "debug", "--request-rate", "1", *SHORT)])
@pytest.mark.parametrize("limit", [("--max-ttft-ms", "0"), ("--max-tpot-ms", "inf")])
def test_latency_limits_must_be_finite_and_above_zero(cli, command, limit):
    _one_line_exit_2(cli(*command, *limit), f"field '{limit[0]}'", "above 0")


def test_a_name_too_long_for_a_file_is_an_unknown_model_quoted_short(cli):
    r = cli("estimate", "a" * 5000, "--gpus", "1")
    _one_line_exit_2(r, "unknown model", "5,000 characters")
    assert len(r.stderr) < 300


def test_a_malformed_metrics_url_is_refused(cli, tmp_path):
    plan = tmp_path / "plan.yaml"
    assert cli("recommend", "debug", "--gpus", "1", *SHORT, "-o", plan).exit_code == 0
    for url in ("http://[::1", "http://h:99999/metrics", "http://h:port/metrics"):
        _one_line_exit_2(cli("watch", plan, "--once", "--metrics", url), "not an http(s) URL")


@pytest.mark.parametrize("command", [
    ("recommend", "debug", "--gpus", "4", "--input-len", "1024"),
    ("capacity", "debug", "--request-rate", "10", "--input-len", "500", "--output-len", "64"),
    ("estimate", "debug", "--gpus", "1", "--input-len", "600"),  # a static batch too
    ("estimate", "llama-3.1-8b", "--gpus", "1", "--input-len", "200000"),
])
def test_requests_longer_than_the_context_are_refused_everywhere(cli, command):
    _one_line_exit_2(cli(*command), "field '--input-len'", "exceed the context")


@pytest.mark.parametrize("args,expected", [
    ((), (448, 64)),  # neither given: 7/8 and 1/8 of the 512-token context
    (("--input-len", "400"), (400, 112)),  # the output takes the rest
    (("--output-len", "100"), (412, 100)),  # the prompt takes the rest
    (("--input-len", "256", "--output-len", "64"), (256, 64)),  # given lengths that fit: as given, no note
])
def test_default_lengths_fit_a_context_shorter_than_the_default_request(cli, args, expected):
    """The default request (1024 + 128 tokens) does not fit the debug model's 512 tokens: what the
    user left out is shortened to fit, and the answer says so (it was exit 2 for options not given)."""
    d = cli("estimate", "debug", "--gpus", "1", *args, "--json").json()
    assert (d["workload"]["input_len"], d["workload"]["output_len"]) == expected
    notes = [a for a in d["assumptions"] if "default request" in a]
    assert len(notes) == (0 if len(args) == 4 else 1)
    r = cli("recommend", "debug", "--gpus", "1", *args, "--json")
    assert r.exit_code == 0, r.stderr
    c = cli("capacity", "debug", "--request-rate", "10", *args, "--json").json()
    assert (c["mean_input_tokens"], c["mean_output_tokens"]) == expected


def test_capacity_context_is_the_models_at_most(cli):
    _one_line_exit_2(cli("capacity", "debug", "--context", "4096"), "field '--context'", "512")
    r = cli("capacity", "debug", "--json")  # the default 8,192 tokens, capped at the model's 512
    assert r.exit_code in (0, 3), r.stderr


def test_capacity_for_a_rate_stays_within_max_gpus(cli):
    r = cli("capacity", "llama-3.1-8b", "--request-rate", "1000", "--max-gpus", "8", "--json")
    assert r.exit_code == 3, r.stderr
    out = r.json()
    assert out["best"] is None
    over = [row for row in out["rows"] if row["num_gpus"] is not None]
    assert over and all(row["num_gpus"] > 8 and "--max-gpus 8" in row["reason"] for row in over)
    r = cli("capacity", "llama-3.1-8b", "--request-rate", "10", "--max-gpus", "8", "--json")
    assert r.exit_code == 0 and r.json()["best"]["num_gpus"] <= 8


def test_counts_are_never_negative_with_the_offload_fallback(cli):
    """An 8B model on one L4 fits only with layers offloaded: the fallback took back more rejected points
    than the goodput search had counted (-28 layouts evaluated)."""
    out = cli("recommend", "llama-3.1-8b", "-H", "l4-24gb", "--gpus", "1", "--json").json()
    assert 0 <= out["num_feasible"] <= out["num_evaluated"] <= out["num_candidates"]
    assert all(v > 0 for v in out["rejected"].values())


def test_dataset_lengths_apply_to_the_goodput_search(cli):
    r = cli("recommend", "llama-3.1-8b", "--gpus", "1", "--dataset-lengths", "sharegpt", "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    assert "sharegpt request lengths" in out["assumptions"]
    assert out["top"], out


@pytest.mark.parametrize("command, option, words", [
    (("estimate", "llama-3.1-8b", "--engine", "tgi", "--gpus", "2", "--pp", "2"), "--pp", "TGI has no pipeline"),
    (("estimate", "llama-3.1-70b", "--engine", "llamacpp", "--gpus", "4", "--tp", "2", "--pp", "2"), "--tp/--pp",
     "one way"),
])
def test_an_engine_refuses_a_layout_it_cannot_run(cli, command, option, words):
    _one_line_exit_2(cli(*command), f"field '{option}'", words)


def test_a_rate_too_low_to_simulate_is_refused(cli):
    _one_line_exit_2(cli("estimate", "llama-3.1-8b", "--gpus", "1", "--request-rate", "1e-30"),
                     "field '--request-rate'", "at least")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_cpu_offload_gb_must_be_finite(cli, value):
    _one_line_exit_2(cli("estimate", "llama-3.1-8b", "--gpus", "1", "--cpu-offload-gb", value),
                     "field '--cpu-offload-gb'", "finite")


def test_llamacpp_search_without_host_bandwidth_skips_offload_and_says_why(cli):
    """h100-sxm-80gb states no host DRAM bandwidth, which llama.cpp's CPU layers need: the search
    answers from the layouts that fit on the GPUs and names why none offloads, instead of exit 2."""
    r = cli("recommend", "llama-3.1-70b", "-H", "h100-sxm-80gb", "--gpus", "1", "--engine", "llamacpp", "--json")
    assert r.exit_code == 0, r.stderr
    assert any("host_memory_bandwidth" in reason for reason in r.json()["rejected"])


def test_an_export_that_implies_the_target_is_named_in_its_refusal(cli, tmp_path):
    r = cli("recommend", "qwen3-30b-a3b", "--gpus", "4", "--workload", "training", "--seq-len", "2048",
            "--global-batch-size", "8", "--export", "torchrun", "-o", tmp_path / "p.yaml")
    _one_line_exit_2(r, "field '--export'", "torchrun launches")


def test_the_search_proposes_only_layouts_the_engine_runs(cli):
    """Without --target, recommend and capacity hold the engine's own layout rules, as estimate does:
    no pipeline stages for TGI, no tp x pp split for llama.cpp."""
    for engine in ("tgi", "llamacpp"):
        out = cli("recommend", "llama-3.1-70b", "-H", "a100-sxm-80gb", "--gpus", "4", "--engine", engine, "--json").json()
        assert out["top"] and all(not (t["plan"]["pp"] > 1 and (engine == "tgi" or t["plan"]["tp"] > 1))
                                  for t in out["top"]), out["top"]
    rows = cli("capacity", "llama-3.1-70b", "-H", "a100-sxm-80gb", "--engine", "tgi", "--request-rate", "5",
               "--json").json()["rows"]
    assert rows and all(r["pp"] == 1 for r in rows)


def test_an_engine_the_limits_rule_out_does_not_answer_for_another(cli):
    """A limit vLLM's layouts miss (but which they hold in memory) is vLLM's answer, exit 3 with the limit that
    would do; another engine is a suggestion, not the answer (that is for models the engine cannot hold)."""
    r = cli("recommend", "llama-3.1-70b", "--gpus", "8", "--max-tpot-ms", "10.8", "--json")
    assert r.exit_code == 3, r.stderr
    changes = [s["change"] for s in r.json()["suggestions"]]
    assert any(c.startswith("--max-tpot-ms") for c in changes), changes


def test_capacity_names_the_engine_whose_budget_it_used(cli):
    out = cli("capacity", "llama-3.1-70b", "-H", "a100-sxm-80gb", "--engine", "tgi", "--engine-version", "3.3.0",
              "--json").json()
    assert out["engine"] == "TGI 3.3.0" and out["gpu_memory_utilization"] == 1.0
    r = cli("capacity", "llama-3.1-70b", "-H", "a100-sxm-80gb", "--engine", "tgi")
    assert "device memory (TGI 3.3." in r.stdout and "(vLLM)" not in r.stdout
