"""Every stored engine log parses to the figures it prints (each expected number below is read
off the .log file, not off the parser), and hostile input fails fast with one line."""

from __future__ import annotations

import pytest
from conftest import REPO

from shardplan.errors import ShardplanError
from shardplan.specs.engine_log import MAX_LINE_CHARS, PATTERNS, parse_engine_log, read_engine_log
from shardplan.units import BYTES_PER_GIB

LOGS = REPO / "shardplan" / "validation" / "corpus" / "engine_logs"


def gib(x: float) -> int:
    return round(x * BYTES_PER_GIB)


# id -> (engine, generation, {field: value as printed, converted: GiB -> bytes}, refused)
EXPECTED = {
    "vllm_v0_rtx3090_llama31_8b_20k": ("vllm", "vllm-v0-0.6.4", {
        "weights_bytes": gib(14.9888), "total_gpu_memory_bytes": gib(23.58), "peak_torch_bytes": gib(17.06),
        "non_torch_bytes": gib(0.35), "kv_cache_bytes": gib(3.81), "gpu_memory_utilization": 0.90,
        "num_gpu_blocks": 1952, "num_cpu_blocks": 2048, "max_concurrency": 1.56,
        "max_concurrency_tokens_per_request": 20000}, False),
    "vllm_v0_rtx3090_llama31_8b_29k": ("vllm", "vllm-v0-0.6.4", {
        "weights_bytes": gib(14.9888), "peak_torch_bytes": gib(17.98), "kv_cache_bytes": gib(2.89),
        "num_gpu_blocks": 1478, "max_concurrency": 0.82, "refusal_max_model_len": 29000,
        "refusal_kv_tokens": 23648}, True),
    "vllm_v0_h100_llama32_11b_vision_64k": ("vllm", "vllm-v0.6.5+/v1", {
        "total_gpu_memory_bytes": gib(79.22), "gpu_memory_utilization": 0.90, "budget_bytes": gib(71.29),
        "weights_bytes": gib(19.86), "non_torch_bytes": gib(0.16), "activation_peak_bytes": gib(36.63),
        "kv_cache_bytes": gib(14.65), "num_gpu_blocks": 6001, "num_cpu_blocks": 1638}, False),
    "vllm_v1_h100x4_qwen3_235b_fp8_tp4": ("vllm", "vllm-v1", {
        "kv_cache_bytes": gib(8.11), "kv_cache_tokens": 178880}, False),
    "vllm_v1_l4x1_qwen25_vl_7b_2k_v0901": ("vllm", "vllm-v1", {
        "weights_bytes": gib(15.6271), "kv_cache_bytes": gib(1.81), "kv_cache_tokens": 33824, "max_concurrency": 16.52,
        "max_concurrency_tokens_per_request": 2048, "cuda_graph_bytes": gib(0.51)}, False),
    "vllm_v1_kvfp8_100k_started": ("vllm", "vllm-v1", {
        "kv_cache_bytes": gib(10.55), "kv_cache_tokens": 230528, "max_concurrency": 2.31,
        "max_concurrency_tokens_per_request": 100000}, False),
    "vllm_v1_kvfp8_221k_refused": ("vllm", "vllm-v1", {
        "refusal_max_model_len": 221000, "refusal_needed_bytes": gib(10.12), "refusal_available_bytes": gib(5.59),
        "refusal_estimated_max_model_len": 122080}, True),
    "vllm_v0_a10g_bonito_32k_refused": ("vllm", "vllm-v0", {
        "refusal_max_model_len": 32768, "refusal_kv_tokens": 16816}, True),
    "vllm_v0_alpaca2_7b_fp16_refused": ("vllm", "vllm-v0", {
        "num_gpu_blocks": 229, "num_cpu_blocks": 512, "refusal_max_model_len": 4096, "refusal_kv_tokens": 3664}, True),
    "vllm_v0_l4x2_ray_7878": ("vllm", "vllm-v0", {
        "weights_bytes": gib(6.5727), "num_gpu_blocks": 9650, "num_cpu_blocks": 3276}, False),
    "vllm_v0_llama3_70b_openrlhf_refused": ("vllm", "vllm-v0", {
        "num_gpu_blocks": 378, "num_cpu_blocks": 1638, "refusal_max_model_len": 8192, "refusal_kv_tokens": 6048}, True),
    "vllm_v0_t4x2_deepseek_coder_6p7b": ("vllm", "vllm-v0", {"num_gpu_blocks": 507, "num_cpu_blocks": 1024}, False),
    "vllm_v0_rtx3090_qwen25_vl_7b_refused": ("vllm", "vllm-v0", {
        "refusal_max_model_len": 8192, "refusal_kv_tokens": 2400}, True),
    "vllm_v0_rtx3090x2_llama31_8b_131k_refused": ("vllm", "vllm-v0", {
        "refusal_max_model_len": 131072, "refusal_kv_tokens": 39024}, True),
    "vllm_v0_rtx4090x2_r1_distill_qwen14b_refused": ("vllm", "vllm-v0", {
        "weights_bytes": gib(13.9476), "refusal_max_model_len": 131072, "refusal_kv_tokens": 81536}, True),
    "vllm_v0_rtx4090x4_llamafactory_128k_refused": ("vllm", "vllm-v0", {
        "refusal_max_model_len": 128000, "refusal_kv_tokens": 78336}, True),
    "vllm_v0_rtx5090x2_60k_refused": ("vllm", "vllm-v0", {
        "refusal_max_model_len": 60000, "refusal_kv_tokens": 58384}, True),
    "sglang_l4x4_qwq32b_tp4": ("sglang", "sglang", {
        "mem_fraction_static": 0.85, "avail_mem_before_weights_bytes": gib(21.63),
        "avail_mem_after_weights_bytes": gib(6.09), "weights_bytes": gib(15.54), "kv_cache_tokens": 46611,
        "k_cache_bytes": gib(1.42), "v_cache_bytes": gib(1.42), "kv_cache_bytes": gib(1.42) + gib(1.42),
        "avail_mem_after_kv_bytes": gib(2.09), "cuda_graph_bytes": gib(0.93), "max_total_num_tokens": 46611,
        "max_running_requests": 2049, "context_len": 131072}, False),
    "sglang_h100x4_qwen3_235b_fp8_tp4": ("sglang", "sglang", {
        "kv_cache_tokens": 367404, "k_cache_bytes": gib(8.23), "v_cache_bytes": gib(8.23)}, False),
    "sglang_tp8_deepseek_r1_160k": ("sglang", "sglang", {
        "request_input_tokens": 160062, "max_allowed_input_tokens": 59862}, False),
    "tgi_a100x4_llama2_70b": ("tgi", "tgi", {"max_batch_total_tokens": 406560}, False),
    "tgi_a10g_llama31_8b_defaults": ("tgi", "tgi", {
        "max_batch_total_tokens": 19056, "default_max_total_tokens": 4096, "cuda_memory_fraction": 1.0}, False),
    "sglang_l40s_llama31_8b_pr13023": ("sglang", "sglang", {
        "avail_mem_before_weights_bytes": gib(44.00), "avail_mem_after_weights_bytes": gib(28.91),
        "weights_bytes": gib(15.09), "kv_cache_tokens": 183133, "k_cache_bytes": gib(11.18),
        "v_cache_bytes": gib(11.18), "kv_cache_bytes": gib(11.18) + gib(11.18),
        "avail_mem_after_kv_bytes": gib(5.51)}, False),
    "sglang_rtx4090x4_qwen3_14b_tp4": ("sglang", "sglang", {
        "mem_fraction_static": 0.8, "avail_mem_after_weights_bytes": gib(16.00), "weights_bytes": gib(7.08),
        "kv_cache_tokens": 298447, "k_cache_bytes": gib(5.69), "v_cache_bytes": gib(5.69),
        "kv_cache_bytes": gib(5.69) + gib(5.69), "max_total_num_tokens": 298447, "max_running_requests": 3730,
        "context_len": 40960}, False),
    "sglang_rtx5080_qwen3_06b": ("sglang", "sglang", {
        "avail_mem_after_weights_bytes": gib(13.91), "weights_bytes": gib(1.25), "kv_cache_tokens": 104273,
        "k_cache_bytes": gib(5.57), "v_cache_bytes": gib(5.57), "kv_cache_bytes": gib(5.57) + gib(5.57),
        "avail_mem_after_kv_bytes": gib(2.43), "cuda_graph_bytes": gib(0.11), "max_total_num_tokens": 104273,
        "max_running_requests": 2048, "context_len": 40960}, False),
    "tgi_a100x2_llama31_70b_v240": ("tgi", "tgi", {"max_batch_total_tokens": 30816}, False),
    "tgi_a10_oci_swallow7b_v203": ("tgi", "tgi", {
        "cuda_memory_fraction": 1.0, "default_max_total_tokens": 4096, "max_batch_total_tokens": 15232}, False),
    "tgi_a10g_mistral7b_v03_jumpstart": ("tgi", "tgi", {"max_batch_total_tokens": 43808}, False),
    "vllm_v1_a100-80gbx1_qwen2_7b_16k_util025": ("vllm", "vllm-v1", {
        "weights_bytes": gib(14.2488), "kv_cache_bytes": gib(5.01), "kv_cache_tokens": 93872,
        "max_concurrency": 5.73, "max_concurrency_tokens_per_request": 16384, "cuda_graph_bytes": gib(0.50)}, False),
    "vllm_v1_a100-80gbx1_qwen2_7b_16k_util050": ("vllm", "vllm-v1", {
        "weights_bytes": gib(14.2488), "kv_cache_bytes": gib(24.83), "kv_cache_tokens": 464848,
        "max_concurrency": 28.37, "max_concurrency_tokens_per_request": 16384, "cuda_graph_bytes": gib(0.50)}, False),
    "vllm_v1_a100-80gbx2_qwen2_7b_16k_util025": ("vllm", "vllm-v1", {
        "weights_bytes": gib(7.1217), "kv_cache_bytes": gib(12.02), "kv_cache_tokens": 450192,
        "max_concurrency": 27.48, "max_concurrency_tokens_per_request": 16384, "cuda_graph_bytes": gib(0.65)}, False),
    "vllm_v1_a100-80gbx2_qwen2_7b_16k_util050": ("vllm", "vllm-v1", {
        "weights_bytes": gib(7.1217), "kv_cache_bytes": gib(31.83), "kv_cache_tokens": 1192160,
        "max_concurrency": 72.76, "max_concurrency_tokens_per_request": 16384, "cuda_graph_bytes": gib(0.65)}, False),
    "vllm_v1_jetson-thorx1_llama31_8b_131k_eager": ("vllm", "vllm-v1", {
        "weights_bytes": gib(14.9889), "kv_cache_bytes": gib(85.79), "kv_cache_tokens": 702800,
        "max_concurrency": 5.36, "max_concurrency_tokens_per_request": 131072}, False),
    "vllm_v1_l40sx1_qwen25_7b_32k_bf16": ("vllm", "vllm-v1", {
        "weights_bytes": gib(14.2488), "kv_cache_tokens": 444592, "max_concurrency": 13.57,
        "max_concurrency_tokens_per_request": 32768}, False),
    "vllm_v1_l40sx1_qwen25_7b_32k_fp8dyn": ("vllm", "vllm-v1", {
        "weights_bytes": gib(8.1426), "kv_cache_tokens": 553216, "max_concurrency": 16.88,
        "max_concurrency_tokens_per_request": 32768}, False),
    "vllm_v1_l40sx1_qwen25_7b_32k_gptq_int4": ("vllm", "vllm-v1", {
        "weights_bytes": gib(5.1811), "kv_cache_tokens": 611248, "max_concurrency": 18.65,
        "max_concurrency_tokens_per_request": 32768}, False),
    "vllm_v1_l40sx2_qwen3_30b_a3b_fp8_32k": ("vllm", "vllm-v1", {
        "kv_cache_bytes": gib(25.91), "kv_cache_tokens": 566016, "max_concurrency": 17.27,
        "max_concurrency_tokens_per_request": 32768}, False),
    "vllm_v1_l40sx8_qwen3_235b_a22b_fp8_32k": ("vllm", "vllm-v1", {
        "weights_bytes": gib(27.7183), "kv_cache_bytes": gib(10.64), "kv_cache_tokens": 237344,
        "max_concurrency": 7.24, "max_concurrency_tokens_per_request": 32768, "cuda_graph_bytes": gib(3.45),
        "total_gpu_memory_bytes": gib(44.42), "activation_peak_bytes": gib(1.4), "non_torch_bytes": gib(0.21)}, False),
}
EXPECTED |= {
    "sglang_rtx3090_r1_distill_qwen7b": ("sglang", "sglang", {
        "mem_fraction_static": 0.88, "avail_mem_before_weights_bytes": gib(22.76),
        "avail_mem_after_weights_bytes": gib(8.37), "k_cache_bytes": gib(2.82), "v_cache_bytes": gib(2.82),
        "kv_cache_bytes": gib(2.82) + gib(2.82), "avail_mem_after_kv_bytes": gib(1.68), "max_total_num_tokens": 105531,
        "max_running_requests": 2049, "context_len": 131072}, False),
    # The stored copy is hard-wrapped as its source was: 'Graph capturing finished in 11' / ' secs, took
    # 1.00 GiB' spans two lines, so its graph figure is not read (the parser reads one line at a time).
    "vllm_v1_a100-40gbx2_qwen2_7b_16k_util050_ray2nodes": ("vllm", "vllm-v1", {
        "weights_bytes": gib(7.1217), "kv_cache_bytes": gib(11.03), "kv_cache_tokens": 412944, "max_concurrency": 25.20,
        "max_concurrency_tokens_per_request": 16384}, False),
    "vllm_v1_a100-80gbx4_gpt_oss_120b_tp4_16k_v01011_ray": ("vllm", "vllm-v1", {
        "weights_bytes": gib(17.2217), "kv_cache_bytes": gib(45.32), "kv_cache_tokens": 2640144, "max_concurrency": 284.25,
        "max_concurrency_tokens_per_request": 16384}, False),
}
# Stored logs that must be refused, and a word the one-line error must hold.
REFUSED_LOGS = {
    "vllm_v0_rtx3090_llama31_8b_35k": "ends before the KV cache is sized",  # truncated after peak_torch_memory
    "tgi_a10g_llama2_7b_inferred": "no vLLM/SGLang/TGI start-up memory lines found",  # the figure is prose only
}


def test_every_stored_log_is_covered():
    assert {p.stem for p in LOGS.glob("*.log")} == set(EXPECTED) | set(REFUSED_LOGS)


@pytest.mark.parametrize("log_id", sorted(EXPECTED))
def test_stored_log_parses_to_its_printed_figures(log_id):
    engine, generation, figures, refused = EXPECTED[log_id]
    log = read_engine_log(LOGS / f"{log_id}.log")
    assert (log.engine, log.generation, log.refused) == (engine, generation, refused)
    got = {name: getattr(log, name).value for name in figures}
    assert got == pytest.approx(figures)
    assert set(log.found()) >= set(figures)


def test_line_numbers_point_at_the_engine_lines_not_the_header_notes():
    log = read_engine_log(LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log")
    lines = (LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log").read_text().splitlines()
    assert "Memory profiling results" in lines[log.total_gpu_memory_bytes.line - 1]  # the header also names it
    assert "GPU blocks: 1952" in lines[log.num_gpu_blocks.line - 1]
    assert log.weights_bytes.printed == "14.9888 GB"


@pytest.mark.parametrize("log_id", sorted(REFUSED_LOGS))
def test_stored_logs_without_kv_lines_are_refused(log_id):
    with pytest.raises(ShardplanError) as e:
        read_engine_log(LOGS / f"{log_id}.log")
    line = e.value.one_line()
    assert REFUSED_LOGS[log_id] in line and f"{log_id}.log" in line and "\n" not in line


def test_truncated_log_names_what_it_found_and_what_is_missing():
    with pytest.raises(ShardplanError) as e:
        read_engine_log(LOGS / "vllm_v0_rtx3090_llama31_8b_35k.log")
    assert "peak_torch_bytes (line 7)" in e.value.one_line() and "'# GPU blocks'" in e.value.one_line()


def test_ansi_coloured_log_parses_the_same():
    text = (LOGS / "sglang_l4x4_qwq32b_tp4.log").read_text()
    coloured = "".join(f"\x1b[32mINFO\x1b[0m \x1b[1;36m{line}\x1b[0m\n" for line in text.splitlines())
    a, b = parse_engine_log(text, "x"), parse_engine_log(coloured, "x")
    assert a.model_dump(exclude={"source"}) == b.model_dump(exclude={"source"})


def test_thousands_separators_and_crlf():
    log = parse_engine_log("Available KV cache memory: 1,234.5 GiB\r\nGPU KV cache size: 1,178,880 tokens\r\n", "x")
    assert log.kv_cache_tokens.value == 1_178_880 and log.kv_cache_bytes.value == gib(1234.5)
    assert log.kv_cache_tokens.line == 2


def test_a_line_over_the_cap_is_skipped_not_matched():
    long_line = "GPU KV cache size: 5 tokens " + "x" * MAX_LINE_CHARS
    with pytest.raises(ShardplanError, match="lines over"):
        parse_engine_log(long_line + "\n", "x")


def test_every_pattern_belongs_to_its_engine_table():
    for engine, table in PATTERNS.items():
        assert table and all(p.engine == engine and p.keyword in p.regex.pattern.replace("\\", "") for p in table)
