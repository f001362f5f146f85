"""recommend, schema and show through the real CLI: the JSON keys, the ranking, limits and
pins, what happens when nothing fits, the deployment manifest, and bad input (exit 2, one
line, no traceback). Small models and GPU counts keep the whole file quick."""

from __future__ import annotations

import json

import pytest
import yaml

LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "ep", "zero_stage")


def _ok(res):
    assert res.exit_code == 0, (res.exit_code, res.stderr)
    return res.json()


def _does_not_fit(res):
    assert res.exit_code == 3, (res.exit_code, res.stderr)
    return res.json()


def _one_line_error(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.stdout[-500:], res.stderr)
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _assert_ranked(top):
    """Best first by the objective, plans that fit only at the prediction (tight) after those that
    fit at the error band's edge (each group in order); the plans tied with the first (within the
    model's error band of it) lead, ordered by the secondary key instead."""
    ties = [t["tie"] for t in top]
    assert ties == sorted(ties, reverse=True)  # the ties first
    for tight in (False, True):
        values = [t["objective_value"] for t in top if not t["tie"]
                  and ((t.get("fit_at_band_edge") or {}).get("verdict") == "tight") is tight]
        assert values == sorted(values)
    verdicts = [(t.get("fit_at_band_edge") or {}).get("verdict") == "tight" for t in top]
    assert verdicts == sorted(verdicts)
    assert [t["rank"] for t in top] == list(range(1, len(top) + 1))


def _assert_counts_add_up(d):
    # Every evaluated layout is either rejected (with a reason) or feasible.
    assert sum(d["rejected"].values()) + d["num_feasible"] == d["num_evaluated"]
    assert d["num_evaluated"] <= d["num_candidates"]
    assert d["num_feasible"] >= len(d["top"])


def _changes(d):
    return [s["change"] for s in d["suggestions"]]


# ----- ranking and the frontier ------------------------------------------------------------


def test_one_gpu_serving_ranks_by_throughput_and_reports_a_pareto_frontier(cli):
    d = _ok(cli("recommend", "llama-3.1-8b", "--objective", "throughput", "--gpus", "1", "--expand", "--json"))
    assert (d["model"], d["hardware"], d["workload"], d["objective"]) == (
        "llama-3.1-8b", "h100-sxm-80gb", "inference", "throughput")
    assert d["gpu_counts"] == [1] and d["smallest_num_gpus"] == 1
    top = d["top"]
    assert 1 <= len(top) <= 5
    assert top[0]["plan"]["tp"] == 1 and top[0]["plan"]["pp"] == 1 and top[0]["plan"]["replicas"] == 1
    assert all(t["num_gpus"] == 1 for t in top)
    _assert_ranked(top)
    # Throughput is stored negated so that lower is better.
    for t in top:
        assert t["objective_value"] == pytest.approx(-t["time"]["throughput_tokens_per_second"], rel=1e-12)
        assert t["objective_value"] < 0
        assert t["memory"]["headroom_bytes"] >= 0
        assert t["time"]["batch_fits_kv_cache"]
        assert t["plan"]["batch_size"] == t["time"]["batch_size"] <= t["time"]["max_batch_in_kv_cache"]
    assert d["num_evaluated"] == d["num_candidates"]
    _assert_counts_add_up(d)
    assert d["runner_up_gap_fraction"] == pytest.approx(
        (top[1]["objective_value"] - top[0]["objective_value"]) / abs(top[0]["objective_value"]), rel=1e-9)
    assert d["runner_up_gap_fraction"] >= 0
    assert d["suggestions"] == [] and d["manifest"] is None and d["compare"] is None

    pareto = d["pareto"]
    assert pareto
    lat = [p["e2e_latency_seconds"] for p in pareto]
    thr = [p["throughput_tokens_per_second_per_gpu"] for p in pareto]
    assert lat == sorted(lat)
    assert all(b > a for a, b in zip(thr, thr[1:])), thr
    # The throughput winner is on the frontier (nothing has more throughput per GPU).
    assert max(thr) == pytest.approx(top[0]["time"]["throughput_tokens_per_second"] / top[0]["num_gpus"], rel=1e-9)


GPU_ONLY = ("--quantization", "none", "--no-allow-offload")  # no fallback to smaller formats or host memory


def test_nothing_fits_405b_on_one_node_suggests_two_nodes(cli):
    d = _does_not_fit(cli("recommend", "llama-3.1-405b", "--objective", "throughput", *GPU_ONLY, "--json"))
    assert d["top"] == [] and d["pareto"] == []
    assert d["gpu_counts"] == [8]
    assert d["num_feasible"] == 0 and d["smallest_num_gpus"] is None
    assert d["binding_constraint"] is None and d["runner_up_gap_fraction"] is None
    assert sum(d["rejected"].values()) == d["num_evaluated"] > 0
    # ~756 GiB of bf16 weights cannot sit in 8 x 80 GB; two nodes can hold them.
    assert "--gpus 16" in _changes(d), d["suggestions"]
    more = next(s for s in d["suggestions"] if s["change"] == "--gpus 16")
    assert more["num_gpus"] == 16
    # The suggestion is real: the same search on 16 GPUs finds a plan.
    d16 = _ok(cli("recommend", "llama-3.1-405b", "--objective", "throughput", "--gpus", "16", "--json"))
    assert d16["top"][0]["num_gpus"] == 16
    assert d16["top"][0]["plan"]["tp"] <= 8  # no cross-node TP unless allowed


def test_one_consumer_gpu_falls_back_to_smaller_formats_and_offload_and_states_the_trade(cli):
    """70B on one 24 GB card: nothing fits at bf16, so the engine's smaller formats and offloaded
    layers are searched; the pick fits, and the suggestions say what more GPUs would give."""
    d = _ok(cli("recommend", "llama-3.1-70b", "-H", "rtx-4090-24gb", "--gpus", "1", "--max-model-len", "8192",
                "--json"))
    top = d["top"]
    assert top and all(t["memory"]["headroom_bytes"] >= 0 for t in top)
    assert all(t["plan"]["offload"]["layers"] > 0 for t in top)  # even int4 (~37 GB) needs host memory
    assert {t["plan"]["quantization"] for t in top} - {"none"}  # smaller formats were searched
    assert all(t["time"]["tpot_seconds"] > 0.1 for t in top)  # transfer-bound decode, said in numbers
    more = next(s for s in d["suggestions"] if s["change"].startswith("--gpus"))
    assert "output tokens/s" in more["detail"]
    # Pinned to the model's format and without offload, the same question has no answer (exit 3).
    _does_not_fit(cli("recommend", "llama-3.1-70b", "-H", "rtx-4090-24gb", "--gpus", "1", "--max-model-len", "8192",
                      *GPU_ONLY, "--json"))


def test_llama_cpp_serves_the_full_context_where_vllm_cannot(cli):
    """At the model's 131,072-token context vLLM cannot hold one sequence's KV (40 GiB) on a 24 GB
    card even with every layer offloaded; llama.cpp keeps offloaded layers' KV in host memory."""
    vllm = _does_not_fit(cli("recommend", "llama-3.1-70b", "--objective", "throughput", "-H", "rtx-4090-24gb", "--gpus", "1",
                             "--engine", "vllm", "--json"))
    engine = next(s for s in vllm["suggestions"] if s["change"] == "--engine llamacpp")
    assert "layers on the CPU" in engine["detail"]
    llama = _ok(cli("recommend", "llama-3.1-70b", "--objective", "throughput", "-H", "rtx-4090-24gb", "--gpus", "1", "--engine", "llamacpp",
                    "--objective", "latency", "--json"))
    best = llama["top"][0]
    assert best["plan"]["offload"]["layers"] > 40 and best["plan"]["quantization"] in (
        "q2_k", "q3_k_m", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "q8_0", "iq4_xs")
    assert best["kv_cache"]["capacity_tokens"] >= 131072


def test_the_consumer_case_without_engine_answers_with_the_engine_that_has_a_plan(cli):
    """The issue's case as a new user types it: 70B on one 24 GB card, no --engine, the default
    goodput objective. vLLM has no plan at the model's 131,072-token context (one sequence's KV is
    40 GiB and vLLM cannot move it off the GPU), so the answer is llama.cpp's plan, fitting, with
    its tokens/s; the first line says so, and what would make vLLM fit stays as suggestions."""
    d = _ok(cli("recommend", "llama-3.1-70b", "-H", "rtx-4090-24gb", "--gpus", "1", "--json"))
    fb = d["engine_fallback"]
    assert fb["used"].startswith("llama.cpp") and fb["asked"].startswith("vLLM") and fb["option"] == "--engine llamacpp"
    assert d["assumptions"].startswith("engine: llama.cpp")
    best = d["top"][0]
    assert best["memory"]["headroom_bytes"] >= 0 and best["kv_cache"]["capacity_tokens"] >= 131072
    assert best["plan"]["offload"]["layers"] > 0
    assert 0 < best["load"]["tpot_seconds"]["p90"] < 1.0 and best["load"]["output_tokens_per_second_per_gpu"] > 0
    # vLLM's own ways to fit are kept and named as vLLM's: a shorter context or more GPUs.
    kept = {s["change"].split()[0] for s in d["suggestions"] if s["detail"].startswith("with vLLM")}
    assert {"--max-model-len", "--gpus"} <= kept, d["suggestions"]
    # With the engine given, the answer stays vLLM's: no plan (exit 3), llama.cpp as a suggestion,
    # and under the default SLA the suggestions are still made (judged without it).
    vllm = _does_not_fit(cli("recommend", "llama-3.1-70b", "-H", "rtx-4090-24gb", "--gpus", "1", "--engine", "vllm", "--json"))
    assert "engine_fallback" not in vllm
    assert {"--engine", "--max-model-len"} <= {s["change"].split()[0] for s in vllm["suggestions"]}


def test_latency_and_throughput_objectives_pick_different_winners(cli):
    lat = _ok(cli("recommend", "llama-3.1-70b", "--gpus", "8", "--objective", "latency", "--json"))
    thr = _ok(cli("recommend", "llama-3.1-70b", "--gpus", "8", "--objective", "throughput", "--json"))
    assert lat["objective"] == "latency" and thr["objective"] == "throughput"
    _assert_ranked(lat["top"])
    _assert_ranked(thr["top"])
    for t in lat["top"]:
        assert t["objective_value"] == pytest.approx(t["time"]["e2e_latency_seconds"], rel=1e-12)
    lw, tw = lat["top"][0], thr["top"][0]
    assert lw["time"]["e2e_latency_seconds"] <= tw["time"]["e2e_latency_seconds"]
    assert tw["time"]["throughput_tokens_per_second"] >= lw["time"]["throughput_tokens_per_second"]
    # Same search space either way; only the order differs.
    assert lat["num_feasible"] == thr["num_feasible"]
    assert "request latency" in lat["why"] and "throughput" in thr["why"]


# ----- limits and pins ---------------------------------------------------------------------


def test_max_tpot_limit_filters_and_is_reported(cli):
    free = _ok(cli("recommend", "llama-3.1-8b", "--objective", "throughput", "--gpus", "1", "--json"))
    tpots = sorted({p["tpot_seconds"] for p in free["pareto"]} | {t["time"]["tpot_seconds"] for t in free["top"]})
    assert len(tpots) >= 2
    limit_s = (tpots[-2] + tpots[-1]) / 2  # between two observed values: the slowest is ruled out
    assert free["top"][0]["time"]["tpot_seconds"] > limit_s  # so the limit changes the winner

    d = _ok(cli("recommend", "llama-3.1-8b", "--objective", "throughput", "--gpus", "1", "--max-tpot-ms", repr(limit_s * 1e3), "--json"))
    assert d["top"]
    for t in d["top"]:
        assert t["time"]["tpot_seconds"] <= limit_s
    for p in d["pareto"]:
        assert p["tpot_seconds"] <= limit_s
    tpot_keys = [k for k in d["rejected"] if "TPOT" in k]
    assert tpot_keys and d["rejected"][tpot_keys[0]] >= 1
    _assert_counts_add_up(d)
    assert d["num_feasible"] < free["num_feasible"]
    # The binding constraint is the smallest slack, so no larger than the TPOT slack.
    w = d["top"][0]
    assert d["binding_constraint"]["slack_fraction"] <= 1 - w["time"]["tpot_seconds"] / limit_s + 1e-12


def test_impossible_min_throughput_does_not_fit(cli):
    d = _does_not_fit(cli("recommend", "llama-3.1-8b", "--gpus", "1", "--min-throughput", "1e9", "--json"))
    assert d["top"] == [] and d["num_feasible"] == 0
    assert any("throughput" in k for k in d["rejected"]), d["rejected"]
    assert sum(d["rejected"].values()) == d["num_evaluated"]


def test_pinned_tp_is_kept(cli):
    d = _ok(cli("recommend", "llama-3.1-70b", "--gpus", "8", "--tp", "4", "--json"))
    assert d["top"]
    for t in d["top"]:
        p = t["plan"]
        assert p["tp"] == 4
        assert p["tp"] * p["pp"] * p["cp"] * p["dp"] == 8
    assert all(p["tp"] == 4 for p in d["pareto"])


def test_training_pins_zero_stage_and_ranks_by_step_time(cli):
    d = _ok(cli("recommend", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--zero-stage", "3",
                "--seq-len", "2048", "--global-batch-size", "64", "--json"))
    assert (d["workload"], d["objective"]) == ("training", "step-time")
    top = d["top"]
    assert top
    # ranked by step time, plans that fit at the peak-memory band's edge before the tight ones
    ranking = [(t["fit_at_band_edge"]["verdict"] == "tight", t["time"]["step_seconds"]) for t in top]
    assert ranking == sorted(ranking)
    for t in top:
        assert t["plan"]["zero_stage"] == 3
        assert t["objective_value"] == pytest.approx(t["time"]["step_seconds"], rel=1e-12)
        assert t["memory"]["headroom_bytes"] >= 0
        # tokens/s over all GPUs is one global batch of tokens per step.
        assert t["time"]["tokens_per_second"] == pytest.approx(64 * 2048 / t["time"]["step_seconds"], rel=1e-9)
    assert d["pareto"] == []  # the latency/throughput frontier is a serving thing
    _assert_counts_add_up(d)


def test_allow_quantization_makes_70b_fit_on_one_gpu(cli):
    args = ("recommend", "llama-3.1-70b", "--gpus", "1", "--max-model-len", "4096")
    no = _does_not_fit(cli(*args, "--no-allow-offload", "--quantization", "none", "--json"))
    assert no["top"] == []
    assert any(c.startswith("--allow-quantization") for c in _changes(no)), no["suggestions"]

    yes = _ok(cli(*args, "--allow-quantization", "fp8,int8,int4", "--json"))
    assert yes["top"][0]["plan"]["quantization"] != "none"
    # 140 GB of bf16 weights cannot fit on one 80 GB GPU, so every plan is quantized.
    assert all(t["plan"]["quantization"] in ("fp8", "int8", "int4") for t in yes["top"])
    assert all(p["quantization"] != "none" for p in yes["pareto"])
    assert all(t["memory"]["headroom_bytes"] >= 0 for t in yes["top"])


def test_max_gpus_reports_the_smallest_count_that_fits(cli):
    args = ("recommend", "llama-3.1-70b", "--max-model-len", "8192")
    d = _ok(cli(*args, "--max-gpus", "16", "--json"))
    assert d["gpu_counts"] == [1, 2, 4, 8, 16]
    smallest = d["smallest_num_gpus"]
    assert smallest in d["gpu_counts"]
    assert all(t["num_gpus"] >= smallest for t in d["top"])
    # Cross-check with single-count searches: the smallest N that exits 0.
    first_ok = None
    for n in d["gpu_counts"]:
        # --max-gpus counts what fits on the GPUs at the model's format; a fixed count falls back to
        # smaller formats and host memory when nothing does, so compare like with like.
        res = cli(*args, "--gpus", str(n), "--no-allow-offload", "--quantization", "none", "--json")
        assert res.exit_code in (0, 3), (n, res.exit_code, res.stderr)
        if res.exit_code == 0:
            first_ok = n
            assert res.json()["smallest_num_gpus"] == n
            break
        assert res.json()["top"] == []
    assert first_ok == smallest
    # bf16 70B (~141 GB of weights) cannot fit on one 80 GB GPU.
    assert smallest > 1


# ----- the manifest ------------------------------------------------------------------------


def test_manifest_is_written_deterministically_and_shown(cli, tmp_path):
    a, b = tmp_path / "plan.yaml", tmp_path / "again.yaml"
    d = _ok(cli("recommend", "llama-3.1-8b", "--objective", "throughput", "--gpus", "2", "-o", str(a), "--json"))
    assert d["manifest"] == str(a)
    assert a.is_file()
    d2 = _ok(cli("recommend", "llama-3.1-8b", "--objective", "throughput", "--gpus", "2", "-o", str(b), "--json"))
    assert d2["manifest"] == str(b)
    assert a.read_bytes() == b.read_bytes()

    s = _ok(cli("show", str(a), "--json"))
    plan = d["top"][0]["plan"]
    for k in ("tp", "pp", "dp", "cp", "ep"):
        assert s["layout"][k] == plan[k], k
    assert s["schema_version"] == 1
    assert s["model"]["name"] == "llama-3.1-8b"
    assert s["hardware"]["num_gpus"] == 2
    assert s["objective"] == "throughput"
    assert s["workload"]["batch_size"] == plan["batch_size"]
    assert s["predicted"]["fits"] is True
    assert s["predicted"]["memory"]["headroom_bytes"] == pytest.approx(d["top"][0]["memory"]["headroom_bytes"], rel=1e-12)
    assert s["predicted"]["time"]["tpot_seconds"] == pytest.approx(d["top"][0]["time"]["tpot_seconds"], rel=1e-12)
    assert s["search"]["num_evaluated"] == d["num_evaluated"]

    text = cli("show", str(a))
    assert text.exit_code == 0, text.stderr
    assert "llama-3.1-8b" in text.stdout


def test_training_manifest_places_every_mixtral_layer_once(cli, tmp_path):
    path = tmp_path / "train.yaml"
    d = _ok(cli("recommend", "mixtral-8x7b", "--workload", "training", "--gpus", "16", "--seq-len", "2048",
                "--global-batch-size", "64", "-o", str(path), "--json"))
    s = _ok(cli("show", str(path), "--json"))
    plan = d["top"][0]["plan"]
    for k in LAYOUT_KEYS + ("virtual_stages", "micro_batch_size"):
        assert s["layout"][k] == plan[k], k
    assert s["workload"]["kind"] == "training"
    stages = s["placement"]["stages"]
    assert len(stages) == plan["pp"]
    layers = []
    for st in stages:
        for lo, hi in st["layer_ranges"]:
            assert lo <= hi
            layers.extend(range(lo, hi + 1))
    assert sorted(layers) == list(range(32))  # every layer, none twice
    assert s["model"]["num_layers"] == 32
    assert stages[0]["embedding"] and stages[-1]["lm_head"]
    mesh = {m["axis"]: m["size"] for m in s["placement"]["mesh_shape"]}
    assert mesh["tp"] * mesh["pp"] * mesh["cp"] * mesh["dp"] == 16


def test_schema_lists_the_manifest_sections(cli):
    res = cli("schema")
    assert res.exit_code == 0, res.stderr
    schema = json.loads(res.stdout)
    for key in ("schema_version", "placement", "predicted"):
        assert key in schema["properties"], key
    assert "schema_version" in schema["required"]


# ----- bad input ---------------------------------------------------------------------------


@pytest.fixture
def manifest_data(cli, tmp_path):
    path = tmp_path / "plan.yaml"
    _ok(cli("recommend", "llama-3.1-8b", "--gpus", "2", "--objective", "throughput", "-o", str(path), "--json"))
    return yaml.safe_load(path.read_text())


def _write(tmp_path, data, name):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def test_show_refuses_a_newer_schema(cli, tmp_path, manifest_data):
    manifest_data["schema_version"] = 99
    p = _write(tmp_path, manifest_data, "v99.yaml")
    _one_line_error(cli("show", str(p), "--json"), "newer", str(p))


def test_show_refuses_an_impossible_layout(cli, tmp_path, manifest_data):
    assert manifest_data["layout"]["tp"] * manifest_data["layout"]["dp"] == 2
    manifest_data["layout"]["tp"] = 3
    p = _write(tmp_path, manifest_data, "tp3.yaml")
    _one_line_error(cli("show", str(p), "--json"), "tp", str(p))
    _one_line_error(cli("show", str(p)), "tp")


@pytest.mark.parametrize(
    "args, needle",
    [
        (("llama-3.1-8b", "--objective", "step-time"), "--objective"),
        (("llama-3.1-8b", "--workload", "training", "--objective", "latency"), "--objective"),
        (("llama-3.1-8b", "--gpus", "4", "--max-gpus", "8"), "--max-gpus"),
        (("llama-3.1-8b", "--gpus", "1", "--allow-quantization", "fp9"), "--allow-quantization"),
        (("llama-3.1-8b", "--gpus", "1", "--compare", "tp=banana"), "--compare"),
        (("llama-3.1-8b", "--gpus", "1", "--compare", "banana"), "--compare"),
    ],
)
def test_recommend_bad_input(cli, args, needle):
    _one_line_error(cli("recommend", *args, "--json"), needle)


# ----- comparing with a named layout -------------------------------------------------------


def test_compare_with_a_named_layout(cli):
    d = _ok(cli("recommend", "llama-3.1-70b", "--gpus", "8", "--compare", "tp=8", "--json"))
    c = d["compare"]
    assert c["plan"]["tp"] == 8 and c["plan"]["dp"] == 1 and c["plan"]["pp"] == 1
    assert isinstance(c["fits"], bool)
    w = d["top"][0]
    assert c["gap_fraction"] == pytest.approx(
        (c["objective_value"] - w["objective_value"]) / abs(w["objective_value"]), rel=1e-9)
    # tp=8 holds 70B bf16 on one node; the winner is at least as good as any layout that fits.
    assert c["fits"] is True
    assert c["gap_fraction"] >= -1e-9
    assert c["memory"]["headroom_bytes"] >= 0
    # The compared layout is no better than the best plan of a search pinned to tp=8.
    pinned = _ok(cli("recommend", "llama-3.1-70b", "--gpus", "8", "--tp", "8", "--json"))
    assert pinned["top"][0]["objective_value"] <= c["objective_value"] + 1e-9 * abs(c["objective_value"])
    assert pinned["top"][0]["objective_value"] >= w["objective_value"]
    for diff in c["differences"]:
        assert diff["delta_seconds"] == pytest.approx(diff["seconds_b"] - diff["seconds_a"], rel=1e-9, abs=1e-15)


# ----- training on two nodes ---------------------------------------------------------------


def test_training_on_two_nodes_explains_its_choice(cli):
    d = _ok(cli("recommend", "llama-3.1-8b", "--workload", "training", "--gpus", "16", "--seq-len", "4096",
                "--global-batch-size", "128", "--json"))
    top = d["top"]
    w = top[0]
    p = w["plan"]
    assert p["tp"] * p["pp"] * p["cp"] * p["dp"] == 16
    assert w["num_gpus"] == 16 and w["num_nodes"] == 2
    assert p["tp"] <= 8  # no cross-node TP by default
    assert isinstance(d["why"], str) and d["why"]
    assert "step time" in d["why"]
    b = d["binding_constraint"]
    assert b["constraint"] == "memory"
    mem = w["memory"]
    assert b["slack_fraction"] == pytest.approx(
        mem["headroom_bytes"] / (mem["per_gpu_bytes"]["total"] + mem["headroom_bytes"]), rel=1e-9)
    assert 0 <= b["slack_fraction"] <= 1
    # The runner-up is behind, or faster but fitting only at the prediction (tight plans rank last).
    assert d["runner_up_gap_fraction"] >= 0 or (top[1]["fit_at_band_edge"]["verdict"] == "tight"
                                                 and top[0]["fit_at_band_edge"]["verdict"] != "tight")
    assert d["runner_up_gap_fraction"] == pytest.approx(
        (top[1]["objective_value"] - w["objective_value"]) / abs(w["objective_value"]), rel=1e-9)
    _assert_ranked(top)
    _assert_counts_add_up(d)


def test_two_consumer_gpus_compare_tensor_split_with_one_gpu_offloaded(cli):
    """--gpus 2: the pick splits the model over both cards; the alternative says what one card
    would do by offloading, each with its speed (the trade, stated)."""
    d = _ok(cli("recommend", "llama-3.1-70b", "--objective", "throughput", "-H", "rtx-4090-24gb", "--gpus", "2", "--max-model-len", "8192",
                "--json"))
    pick = d["top"][0]
    assert pick["num_gpus"] == 2 and pick["plan"]["offload"]["layers"] == 0
    one = next(s for s in d["suggestions"] if s["change"] == "--gpus 1")
    assert "layers in host memory" in one["detail"] and "output tokens/s" in one["detail"]
    # the split is the faster way, by far: the offloaded card streams its layers every token
    tpot_ms = float(one["detail"].split("TPOT ")[1].split(" ms")[0].replace(",", ""))
    assert tpot_ms > 10 * pick["time"]["tpot_seconds"] * 1e3
