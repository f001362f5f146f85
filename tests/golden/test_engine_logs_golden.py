"""Every stored start-up log with a prediction case against the engine rules of its version.

shardplan/validation/corpus/engine_logs/index.yaml gives, per log, where it comes from and a `case:` block: the
model, the hardware profile, the GPU count and layout, the engine and version, the flags the
command line set (null: the engine's default) and what the engine printed (KV tokens, started or
refused). Each case is predicted the way a user would ask: the engine rules of that version fill
what the command left out. `device_total_gib` is the device memory the log itself prints (the
engine's own `total_gpu_memory`, or the budget's parts summing to it) and `device_free_gib` the
free memory SGLang prints before loading (its pool is a fraction of it); where a log prints
neither, the bundled profile's capacity stands.

What must hold (issue: engines by version): the verdict is the engine's on every case, and the
KV capacity is within 5% on every case except the known misses below, each of which says what is
unexplained and is bounded so that it cannot silently get worse.
"""

from __future__ import annotations

from collections import Counter

import pytest
import yaml

from shardplan.cost.estimate import estimate
from shardplan.cost.report import CostReport
from shardplan.knowledge.load import engine_rules
from shardplan.specs.cases import EngineLogCase
from shardplan.specs.loading import load_hardware
from shardplan.validation.predict import engine_log_inputs, logged_device_gib
from shardplan.validation.shipped import CORPUS_DIR, engine_log_cases

INDEX = CORPUS_DIR / "engine_logs" / "index.yaml"
KV_TOLERANCE = 0.05

# id -> (bound on |error|, what is not explained). Each is out of the 5% band today.
KNOWN_MISSES = {
    "vllm_v1_l40sx8_qwen3_235b_a22b_fp8_32k": (
        0.10, "the log's own split puts 1.40 GiB in the profiling pass's activation peak (tp 8 with expert "
              "parallelism on PCIe L40S) where the model has 0.41 GiB; non-torch memory is 0.18 GiB as modelled"),
    "vllm_v1_a100-40gbx2_qwen2_7b_16k_util050_ray2nodes": (
        0.10, "two Ray nodes with one GPU each: 1.54 GiB of the budget is neither weights nor KV where the "
              "same model on two GPUs of one node leaves 0.62-0.65 GiB; the A100 40GB size is known from the "
              "file name only"),
    "vllm_v1_h100x4_qwen3_235b_fp8_tp4": (
        0.80, "LMCacheConnectorV1 is on (--kv-transfer-config): its buffers come out of the KV budget and "
              "are not modelled"),
    "sglang_h100x4_qwen3_235b_fp8_tp4": (
        0.10, "only the KV line was posted (no free memory at start, no weights line), so the 1.0 GiB per GPU "
              "over-predicted cannot be split between the device's free memory and the FP8 checkpoint's weights"),
    "tgi_a10g_llama31_8b_defaults": (
        0.75, "TGI 2.2.0 on one A10G: about 1.5 GiB held through the run that is neither weights, KV, the warm-up's "
              "logits nor its layers' cached segments (the run's own nvidia-smi, 14 minutes in, puts the same ~2 GiB "
              "outside them, where a TGI 2.0.3 A10 run with Llama 2 7B leaves ~0.4 GiB and is predicted within 2%); "
              "no TGI code holds it: a property of that host's driver (CUDA 12.0 under a 12.1 image) is suspected"),
    "vllm_v1_l4x1_qwen25_vl_7b_2k_v0901": (
        0.10, "Qwen2.5-VL-7B (multimodal, encoder profiled on one 65,536-patch image): vLLM loaded 15.63 GiB of "
              "weights where the parameters are 15.48 GiB, and the 0.15 GiB more equals the KV gap (1.81 GiB "
              "logged, 1.95 GiB predicted); what those 0.15 GiB are is not modelled"),
    "vllm_v0_h100_llama32_11b_vision_64k": (
        0.15, "Llama 3.2 11B Vision (mllama, V0 encoder-decoder runner: 128 dummy images of 4 tiles through the "
              "tower at once): activation peak 35.04 GiB predicted (tower blocks over 823,296 padded tokens 21.6, "
              "the (128, 6432, 6432) tile mask 9.86, fp32 pixel buffers 3.6) vs 36.63 logged; the 1.6 GiB under "
              "is within one kept intermediate hidden state (1.96 GiB), while keeping all five the tower keeps "
              "would give 44.9 GiB: which of them are alive at the peak is not modelled"),
}


# The start-up logs with a complete case, typed as `shardplan validate` reads them.
CASES = engine_log_cases(CORPUS_DIR)[0]
WITH_KV = [c for c in CASES if c.kv_cache_tokens]


def predict(case: EngineLogCase) -> CostReport:
    return estimate(*engine_log_inputs(case, CORPUS_DIR))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_verdict_is_the_engines(case):
    rep = predict(case)
    assert rep.fits is case.started, rep.reason


@pytest.mark.parametrize("case", WITH_KV, ids=[c.id for c in WITH_KV])
def test_kv_capacity_against_the_log(case):
    predicted = predict(case).kv_cache.capacity_tokens
    error = predicted / case.kv_cache_tokens - 1
    bound, why = KNOWN_MISSES.get(case.id, (KV_TOLERANCE, ""))
    assert abs(error) <= bound, f"{predicted:,} predicted vs {case.kv_cache_tokens:,} logged ({error:+.1%}) {why}"
    if case.id in KNOWN_MISSES:
        assert abs(error) > KV_TOLERANCE, "a known miss now within 5%: take it off KNOWN_MISSES"


def test_the_golden_set_spans_engines_generations_gpus_and_tp():
    """At least 12 logs within 5%, from at least 3 engine generations and 4 GPU models, TP 1 to 8."""
    within = [c for c in WITH_KV if c.id not in KNOWN_MISSES]
    assert len(within) >= 12
    generations = Counter(engine_rules(c.engine, c.engine_version).era.generation for c in within)
    assert len(generations) >= 3, generations
    assert len({c.hardware for c in within}) >= 4
    assert {1, 8} <= {c.tp for c in CASES}
    assert any(not c.started for c in CASES)  # refusals are in the set, not just starts
    assert set(KNOWN_MISSES) <= {c.id for c in WITH_KV}


def test_every_case_names_its_source_and_what_was_inferred():
    for e in yaml.safe_load(INDEX.read_text()):
        if e["id"] not in {c.id for c in CASES}:
            continue
        assert e["source"].startswith(("https://", "index file id")) or "id " in e["source"], e["id"]
        c = e["case"]
        assert c["engine"] in ("vllm", "sglang", "tgi", "trtllm"), e["id"]
        assert isinstance(c["started"], bool), e["id"]


def _profile_as_the_log_saw_it(case: EngineLogCase, tmp_path) -> str:
    """The bundled profile with the device memory the log printed, as a file a plan can name."""
    from shardplan.specs.loading import hardware_path, read_structured

    data = read_structured(hardware_path(case.hardware))
    if (logged := logged_device_gib(case, load_hardware(case.hardware))) is not None:
        data["gpu"]["memory_capacity_gib"] = logged
    path = tmp_path / f"{case.hardware}-as-logged.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


GOLDEN = [c for c in WITH_KV if c.id not in KNOWN_MISSES]


@pytest.mark.parametrize("case", GOLDEN, ids=[c.id for c in GOLDEN])
def test_verify_engine_log_passes_on_each_golden_log(case, cli, tmp_path):
    """`shardplan verify PLAN --engine-log LOG` on a plan made for the log's run: exit 0, and a row
    for every figure the log prints that the cost model predicts."""
    from conftest import build_plan

    from shardplan.plan.manifest import write_manifest
    from shardplan.specs.engine_log import read_engine_log

    hardware = _profile_as_the_log_saw_it(case, tmp_path)
    as_logged = case.model_copy(update={"device_total_gib": None, "device_free_gib": None, "hardware": hardware})
    spec, _, layout, wl = engine_log_inputs(as_logged, CORPUS_DIR)
    manifest, _ = build_plan(str(CORPUS_DIR / case.model) if case.model.endswith(".yaml") else spec.name,
                             case.gpus, layout, wl, hardware=hardware)
    plan = tmp_path / "plan.yaml"
    write_manifest(manifest, plan)
    log_path = INDEX.parent / f"{case.id}.log"
    r = cli("verify", plan, "--engine-log", log_path, "--hardware", hardware, "--json")
    out = r.json()
    assert r.exit_code == 0, out["mismatches"]
    listed = {t["term"] for t in out["terms"]}
    log = read_engine_log(log_path)
    printed = {"kv_cache_tokens" if (log.kv_cache_tokens or log.refusal_kv_tokens or log.max_total_num_tokens)
               else None, "weights" if log.weights_bytes else None, "kv_cache" if log.kv_cache_bytes else None}
    assert printed - {None} <= listed, (printed, listed)
