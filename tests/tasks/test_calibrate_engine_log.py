"""`shardplan calibrate --engine-log`: a vLLM start-up log's device memory and runtime overheads
-> a hardware profile, held against the engine's own KV cache figures.

Golden case: the RTX 3090 / Llama-3.1-8B logs of vllm issue #10517 (shardplan/validation/corpus/engine_logs,
vLLM 0.6.4 format). The profile is calibrated from the 20k log only; the 29k log is held out."""

from __future__ import annotations

import pytest
from conftest import REPO

from shardplan.errors import EXIT_DOES_NOT_FIT, EXIT_OK, InputFileError
from shardplan.specs.engine_log import parse_engine_log, read_engine_log
from shardplan.specs.loading import hardware_from_data, hardware_path, load_hardware, read_structured
from shardplan.tasks.calibrate import calibrate_from_engine_log

LOGS = REPO / "shardplan" / "validation" / "corpus" / "engine_logs"
LOG_20K = LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log"
LOG_29K = LOGS / "vllm_v0_rtx3090_llama31_8b_29k.log"
# The log the profile was calibrated from is predicted up to the rounding of its printed
# figures (2 decimals of GiB) and the activation model; a held-out max_model_len adds the
# activation peak's error at another length, so a wider band.
CALIBRATED_TOLERANCE = 0.02
HELD_OUT_TOLERANCE = 0.05


def _base(name: str = "rtx-3090-24gb") -> dict:
    return read_structured(hardware_path(name))


def _blocks(cli, hw: str, max_model_len: int):
    r = cli("estimate", "llama-3.1-8b", "--hardware", hw, "--gpus", "1", "--max-model-len", max_model_len,
            "--engine-version", "0.6.4", "--json")
    return r, r.json()["kv_cache"]["num_blocks"]


@pytest.fixture
def calibrated_20k(cli, tmp_path):
    out = tmp_path / "my-3090.yaml"
    r = cli("calibrate", "--engine-log", LOG_20K, "--hardware", "rtx-3090-24gb", "-o", out, "--json")
    assert r.exit_code == EXIT_OK, r.stderr
    return out, r.json()


def test_20k_log_sets_capacity_and_the_064_non_torch_sum(calibrated_20k):
    out, res = calibrated_20k
    assert res["measured_by"] == "engine-log" and res["changes"] == []
    hw = load_hardware(str(out))
    base = load_hardware("rtx-3090-24gb")
    gib = 2**30
    assert hw.memory_capacity_bytes / gib == pytest.approx(23.58, abs=1e-6)
    # vLLM 0.6.4 counts the CUDA context in non_torch_memory, and its pass adds no non-torch memory
    # of its own (the era's non_torch_gib is 0): the context takes the logged 0.35 at tp 1
    assert hw.cuda_context_bytes / gib == pytest.approx(0.35, abs=1e-6)
    assert hw.non_torch_bytes == base.non_torch_bytes  # kept for the eras that charge it
    assert hw.nccl_buffer_bytes == base.nccl_buffer_bytes and hw.cuda_graph_bytes == base.cuda_graph_bytes
    fields = {c["field"]: c for c in res["profile_changes"]}
    assert set(fields) == {"gpu.memory_capacity_gib", "runtime.cuda_context_gib"}
    assert fields["runtime.cuda_context_gib"]["log_line"] == 6
    assert fields["runtime.cuda_context_gib"]["old_gib"] == pytest.approx(base.cuda_context_bytes / gib)
    src = hw.sources["runtime.cuda_context_gib"]
    assert src.startswith("calibrated from vllm_v0_rtx3090_llama31_8b_20k.log line 6: 'non_torch_memory=0.35GiB'")
    assert "cuda_context_gib = 0.35" in src
    assert hw.sources["gpu.memory_capacity_gib"].startswith(
        "calibrated from vllm_v0_rtx3090_llama31_8b_20k.log line 6: 'total_gpu_memory=23.58GiB'")
    assert hw.sources["runtime.non_torch_gib"] == base.sources["runtime.non_torch_gib"]  # not changed, not re-sourced
    assert hw.name == "my-3090"
    assert out.read_text().startswith("# calibrated by `shardplan calibrate --engine-log")


def test_calibrated_profile_predicts_the_20k_blocks_and_the_held_out_29k_refusal(cli, calibrated_20k):
    out, _ = calibrated_20k
    log20, log29 = read_engine_log(LOG_20K), read_engine_log(LOG_29K)
    assert log20.num_gpu_blocks and log29.num_gpu_blocks and log29.refused and not log20.refused
    r20, blocks20 = _blocks(cli, str(out), 20000)
    assert r20.exit_code == EXIT_OK
    assert blocks20 == pytest.approx(log20.num_gpu_blocks.value, rel=CALIBRATED_TOLERANCE)  # 1957 vs 1952
    r29, blocks29 = _blocks(cli, str(out), 29000)
    assert r29.exit_code == EXIT_DOES_NOT_FIT  # the engine refused too
    assert "larger than the maximum number of tokens" in r29.json()["reason"]
    assert blocks29 == pytest.approx(log29.num_gpu_blocks.value, rel=HELD_OUT_TOLERANCE)  # 1482 vs 1478
    # the calibration is what closes the gap: the bundled profile is further off on both
    _, base20 = _blocks(cli, "rtx-3090-24gb", 20000)
    _, base29 = _blocks(cli, "rtx-3090-24gb", 29000)
    assert abs(base20 - log20.num_gpu_blocks.value) > abs(blocks20 - log20.num_gpu_blocks.value)
    assert abs(base29 - log29.num_gpu_blocks.value) > abs(blocks29 - log29.num_gpu_blocks.value)


V1_LOG = """INFO worker.py:238] the current vLLM instance can use total_gpu_memory (79.22GiB) x gpu_memory_utilization (0.90) = 71.29GiB
INFO worker.py:238] model weights take 14.99GiB; non_torch_memory takes {non_torch}GiB; PyTorch activation peak memory takes 1.2GiB; the rest of the memory reserved for KV Cache is 54.7GiB.
INFO model_runner.py:1500] Graph capturing finished in 12 secs, took 0.52 GiB
"""


def _v1(non_torch: str, **kw):
    log = parse_engine_log(V1_LOG.format(non_torch=non_torch), "v1.log")
    return calibrate_from_engine_log(log, _base("h100-sxm-80gb"), name="my-h100", **kw)


def test_v1_log_at_tp1_sets_non_torch_and_graphs_and_leaves_the_context():
    data, rows, _ = _v1("0.21")
    rt = data["runtime"]
    base = _base("h100-sxm-80gb")["runtime"]
    assert rt["non_torch_gib"] == 0.21 and rt["cuda_graphs_gib"] == 0.52
    assert rt["cuda_context_gib"] == base["cuda_context_gib"] and rt["nccl_buffers_gib"] == base["nccl_buffers_gib"]
    assert data["gpu"]["memory_capacity_gib"] == 79.22
    assert {r.field for r in rows} == {"gpu.memory_capacity_gib", "runtime.non_torch_gib", "runtime.cuda_graphs_gib"}
    assert data["sources"]["runtime.non_torch_gib"].startswith(
        "calibrated from v1.log line 2: 'non_torch_memory takes 0.21GiB'")
    assert data["sources"]["runtime.cuda_graphs_gib"].startswith("calibrated from v1.log line 3:")
    hardware_from_data(data, "written.yaml")  # loads


def test_v1_log_at_tp2_keeps_the_profiles_nccl_buffers():
    base = _base("h100-sxm-80gb")["runtime"]
    data, rows, _ = _v1("0.5", tp=2)
    rt = data["runtime"]
    assert rt["nccl_buffers_gib"] == base["nccl_buffers_gib"]
    assert rt["non_torch_gib"] + rt["nccl_buffers_gib"] == pytest.approx(0.5, abs=1e-9)
    tp1, _, _ = _v1("0.5", tp=1)
    assert tp1["runtime"]["non_torch_gib"] == 0.5  # tp matters: at tp 1 there are no NCCL buffers in it


def test_a_figure_below_the_profiles_other_terms_floors_and_still_sums():
    base = _base("h100-sxm-80gb")["runtime"]
    small = round(base["nccl_buffers_gib"] / 2, 4)
    data, rows, notes = _v1(f"{small}", tp=2)
    rt = data["runtime"]
    assert rt["non_torch_gib"] == 0 and rt["nccl_buffers_gib"] == pytest.approx(small)
    assert any("set to 0" in n for n in notes)
    log064 = parse_engine_log("Memory profiling results: total_gpu_memory=23.58GiB initial_memory_usage=15.1GiB "
                              "peak_torch_memory=17.0GiB memory_usage_post_profile=15.1GiB non_torch_memory=0.1GiB "
                              "kv_cache_size=3.9GiB gpu_memory_utilization=0.90\n", "v064.log")
    data, _, _ = calibrate_from_engine_log(log064, _base(), name="x")
    assert data["runtime"]["cuda_context_gib"] == 0.1  # tp 1: the context takes all of it
    data, _, notes = calibrate_from_engine_log(log064, _base(), name="x", tp=2)
    assert data["runtime"]["cuda_context_gib"] == 0 and data["runtime"]["nccl_buffers_gib"] == 0.1
    assert any("set to 0" in n for n in notes)


@pytest.mark.parametrize("log, missing", [
    ("vllm_v0_l4x2_ray_7878.log", "no device or runtime memory figure"),  # weights and blocks only
    ("sglang_l4x4_qwq32b_tp4.log", "SGLang log"),  # has a CUDA-graph figure, but SGLang's budget
    ("tgi_a10g_llama31_8b_defaults.log", "TGI log"),
])
def test_logs_without_vllm_memory_figures_are_refused(log, missing):
    with pytest.raises(InputFileError, match=missing) as e:
        calibrate_from_engine_log(read_engine_log(LOGS / log), _base(), name="x")
    assert "\n" not in e.value.one_line() and log in e.value.one_line()
