"""`shardplan validate`: the shipped corpus through the cost model, and a user's own cases.

The figures are checked against an independent recomputation: three published runs (a vLLM
start-up log, a torchtitan training row, a LoRA row) written as a user's case file, each also
predicted here by calling `estimate` with the layout and workload built by hand, and the group
statistics recomputed from those errors."""

from __future__ import annotations

import math
import statistics

import pytest
import yaml
from conftest import REPO

from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import inference_workload, training_workload
from shardplan.cost.layout import Layout, Recompute
from shardplan.knowledge.load import engine_rules, stack_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model
from shardplan.units import BYTES_PER_GIB
from shardplan.validation.shipped import CORPUS_DIR
from shardplan.validation.stats import nearest_rank

# shardplan/validation/corpus/engine_logs/index.yaml, vllm_v1_a100-80gbx1_qwen2_7b_16k_util050 (dennislee22/vLLM-benchmarking log)
VLLM = dict(kind="engine_log", id="qwen2-7b-a100-util050", source="https://github.com/dennislee22/vLLM-benchmarking",
            model="models/qwen2-7b-instruct.yaml", hardware="a100-sxm-80gb", gpus=1, tp=1, engine="vllm",
            engine_version="0.10.1.1", flags=dict(max_model_len=16384, gpu_memory_utilization=0.5),
            kv_cache_tokens=464848, started=True)
# training_stacks/torchtitan.yaml, tt_2412_t1_8b_fsdp8_eager (torchtitan docs/performance.md, Dec 2024)
TITAN = dict(kind="training", id="titan-8b-fsdp8", source="torchtitan docs/performance.md", stack="torchtitan",
             model="llama-3.1-8b", hardware="h100-sxm-94gb-hbm2e", gpus=8, dp=8, zero_stage=3, micro_batch=2,
             seq_len=8192, global_batch=16, recompute="selective", flash_attention=True, compile_loss=False,
             measured=dict(peak_memory_gib=82.4, memory_counter="reserved", tokens_per_second_per_gpu=5762))
# finetune/lora_memory.yaml, fms_mistral7b_lora_r16_bs4_a100_80g (fms-acceleration A100 table)
LORA = dict(kind="finetune", id="mistral-lora", source="foundation-model-stack/fms-acceleration", stack="hf",
            model="mistral-7b", hardware="a100-sxm-80gb", gpus=1, finetune="lora", micro_batch=4, global_batch=4,
            seq_len=4096, recompute="full", lora_rank=16, lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"],
            lora_dropout=0.1, double_quant=False, counter="allocated", measured_bytes=26704571904)


def _by_hand() -> dict[str, float]:
    """The three errors, predicted without shardplan.validation."""
    errors = {}
    spec = load_model(str(CORPUS_DIR / "models" / "qwen2-7b-instruct.yaml")).spec
    hw = cluster(load_hardware("a100-sxm-80gb"), gpus=1, nodes=None, gpus_per_node=None)
    wl = inference_workload(max_model_len=16384, max_num_seqs=None, max_num_batched_tokens=None,
                            gpu_memory_utilization=0.5, block_size=None, kv_cache_dtype=None, weight_dtype=None,
                            quantization=None, enforce_eager=False, input_len=1024, output_len=128, batch_size=None,
                            engine=engine_rules("vllm", "0.10.1.1"), hw=hw, model_max_len=spec.max_position_embeddings,
                            enable_chunked_prefill=None)
    errors["kv"] = estimate(spec, hw, Layout(), wl).kv_cache.capacity_tokens / 464848 - 1

    spec = load_model("llama-3.1-8b").spec
    hw = cluster(load_hardware("h100-sxm-94gb-hbm2e"), gpus=8, nodes=None, gpus_per_node=None)
    rep = estimate(spec, hw, Layout(dp=8, zero_stage=3, micro_batch_size=2, recompute=Recompute.SELECTIVE),
                   training_workload(seq_len=8192, global_batch_size=16, optimizer="adamw", framework=None,
                                     flash_attention=True, dropout=False, stack=stack_rules("torchtitan"),
                                     compile_loss=False))
    errors["titan_mem"] = max(r.reserved_bytes for r in rep.memory.per_rank) / (82.4 * BYTES_PER_GIB) - 1
    errors["titan_tps"] = rep.time.tokens_per_second_per_gpu / 5762 - 1

    spec = load_model("mistral-7b").spec
    hw = cluster(load_hardware("a100-sxm-80gb"), gpus=1, nodes=None, gpus_per_node=None)
    rep = estimate(spec, hw, Layout(micro_batch_size=4, recompute=Recompute.FULL),
                   training_workload(seq_len=4096, global_batch_size=4, optimizer="adamw", framework=None,
                                     flash_attention=None, dropout=False, stack=stack_rules("hf"), finetune="lora",
                                     lora_rank=16, lora_targets="q_proj,k_proj,v_proj,o_proj", lora_dropout=0.1,
                                     qlora_double_quant=False, spec=spec))
    rank = rep.memory.per_rank[0]
    outside = sum(rank.detail_bytes.get(k, 0.0) for k in ("overhead.cuda_context", "overhead.non_torch",
                                                          "overhead.nccl_buffers"))
    errors["lora"] = (rank.per_gpu_bytes["total"] - outside) / 26704571904 - 1
    return errors


@pytest.fixture
def case_file(tmp_path):
    # A user's file names models relative to itself: copy the one config the log's model needs.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "qwen2-7b-instruct.yaml").write_bytes((CORPUS_DIR / "models" / "qwen2-7b-instruct.yaml").read_bytes())
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump({"cases": [VLLM, TITAN, LORA]}))
    return path


def test_user_cases_match_an_independent_recomputation(cli, case_file):
    r = cli("validate", "--cases", case_file, "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    want = _by_hand()
    got = {(c["case_id"], c["quantity"]): c["error"] for c in out["cases"]}
    assert got[("qwen2-7b-a100-util050", "kv_capacity")] == pytest.approx(want["kv"], abs=1e-12)
    assert got[("titan-8b-fsdp8", "peak_memory")] == pytest.approx(want["titan_mem"], abs=1e-12)
    assert got[("titan-8b-fsdp8", "tokens_per_second")] == pytest.approx(want["titan_tps"], abs=1e-12)
    assert got[("mistral-lora", "peak_memory")] == pytest.approx(want["lora"], abs=1e-12)
    assert got[("qwen2-7b-a100-util050", "start_verdict")] == 0.0  # it started, as predicted
    groups = {(g["group"], g["quantity"]): g for g in out["groups"]}
    titan = groups[("torchtitan", "peak_memory")]
    assert titan["num_cases"] == 1 and titan["band_abs_error"] == pytest.approx(abs(want["titan_mem"]))
    assert groups[("vLLM V1", "kv_capacity")]["versions"] == ["0.10.1.1"]
    assert groups[("hf lora", "peak_memory")]["worst_case_id"] == "mistral-lora"
    assert out["num_cases"] == 3 and out["corpus"] == str(case_file)


def test_statistics_over_a_group_are_recomputed_by_hand():
    errors = [0.02, -0.05, 0.10, 0.01, -0.30, 0.04, 0.0, 0.08, -0.03, 0.06, 0.2]
    absolute = sorted(abs(e) for e in errors)
    assert nearest_rank(absolute, 90) == absolute[math.ceil(0.9 * len(absolute)) - 1] == 0.2
    assert nearest_rank([0.5, 0.1], 90) == 0.5  # fewer than ten cases: the largest
    from shardplan.validation.predict import Comparison
    from shardplan.validation.stats import group_stats

    cs = [Comparison(case_id=f"c{i}", source="s", kind="training", group="g", version=None, quantity="peak_memory",
                     measured=100.0, predicted=100.0 * (1 + e)) for i, e in enumerate(errors)]
    (g,) = group_stats(cs)
    assert g.mean_abs_error == pytest.approx(statistics.fmean(absolute))
    assert g.median_abs_error == pytest.approx(statistics.median(absolute))
    assert g.mean_signed_error == pytest.approx(statistics.fmean(errors))
    assert g.worst.case_id == "c4" and g.max_abs_error == pytest.approx(0.3)


def test_shipped_corpus_table_covers_engines_and_stacks(cli):
    r = cli("validate", "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    groups = {(g["group"], g["quantity"]): g for g in out["groups"]}
    # The engine issue's golden set: vLLM V1 KV capacity over at least 10 logs, median within 5%.
    v1 = groups[("vLLM V1", "kv_capacity")]
    assert v1["num_cases"] >= 10 and v1["median_abs_error"] < 0.05
    for stack in ("megatron", "torchtitan", "deepspeed", "hf"):
        assert groups[(stack, "tokens_per_second")]["num_cases"] >= 6, stack
    # Every verdict of the shipped start-up logs is the engine's.
    assert all(g["mean_abs_error"] == 0 for g in out["groups"] if g["quantity"] == "start_verdict")
    assert all(g["worst_source"] for g in out["groups"])
    assert out["skipped"] and all(s["reason"] for s in out["skipped"])


def test_filters_and_the_table(cli):
    r = cli("validate", "--engine", "sglang")
    assert r.exit_code == 0, r.stderr
    assert "SGLang" in r.stdout and "torchtitan" not in r.stdout and "p90 (band)" in r.stdout
    r = cli("validate", "--stack", "hf", "--json")
    assert {g["group"] for g in r.json()["groups"]} == {"hf", "hf lora", "hf qlora"}


def test_a_filtered_run_lists_only_its_own_rows_left_out(cli):
    """--engine/--stack name the rows of that engine or stack left out, not the whole corpus's."""
    left = {}
    for flag, name in (("--engine", "sglang"), ("--engine", "vllm"), ("--stack", "hf"), (None, None)):
        r = cli("validate", *((flag, name) if flag else ()), "--json")
        assert r.exit_code == 0, r.stderr
        left[name] = {s["case_id"] for s in r.json()["skipped"]}
    # rows whose ids the corpus files give them (a vLLM log without its GPU, SGLang's unsuitable runs, an HF OOM row)
    assert "vllm_v1_kvfp8_100k_started" in left["vllm"] and "vllm_v1_kvfp8_100k_started" not in left["sglang"]
    assert "gpustack-qwen3-8b-h100-latency-sglang-03" in left["sglang"] - left["vllm"]
    assert "hf_liger_llama3_8b_a100x4_fsdp_bs64_oom" in left["hf"] - left["sglang"] - left["vllm"]
    assert not left["sglang"] & left["vllm"]
    assert left["sglang"] | left["vllm"] | left["hf"] < left[None]


@pytest.mark.parametrize("body,words", [
    ({"cases": [{k: v for k, v in TITAN.items() if k != "seq_len"}]}, "seq_len"),
    ({"cases": [{**TITAN, "measured": {"peak_memory_gb": 80}}]}, "peak_memory_gb"),
    ({"cases": [{**LORA, "kind": "inference"}]}, "kind"),
    ({"cases": [{**VLLM, "kv_cache_tokens": "lots"}]}, "kv_cache_tokens"),
    ({"cases": []}, "cases"),
    ({"cases": [VLLM, VLLM]}, "twice"),
    ([VLLM], "a mapping with a `cases:` list"),  # the list without its key
])
def test_bad_case_files_are_one_line_exit_2(cli, tmp_path, body, words):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(body))
    r = cli("validate", "--cases", path)
    assert r.exit_code == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(path) in lines[0] and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_nan_and_a_case_the_model_refuses_are_one_line(cli, tmp_path):
    path = tmp_path / "nan.json"
    path.write_text('{"cases": [{"kind": "training", "id": "x", "source": "s", "stack": "hf", "model": "llama-3.1-8b",'
                    ' "hardware": "h100-sxm-80gb", "gpus": 1, "micro_batch": 1, "seq_len": 1024,'
                    ' "measured": {"peak_memory_gib": NaN}}]}')
    r = cli("validate", "--cases", path)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "nan.json" in r.stderr
    path = tmp_path / "unknown.yaml"
    path.write_text(yaml.safe_dump({"cases": [{**TITAN, "model": "no-such-model"}]}))
    r = cli("validate", "--cases", path)
    assert r.exit_code == 2 and "titan-8b-fsdp8" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_shipped_corpus_lives_in_the_package():
    """`pip install .` ships the cases: they sit inside the package, not only in tests/."""
    assert CORPUS_DIR.is_relative_to(REPO / "shardplan")
    assert (CORPUS_DIR / "engine_logs" / "index.yaml").is_file()


# Serving benchmark runs (shardplan/validation/corpus/serving_load): the SGLang cookbook's Llama 3.1 70B
# on 8 A100s at 64 clients (sgl-cookbook-llama3.1-05, its result block in sglang_cookbook.yaml) and
# GPUStack's Qwen3-14B on one H100, 1000 ShareGPT requests at once (gpustack-qwen3-14b-h100-vllm-00).
COOKBOOK = dict(kind="serving_load", id="llama70b-a100-c64", source="https://github.com/sgl-project/sgl-cookbook "
                "(docs/autoregressive/Llama/Llama3.1.md#L567)", model="llama-3.1-70b", hardware="a100-sxm-80gb",
                gpus=8, engine="sglang", engine_version="0.5.6", tp=8, client="sglang", dataset="random", input_len=8000,
                output_len=1000, num_requests=320, total_input_tokens=1273893, total_output_tokens=170000,
                max_concurrency=64, measured=dict(median_ttft_ms=616.38, median_tpot_ms=82.85, median_itl_ms=34.12,
                                                  output_tokens_per_second=788.27))
BURST = dict(kind="serving_load", id="qwen3-14b-h100-burst", source="https://github.com/gpustack/gpustack "
             "(docs/performance-lab/qwen3-14b/h100.md#L89)", model="models/qwen3-14b.json", hardware="h100-sxm-80gb",
             gpus=1, engine="vllm", engine_version="0.11.0", dataset="sharegpt", num_requests=1000,
             total_input_tokens=217393, total_output_tokens=201648,
             measured=dict(median_ttft_ms=21872.31, median_tpot_ms=117.46, output_tokens_per_second=3173.92))


def _scaled(lengths, total):
    s = sum(lengths)
    return [max(1, round(x * total / s)) for x in lengths]


def _serving_by_hand(model, hw_name, tp, engine, version, requests, conc):
    """One replica under the run's traffic, built here without shardplan.validation."""
    from shardplan.cost.memory_serving import serving_memory
    from shardplan.cost.serving_load import Traffic, serve_traffic

    spec = load_model(model).spec
    hw = load_hardware(hw_name)
    wl = inference_workload(max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None,
                            gpu_memory_utilization=None, block_size=None, kv_cache_dtype=None, weight_dtype=None,
                            quantization=None, enforce_eager=False, input_len=1024, output_len=128, batch_size=None,
                            engine=engine_rules(engine, version), hw=hw, model_max_len=spec.max_position_embeddings,
                            checkpoint_format=spec.expert_dtype)
    layout = Layout(tp=tp)
    kv = serving_memory(spec, hw, layout, wl).kv_account
    return serve_traffic(spec, hw, layout, wl, Traffic(requests=requests, max_concurrency=conc), kv=kv, itl=True)


def test_user_serving_runs_match_an_independent_recomputation(cli, tmp_path):
    import random

    from shardplan.specs.lengths import load_lengths

    (tmp_path / "models").mkdir()
    src = CORPUS_DIR / "serving_load" / "models" / "qwen3-14b.json"
    (tmp_path / "models" / "qwen3-14b.json").write_bytes(src.read_bytes())
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"cases": [COOKBOOK, BURST]}))
    r = cli("validate", "--cases", path, "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    got = {(c["case_id"], c["quantity"]): c for c in out["cases"]}

    rng = random.Random(0)  # SGLang's bench_serving random dataset: U[1, len] for prompts and outputs
    ins = [rng.randint(1, 8000) for _ in range(320)]
    outs = [rng.randint(1, 1000) for _ in range(320)]
    reqs = tuple(zip(_scaled(ins, 1273893), _scaled(outs, 170000)))
    want = _serving_by_hand("llama-3.1-70b", "a100-sxm-80gb", 8, "sglang", "0.5.6", reqs, 64)
    assert got[("llama70b-a100-c64", "ttft_p50")]["predicted"] == pytest.approx(want.ttft_seconds.p50, rel=1e-12)
    assert got[("llama70b-a100-c64", "ttft_p50")]["measured"] == pytest.approx(0.61638)
    assert got[("llama70b-a100-c64", "tpot_p50")]["error"] == pytest.approx(
        want.tpot_seconds.p50 / 0.08285 - 1, abs=1e-12)
    assert got[("llama70b-a100-c64", "output_tokens_per_second")]["error"] == pytest.approx(
        want.output_tokens_per_second / 788.27 - 1, abs=1e-12)
    assert got[("llama70b-a100-c64", "itl_p50")]["predicted"] == pytest.approx(want.itl_seconds.p50, rel=1e-12)
    assert ("qwen3-14b-h100-burst", "itl_p50") not in got  # its block's median ITL is not in the case
    # 64 clients, every one running at once: below saturation
    assert want.peak_running == 64
    assert got[("llama70b-a100-c64", "ttft_p50")]["group"] == "SGLang, below saturation"

    pairs = load_lengths("sharegpt").sample(1000, 0)
    reqs = tuple(zip(_scaled([p for p, _ in pairs], 217393), _scaled([o for _, o in pairs], 201648)))
    want = _serving_by_hand(str(src), "h100-sxm-80gb", 1, "vllm", "0.11.0", reqs, None)
    burst = got[("qwen3-14b-h100-burst", "output_tokens_per_second")]
    assert burst["predicted"] == pytest.approx(want.output_tokens_per_second, rel=1e-12)
    assert burst["group"] == "vLLM V1, saturated" and burst["unit"] == "tokens_per_second"
    assert got[("qwen3-14b-h100-burst", "ttft_p50")]["unit"] == "seconds"
    groups = {(g["group"], g["quantity"]): g for g in out["groups"]}
    assert groups[("vLLM V1, saturated", "tpot_p50")]["versions"] == ["0.11.0"]


def test_shipped_serving_runs_are_judged_by_engine_and_regime(cli):
    r = cli("validate", "--engine", "sglang", "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    groups = {(g["group"], g["quantity"]) for g in out["groups"]}
    for regime in ("below saturation", "saturated"):
        for q in ("ttft_p50", "tpot_p50", "output_tokens_per_second"):
            assert (f"SGLang, {regime}", q) in groups
    assert not any(g.startswith("vLLM") for g, _ in groups)
    runs = {c["case_id"] for c in out["cases"] if c["kind"] == "serving_load"}
    assert len(runs) >= 30
    # the runs with a flag the model does not read are listed with the reason, never judged
    reasons = {s["case_id"]: s["reason"] for s in out["skipped"]}
    assert "attention_backend" in reasons["gpustack-qwen3-14b-h100-sglang-05"]
    assert "gpustack-qwen3-14b-h100-sglang-05" not in runs


def test_a_serving_run_without_its_lengths_is_one_line(cli, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"cases": [{k: v for k, v in COOKBOOK.items() if k != "input_len"}]}))
    r = cli("validate", "--cases", path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and str(path) in lines[0] and "input_len" in lines[0], r.stderr


@pytest.mark.parametrize("change,words", [
    ({"num_requests": 1_000_000}, "num_requests"),  # each request is simulated: bounded work
    ({"total_input_tokens": 10**11}, "past max_model_len"),  # prompts the engine would refuse
    ({"measured": {"median_ttft_ms": float("nan"), "output_tokens_per_second": 1.0}}, "median_ttft_ms"),
])
def test_a_hostile_serving_run_is_one_line_exit_2(cli, tmp_path, change, words):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"cases": [{**COOKBOOK, **change}]}))
    r = cli("validate", "--cases", path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and str(path) in lines[0] and words in lines[0], r.stderr


@pytest.mark.parametrize("rate", [20.0, 40.0])
def test_a_finite_rate_run_lands_in_the_regime_an_estimate_gives_its_load(cli, tmp_path, rate):
    """validate sizes a run's saturation burst as an estimate sizes its own (cost.traffic.saturation_rate):
    a burst of the run's 100 requests, which one H100 runs in one go, would put the 8B's saturation
    at hundreds of requests a second and every finite rate below saturation."""
    case = dict(kind="serving_load", id="r", source="constructed", model="llama-3.1-8b", hardware="h100-sxm-80gb",
                gpus=1, engine="vllm", engine_version="0.11.0", dataset="random", input_len=1024, output_len=128,
                num_requests=100, total_input_tokens=102400, total_output_tokens=12800, request_rate_per_second=rate,
                measured=dict(median_ttft_ms=50.0, median_tpot_ms=10.0, output_tokens_per_second=1000.0))
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"cases": [case]}))
    r = cli("validate", "--cases", path, "--json")
    assert r.exit_code == 0, r.stderr
    group = {c["group"] for c in r.json()["cases"]}
    est = cli("estimate", "llama-3.1-8b", "--gpus", "1", "--engine-version", "0.11.0", "--request-rate", repr(rate),
              "--num-prompts", "100", "--input-len", "1024", "--output-len", "128", "--json")
    assert est.exit_code == 0, est.stderr
    saturated = est.json()["load"]["saturated"]
    assert group == {"vLLM V1, saturated" if saturated else "vLLM V1, below saturation"}
    assert saturated is (rate == 40.0)  # the 8B sustains about 30 requests a second on one H100
