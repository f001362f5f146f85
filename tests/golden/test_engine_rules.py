"""Engine rules by version against what vLLM itself printed at start-up.

The logs live in shardplan/validation/corpus/engine_logs/ with their sources (index.yaml). Figures are read
from the log lines here, not copied into the test.
"""

from __future__ import annotations

import re

import pytest
from conftest import REPO

from shardplan.cost.engine import resolve_serving
from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import inference_workload
from shardplan.cost.memory_serving import static_fraction
from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import engine_file, engine_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model
from shardplan.units import BYTES_PER_GIB

LOGS = REPO / "shardplan" / "validation" / "corpus" / "engine_logs"

# vllm issue #10517 (index.yaml): Llama-3.1-8B-Instruct on one RTX 3090, vLLM 0.6.4 (V0), default flags.
RTX3090_V0 = {20000: "vllm_v0_rtx3090_llama31_8b_20k.log", 29000: "vllm_v0_rtx3090_llama31_8b_29k.log",
              35000: "vllm_v0_rtx3090_llama31_8b_35k.log"}


def _log_figures(name: str) -> dict[str, float]:
    text = (LOGS / name).read_text()
    out: dict[str, float] = {}
    for key in ("total_gpu_memory", "peak_torch_memory", "non_torch_memory", "kv_cache_size"):
        m = re.search(rf"{key}=([\d.]+)GiB", text)
        if m:
            out[key] = float(m.group(1))
    m = re.search(r"(?:# )?GPU blocks: (\d+)", text)  # the 20K copy lost its leading "# "
    if m:
        out["num_gpu_blocks"] = int(m.group(1))
    m = re.search(r"Loading model weights took ([\d.]+) GB", text)
    if m:
        out["weights"] = float(m.group(1))
    out["refused"] = "is larger than the maximum number of tokens that can be stored in KV cache" in text
    return out


def _estimate_3090(max_model_len: int, version: str = "0.6.4"):
    loaded = load_model("llama-3.1-8b")
    hw = cluster(load_hardware("rtx-3090-24gb"), gpus=1, nodes=None, gpus_per_node=None)
    wl = inference_workload(
        max_model_len=max_model_len, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None, engine=engine_rules("vllm", version), hw=hw,
        model_max_len=loaded.spec.max_position_embeddings)
    return wl, estimate(loaded.spec, hw, Layout(), wl)


@pytest.mark.parametrize("max_model_len", sorted(RTX3090_V0))
def test_v0_verdict_is_the_engines_and_is_not_monotonic_in_max_model_len(max_model_len):
    """20K starts, 29K is refused, 35K starts again: above 32K V0 turns chunked prefill on and
    profiles 512 tokens instead of max_model_len."""
    log = _log_figures(RTX3090_V0[max_model_len])
    wl, rep = _estimate_3090(max_model_len)
    assert rep.fits is (not log["refused"]), rep.reason
    assert wl.max_num_batched_tokens == (512 if max_model_len > 32768 else max_model_len)
    if log["refused"]:
        assert rep.reason.startswith(f"The model's max seq len ({max_model_len}) is larger than the maximum number of "
                                     "tokens that can be stored in KV cache (")


@pytest.mark.parametrize("max_model_len", [20000, 29000])
def test_v0_profile_pass_peak_and_kv_capacity_against_the_log(max_model_len):
    log = _log_figures(RTX3090_V0[max_model_len])
    _, rep = _estimate_3090(max_model_len)
    stage = rep.memory.per_rank[0]
    # the profiling pass's activation peak: peak_torch_memory minus the weights the log printed
    measured_act = (log["peak_torch_memory"] - log["weights"]) * BYTES_PER_GIB
    assert stage.per_gpu_bytes["activations"] == pytest.approx(measured_act, rel=0.05)
    # KV capacity with the bundled profile: within 5%. It sees the device at 23.70 GiB where this
    # card showed 23.58 (tests/golden/test_engine_logs_golden.py takes the log's total: +0.3%);
    # its CUDA context (0.35 GiB: a fixed part and the stack reserve of 82 SMs) is what 0.6.4 logged.
    kv_tokens = log["num_gpu_blocks"] * 16
    assert rep.kv_cache.capacity_tokens == pytest.approx(kv_tokens, rel=0.05)


def test_v0_before_0_6_5_charges_the_cuda_context_and_later_versions_do_not():
    _, old = _estimate_3090(20000, "0.6.4")
    _, new = _estimate_3090(20000, "0.7.3")
    assert "overhead.cuda_context" in old.memory.per_rank[0].detail_bytes
    assert "overhead.cuda_context" not in new.memory.per_rank[0].detail_bytes
    assert new.memory.per_rank[0].detail_bytes["outside_budget.cuda_context"] > 0
    assert new.kv_cache.capacity_tokens > old.kv_cache.capacity_tokens


@pytest.mark.parametrize(("version", "hardware", "seqs", "tokens"), [
    ("0.6.4", "h100-sxm-80gb", 256, 512),    # V0, 35K context: chunked prefill on with its 512-token budget
    ("0.7.3", "h100-sxm-80gb", 256, 2048),   # PR #10544: 2048 from 0.6.5
    ("0.8.5", "h100-sxm-80gb", 256, 2048),   # V1, API server defaults before the by-device table
    ("0.10.1", "h100-sxm-80gb", 1024, 8192),  # >= 70 GiB and not an A100
    ("0.10.1", "a100-sxm-80gb", 256, 2048),   # A100s are excluded by name
    ("0.10.1", "l4-24gb", 256, 2048),
])
def test_defaults_follow_version_and_device(version, hardware, seqs, tokens):
    hw = load_hardware(hardware)
    d = resolve_serving(engine_rules("vllm", version), hw, max_model_len=35000)
    assert (d.max_num_seqs, d.max_num_batched_tokens) == (seqs, tokens)
    assert all(a.startswith(f"vLLM {version}: ") for a in d.assumptions)


def test_cuda_graphs_count_inside_the_budget_from_0_21():
    hw = load_hardware("h100-sxm-80gb")
    assert resolve_serving(engine_rules("vllm", "0.21.0"), hw, max_model_len=8192).cuda_graphs_in_budget
    assert not resolve_serving(engine_rules("vllm", "0.11.0"), hw, max_model_len=8192).cuda_graphs_in_budget


def test_default_version_is_the_newest_known_and_unknown_versions_name_the_known_ones():
    assert engine_rules("vllm").version == engine_file("vllm").newest == "0.33.0"
    assert engine_rules("sglang").version == engine_file("sglang").newest == "0.5.23"
    for bad in ("0.3.0", "99.0", "latest"):
        with pytest.raises(ShardplanError) as e:
            engine_rules("vllm", bad)
        assert e.value.field == "--engine-version" and "0.5.4" in e.value.one_line() and "0.33.0" in e.value.one_line()


def test_every_era_names_a_source_for_every_rule():
    for era in engine_file("vllm").eras:
        assert all(era.sources[k].strip() for k in era.sources)


def test_cli_prints_the_rules_with_the_answer(cli):
    args = ("estimate", "llama-3.1-8b", "--hardware", "rtx-3090-24gb", "--gpus", "1", "--max-model-len", "29000",
            "--engine-version", "0.6.4")
    res = cli(*args, "--json")
    assert res.exit_code == 3  # refused, as vLLM 0.6.4 refused it
    d = res.json()
    assert d["workload"]["engine"] == "vllm" and d["workload"]["engine_version"] == "0.6.4"
    assert any("profile pass of 29,000 tokens" in a and "SchedulerConfig" in a for a in d["assumptions"])
    table = cli(*args)
    assert "assumes vLLM 0.6.4: profile pass of 29,000 tokens" in table.stdout


def _sglang_log() -> dict[str, float]:
    text = (LOGS / "sglang_l4x4_qwq32b_tp4.log").read_text()
    return {"avail_before": float(re.search(r"Load weight begin\. avail mem=([\d.]+) GB", text).group(1)),
            "load_usage": float(re.search(r"Load weight end\..*mem usage=([\d.]+) GB", text).group(1)),
            "tokens": int(re.search(r"max_total_num_tokens=(\d+)", text).group(1)),
            "fraction": float(re.search(r"mem_fraction_static=([\d.]+)", text).group(1)),
            "chunk": int(re.search(r"chunked_prefill_size=(\d+)", text).group(1))}


def test_sglang_static_pool_against_its_log():
    """SGLang 0.4.3.post4, QwQ-32B, tp 4 on 4 x L4 (sglang issue in index.yaml): the pool is
    (free memory at start) x mem_fraction_static - what loading the weights used."""
    log = _sglang_log()
    loaded = load_model(str(REPO / "shardplan" / "validation" / "corpus" / "models" / "qwq-32b.yaml"))
    hw = cluster(load_hardware("l4-24gb"), gpus=4, nodes=None, gpus_per_node=None)
    rules = engine_rules("sglang", "0.4.3")
    wl = inference_workload(
        max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None, engine=rules, hw=hw,
        model_max_len=loaded.spec.max_position_embeddings)
    assert wl.max_num_batched_tokens == log["chunk"]  # 2048 below 25 GB (PR #2044)
    assert static_fraction(wl, 4) == log["fraction"]  # the by-tp default the memory model applies
    rep = estimate(loaded.spec, hw, Layout(tp=4), wl)
    assert rep.fits  # SGLang started
    rank = rep.memory.per_rank[0].per_gpu_bytes
    # what loading used: the weights (with the rotary cache) and the non-torch/NCCL memory
    assert (rank["weights"] + rank["overhead"]) / BYTES_PER_GIB == pytest.approx(log["load_usage"], rel=0.02)
    # the pool: within 10% and below the engine's. The bundled L4 profile puts the CUDA context
    # at 0.5 GiB; the log's device (21.96 GiB in the profile) had 21.63 GiB free at start.
    assert rep.kv_cache.capacity_tokens <= log["tokens"]
    assert rep.kv_cache.capacity_tokens == pytest.approx(log["tokens"], rel=0.10)
    # activations are outside SGLang's pool: they do not shrink it
    assert rep.memory.per_rank[0].per_gpu_bytes["kv_cache"] == pytest.approx(
        (hw.memory_capacity_bytes - hw.cuda_context_bytes) * log["fraction"] - rank["weights"] - rank["overhead"])


def test_an_sglang_plan_round_trips_through_its_manifest(cli, tmp_path):
    plan = tmp_path / "sg.yaml"
    res = cli("recommend", "llama-3.1-8b", "--objective", "throughput", "--engine", "sglang", "--engine-version", "0.4.3", "--gpus", "2",
              "-o", str(plan), "--json")
    assert res.exit_code == 0, res.stderr
    shown = cli("show", str(plan), "--json").json()["workload"]
    assert (shown["engine"], shown["engine_version"], shown["accounting"]) == ("sglang", "0.4.3", "static_fraction")
    assert shown["static_fraction_by_tp"][-1] == {"min_tp": 1, "fraction": 0.88}
    assert res.json()["assumptions"].startswith("serving 1024-token prompts, 128 output tokens on SGLang 0.4.3")


def test_v0_refusal_at_131k_on_two_rtx_4090():
    """vllm issue #13061 (vLLM 0.7.x V0): R1-Distill-Qwen-14B, tp 2, --gpu-memory-utilization 0.98,
    default max_model_len 131072: refused with 81,536 tokens of cache. Above 32K, V0 profiles a
    2,048-token chunk; the refusal is V0's tokens check."""
    text = (LOGS / "vllm_v0_rtx4090x2_r1_distill_qwen14b_refused.log").read_text()
    m = re.search(r"max seq len \((\d+)\) is larger than the maximum number of tokens that can be stored in KV cache \((\d+)\)", text)
    max_len, cache_tokens = int(m.group(1)), int(m.group(2))
    weights_gib = float(re.search(r"Loading model weights took ([\d.]+) GB", text).group(1))
    loaded = load_model(str(REPO / "shardplan" / "validation" / "corpus" / "models" / "deepseek-r1-distill-qwen-14b.yaml"))
    hw = cluster(load_hardware("rtx-4090-24gb"), gpus=2, nodes=None, gpus_per_node=None)
    wl = inference_workload(
        max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=0.98,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None, engine=engine_rules("vllm", "0.7.3"), hw=hw,
        model_max_len=loaded.spec.max_position_embeddings)
    assert wl.max_num_batched_tokens == 2048
    rep = estimate(loaded.spec, hw, Layout(tp=2), wl)
    assert not rep.fits and rep.reason.startswith(f"The model's max seq len ({max_len}) is larger than")
    assert rep.memory.per_rank[0].per_gpu_bytes["weights"] / BYTES_PER_GIB == pytest.approx(weights_gib, rel=0.02)
    # Known: 11% optimistic. The bundled 4090 profile sees 23.64 GiB; the reporter's cards showed
    # 23.08 GiB ("23.08*2"). Bounded here so that it cannot silently get worse.
    assert rep.kv_cache.capacity_tokens == pytest.approx(cache_tokens, rel=0.12)


def test_sglang_pool_with_an_explicit_fraction_on_four_h100():
    """The same 4 x H100 as vllm issue #21348, SGLang with --mem-fraction-static 0.93, Qwen3-235B-A22B
    FP8 at tp 4: 367,404 tokens. Only the KV line was posted, so the 7% we over-predict cannot be
    split between the device's free memory and the FP8 checkpoint's weights."""
    text = (LOGS / "sglang_h100x4_qwen3_235b_fp8_tp4.log").read_text()
    tokens = int(re.search(r"#tokens: (\d+)", text).group(1))
    fraction = float(re.search(r"--mem-fraction-static ([\d.]+)", text).group(1))
    loaded = load_model("qwen3-235b-a22b")
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=4, nodes=None, gpus_per_node=None)
    wl = inference_workload(
        max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=fraction,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization="fp8", enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None, engine=engine_rules("sglang", "0.4.9"), hw=hw,
        model_max_len=loaded.spec.max_position_embeddings)
    assert wl.static_fraction_by_tp == ()  # given: no by-tp default
    rep = estimate(loaded.spec, hw, Layout(tp=4), wl)
    assert rep.fits
    assert rep.kv_cache.capacity_tokens == pytest.approx(tokens, rel=0.08)


def test_a_fraction_table_that_leaves_small_tp_unanswered_is_refused():
    from pydantic import ValidationError

    from shardplan.knowledge.schema import EngineEra

    era = engine_file("sglang").eras[1].model_dump()  # 0.4: a by-tp table, no reserve rule
    era["static_fraction_by_tp"] = [{"min_tp": 4, "value": 0.85}]
    with pytest.raises(ValidationError, match="min_tp: 1"):
        EngineEra.model_validate(era)
    era["static_fraction_by_tp"].append({"min_tp": 1, "value": 0.88})
    assert EngineEra.model_validate(era).static_fraction_by_tp[-1].min_tp == 1


def test_vllm_0_20_raised_the_memory_default_and_counted_cuda_graphs():
    """vllm/config/cache.py: gpu_memory_utilization Field(default=0.9) at 0.19.1, 0.92 from 0.20.0 (line 66)
    to 0.33.0; vllm/envs.py VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS '0' at 0.19.1, '1' from 0.20.0; the
    logged token count int(concurrency x max_model_len) from 0.20.1."""
    old, new, newer = (engine_rules("vllm", v).era for v in ("0.19.1", "0.20.0", "0.20.1"))
    assert (old.gpu_memory_utilization, old.cuda_graphs_in_budget) == (0.9, False)
    assert (new.gpu_memory_utilization, new.cuda_graphs_in_budget, new.kv_tokens_reported) == (0.92, True, "blocks")
    assert newer.kv_tokens_reported == "concurrency"
    assert all(engine_rules("vllm", v).era.gpu_memory_utilization == 0.92 for v in ("0.21.0", "0.26.0", "0.33.0"))


def test_vllm_flashinfer_sampler_was_opt_in_from_0_11_1_to_0_20():
    """topk_topp_sampler.py at 0.11.1-0.20.2: 'Users must opt in explicitly via VLLM_USE_FLASHINFER_SAMPLER=1'
    (the native path's 28 bytes a logit); on by default at 0.11.0 and again from 0.21.0 (10)."""
    assert [engine_rules("vllm", v).era.sampler_bytes_per_logit for v in ("0.11.0", "0.11.1", "0.20.2", "0.21.0")] == [
        10, 28, 28, 10]


def test_vllm_sliding_window_groups_count_two_batches_in_flight_from_0_26():
    """kv_cache_interface.py SlidingWindowSpec: window - 1 + max_num_batched_tokens at 0.25.1,
    window - 1 + VllmConfig.max_in_flight_tokens (2 x the budget with async scheduling) from 0.26.0."""
    assert [engine_rules("vllm", v).era.sliding_window_in_flight_batches
            for v in ("0.21.0", "0.25.1", "0.26.0", "0.33.0")] == [1, 1, 2, 2]


def test_vllm_0_28_batch_defaults_on_160_gib_devices_and_blackwell_graphs():
    """arg_utils.py get_batch_defaults at 0.28.0: >= 160 GiB -> 16,384 batched tokens for the API server
    (8,192 at 0.27.1); config/vllm.py _set_cudagraph_sizes: capture up to 1,024 on compute capability 10.x."""
    b200, h200 = load_hardware("b200-sxm-180gb"), load_hardware("h200-sxm-141gb")
    for version, b200_tokens, b200_graphs in (("0.27.1", 8192, 512), ("0.28.0", 16384, 1024), ("0.33.0", 16384, 1024)):
        b, h = (resolve_serving(engine_rules("vllm", version), hw, max_model_len=8192) for hw in (b200, h200))
        assert (b.max_num_batched_tokens, b.cuda_graph_max_batch, b.max_num_seqs) == (b200_tokens, b200_graphs, 1024)
        assert (h.max_num_batched_tokens, h.cuda_graph_max_batch, h.max_num_seqs) == (8192, 512, 1024)


def test_sglang_cuda_graph_batch_by_device_memory():
    """server_args.py _handle_gpu_memory_settings (tp < 4): 8 below 20 GiB, 16 (0.5.4) or 24 (0.5.5+) below
    35, 32 below 60, 256 below 160, 512 from 160 GiB."""
    for version, mid in (("0.5.4", 16), ("0.5.6", 24), ("0.5.9", 24)):
        rules = engine_rules("sglang", version)
        assert [rules.by_device(rules.era.cuda_graph_max_batch, gib, "x") for gib in (15, 22.5, 44, 79, 140, 178)] == [
            8, mid, 32, 256, 256, 512]


def _sglang_defaults(version: str, hardware: str, **kw):
    hw = cluster(load_hardware(hardware), gpus=1, nodes=None, gpus_per_node=None)
    return hw, resolve_serving(engine_rules("sglang", version), hw, max_model_len=kw.pop("max_model_len", None),
                               model_max_len=131072, **kw)


def _fraction(device_mib: float, reserved_mib: float) -> float:
    return round((device_mib - reserved_mib) / device_mib, 3)


def test_sglang_0_5_10_reserves_piecewise_prefill_graphs_dense_and_mla_on_an_h100():
    """SGLang 0.5.10 server_args.py _handle_gpu_memory_settings on an H100 SXM (CUDA reports 79.11 GiB =
    81,008.6 MiB; tp 1, pp 1): chunked_prefill_size 8192 and cuda_graph_max_bs 256 (60-90 GiB row).
    reserved = 512 + max(8192, 2048) x 1.5 + 256 x 2 + 1 x 1 / 8 x 1024 = 512 + 12288 + 512 + 128 = 13440 MiB.
    Piecewise CUDA graphs are on by default (line 637) and add, before the 10 GiB floor (13440 is above it):
    - a dense model: len(_generate_piecewise_cuda_graph_tokens()) x 8 with max = 8192: 4..32/4 (8) + 48..256/16
      (14) + 288..512/32 (8) + 576..1024/64 (8) + 1280..4096/256 (12) + 4608..8192/512 (8) = 58 sizes, 464 MiB:
      13904 -> round((81008.6 - 13904) / 81008.6, 3) = 0.828;
    - an MLA model: 1.5 x 1024 = 1536 MiB: 14976 -> 0.815.
    0.5.9 (no piecewise term by default) kept 13440 -> 0.834 for both."""
    hw, dense = _sglang_defaults("0.5.10", "h100-sxm-80gb")
    device_mib = hw.memory_capacity_bytes / BYTES_PER_GIB * 1024
    pg = engine_rules("sglang", "0.5.10").era.static_fraction_reserved.prefill_graphs
    assert len(pg.sizes_tokens(8192)) == 58
    assert (dense.max_num_batched_tokens, dense.cuda_graph_max_batch) == (8192, 256)
    assert dense.gpu_memory_utilization == _fraction(device_mib, 13440 + 58 * 8) == 0.828
    _, mla = _sglang_defaults("0.5.10", "h100-sxm-80gb", mla=True)
    assert mla.gpu_memory_utilization == _fraction(device_mib, 13440 + 1536) == 0.815
    for flag in ({}, {"mla": True}):
        assert _sglang_defaults("0.5.9", "h100-sxm-80gb", **flag)[1].gpu_memory_utilization == 0.834
    # tp 2: 13440 + 128 = 13568, + 464 = 14032 -> 0.827 (tp >= 4 raises cuda_graph_max_bs to 512 in SGLang,
    # which the by-device table does not model)
    assert dict(dense.static_fraction_by_tp)[2] == _fraction(device_mib, 13568 + 464) == 0.827


def test_sglang_prefill_graphs_off_for_multimodal_speculative_and_pipeline_stages():
    """0.5.10: _handle_piecewise_cuda_graph (lines 1078-1139) turns them off for a multimodal model, for
    speculative decoding and for pp > 1; speculative decoding then adds, after the floor, 4 GiB for an EAGLE
    family draft (NEXTN = shardplan's mtp) and 6 GiB for STANDALONE (draft_model): on the H100 (81,008.6 MiB),
    13440 + 4096 = 17536 -> 0.784, 13440 + 6144 = 19584 -> 0.758, NGRAM 13440 -> 0.834. From 0.5.11 speculative
    decoding keeps the graphs (13904 + 4096 = 18000 -> 0.778); 0.5.14 drops the speculative reserve (13904 -> 0.828).
    From 0.5.15 the default is the breakable backend, which pp > 1 does not turn off until 0.5.19."""
    hw, mm = _sglang_defaults("0.5.10", "h100-sxm-80gb", multimodal=True)
    device_mib = hw.memory_capacity_bytes / BYTES_PER_GIB * 1024
    assert mm.gpu_memory_utilization == _fraction(device_mib, 13440) == 0.834
    expected = {("0.5.10", "mtp"): 13440 + 4096, ("0.5.10", "draft_model"): 13440 + 6144, ("0.5.10", "ngram"): 13440,
                ("0.5.11", "mtp"): 13904 + 4096, ("0.5.14", "mtp"): 13904}
    for (version, method), reserved in expected.items():
        got = _sglang_defaults(version, "h100-sxm-80gb", speculative=method)[1].gpu_memory_utilization
        assert got == _fraction(device_mib, reserved), (version, method)
    for version, pp_off in (("0.5.10", True), ("0.5.14", True), ("0.5.15", False), ("0.5.18", False), ("0.5.19", True),
                            ("0.5.23", True)):
        d = _sglang_defaults(version, "h100-sxm-80gb")[1]
        assert bool(d.static_fraction_by_tp_pipelined) is pp_off, version
        if pp_off:
            assert dict(d.static_fraction_by_tp_pipelined)[1] == 0.834
    wl = inference_workload(
        max_model_len=8192, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None, engine=engine_rules("sglang", "0.5.23"),
        hw=cluster(load_hardware("h100-sxm-80gb"), gpus=1, nodes=None, gpus_per_node=None), model_max_len=131072)
    assert (static_fraction(wl, 1), static_fraction(wl, 1, pp=2)) == (0.828, 0.834)


def test_sglang_mla_prefill_graphs_off_with_breakable_0_5_15_to_0_5_17():
    """0.5.15 made breakable prefill graphs the CUDA default and _disable_breakable_cudagraph_if_incompatible
    turned them off for MLA (0.5.15 server_args.py line 3352): no 1.5 GiB, 13440 -> 0.834 on the H100; 0.5.18
    dropped that rule: 14976 -> 0.815 again."""
    for version, fraction in (("0.5.14", 0.815), ("0.5.15", 0.834), ("0.5.17", 0.834), ("0.5.18", 0.815),
                              ("0.5.23", 0.815)):
        assert _sglang_defaults(version, "h100-sxm-80gb", mla=True)[1].gpu_memory_utilization == fraction, version


def test_sglang_prefill_graph_sizes_clamped_to_a_given_context_0_5_13_to_0_5_16():
    """0.5.13 clamps the piecewise maximum to --context-length (server_args.py 1579-1585), 0.5.17 no longer:
    at max_model_len 4096 the sizes are 4..32/4, 48..256/16, 288..512/32, 576..1024/64, 1280..4096/256 = 50,
    400 MiB: 13440 + 400 = 13840 -> 0.829 on the H100; unclamped 58 sizes -> 0.828."""
    for version, fraction in (("0.5.12", 0.828), ("0.5.13", 0.829), ("0.5.16", 0.829), ("0.5.17", 0.828)):
        d = _sglang_defaults(version, "h100-sxm-80gb", max_model_len=4096)[1]
        assert d.gpu_memory_utilization == fraction, version


def test_sglang_eager_drops_graph_terms_from_0_5_14_and_0_5_15():
    """--disable-cuda-graph: 0.5.10-0.5.13 keep both terms (13904 -> 0.828); 0.5.14 disables the prefill
    backend too (_parse_cuda_graph_config line 2942): 13440 -> 0.834; 0.5.15 counts decode graphs only while on
    (lines 3639-3643): 13440 - 512 = 12928 -> 0.840."""
    for version, fraction in (("0.5.13", 0.828), ("0.5.14", 0.834), ("0.5.15", 0.840), ("0.5.23", 0.840)):
        assert _sglang_defaults(version, "h100-sxm-80gb", enforce_eager=True)[1].gpu_memory_utilization == fraction


def test_sglang_0_5_23_defaults_by_device():
    """arg_groups/memory_hook.py at 0.5.23 (tp < 4): chunked_prefill_size / decode max_bs: 2048 / 8 below
    20 GiB, 4096 / 48 below 35 (0.5.20's new row, was 2048 / 24), 4096 / 32 below 60, 8192 / 256 below 160,
    16384 / 512 from 160 GiB. Reserve on an RTX 4090 (the profile: 23.64 GiB = 24,207.4 MiB, no floor):
    512 + 4096 x 1.5 + 48 x 2 + 128 = 6880, + breakable prefill graphs up to 4096: 50 sizes x 8 = 400 -> 7280:
    round((24207.4 - 7280) / 24207.4, 3) = 0.699. With --max-running-requests 16 the decode max_bs is 16
    (0.5.22 lines 183-188): 6880 - 64 + 400 = 7216 -> 0.702."""
    rules = engine_rules("sglang", "0.5.23")
    assert rules.version == "0.5.23"
    table = [(rules.by_device(rules.era.chunked_budget_tokens, gib, "x"),
              rules.by_device(rules.era.cuda_graph_max_batch, gib, "x")) for gib in (15, 22.5, 44, 79, 140, 178)]
    assert table == [(2048, 8), (4096, 48), (4096, 32), (8192, 256), (8192, 256), (16384, 512)]
    hw, d = _sglang_defaults("0.5.23", "rtx-4090-24gb")
    device_mib = hw.memory_capacity_bytes / BYTES_PER_GIB * 1024
    assert (d.max_num_batched_tokens, d.cuda_graph_max_batch) == (4096, 48)
    assert d.gpu_memory_utilization == _fraction(device_mib, 6880 + 400) == 0.699
    capped = _sglang_defaults("0.5.23", "rtx-4090-24gb", max_num_seqs=16)[1]
    assert capped.cuda_graph_max_batch == 16
    assert capped.gpu_memory_utilization == _fraction(device_mib, 6880 - 64 + 400) == 0.702
    old = _sglang_defaults("0.5.19", "rtx-4090-24gb")[1]
    assert (old.max_num_batched_tokens, old.cuda_graph_max_batch) == (2048, 24)
    assert rules.era.admission.initial_ratio == 0.7 and rules.era.schedule == "prefill_first"


def test_sglang_cuda_graph_batch_grows_at_tp_4_and_0_5_3_has_the_heuristics():
    """server_args.py _handle_gpu_memory_settings in the 0.5.3 wheel (lines 566-672): at tp >= 4 the decode
    CUDA graphs go to 80 below 35 GiB, 160 below 60 and 512 below 160 (256 / 32 / 16 at tp < 4), and the
    mem_fraction_static reserve counts them (512 + 8192 x 1.5 + 512 x 2 + tp / 8 x 1024 MiB on an H200 at
    tp 8); 0.5.2 set no batch above 35 GiB (160) and kept the fraction table (0.81 at tp 8)."""
    rules = engine_rules("sglang", "0.5.3")
    table = [[rules.by_device(rules.era.cuda_graph_max_batch, gib, "x", tp) for gib in (15, 22.5, 44, 79, 140, 178)]
             for tp in (1, 4, 8)]
    assert table == [[8, 16, 32, 256, 256, 512], [8, 80, 160, 512, 512, 512], [8, 80, 160, 512, 512, 512]]
    hw, d = _sglang_defaults("0.5.3", "h200-sxm-141gb")
    device_mib = hw.memory_capacity_bytes / BYTES_PER_GIB * 1024
    assert d.cuda_graph_max_batch == 256 and dict(d.cuda_graph_max_batch_by_tp)[8] == 512
    assert dict(d.static_fraction_by_tp)[8] == _fraction(device_mib, 512 + 8192 * 1.5 + 512 * 2 + 1024)
    assert dict(d.static_fraction_by_tp)[1] == _fraction(device_mib, max(10240, 512 + 8192 * 1.5 + 256 * 2 + 128))
    old = _sglang_defaults("0.5.2", "h200-sxm-141gb")[1]
    assert (old.cuda_graph_max_batch, old.cuda_graph_max_batch_by_tp, dict(old.static_fraction_by_tp)[8]) == (160, (), 0.81)
    # the tp the plan runs at decides what its decode steps replay, and its report says so
    wl = InferenceWorkload(cuda_graph_max_batch=256, cuda_graph_max_batch_by_tp=((4, 512), (1, 256)))
    assert (wl.graph_max_at(1), wl.graph_max_at(2), wl.graph_max_at(4), wl.graph_max_at(8)) == (256, 256, 512, 512)
