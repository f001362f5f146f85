"""Multimodal vLLM start-up logs against the engine rules of their version (issue 27 must-show:
multimodal serving memory within 10% of at least 3 public start-up logs, encoder profiling included).

Two sets of logs are read. The multimodal cases of engine_logs/index.yaml (judged on their KV
capacity by test_engine_logs_golden.py) and the collected logs in
engine_logs/multimodal_*.yaml, one entry a file in the same schema. An entry that can be judged
carries a `case:` block (model, hardware, engine version, the flags the run set, null for the
engine's default). Its `reported:` figures are then compared with the prediction made through the
normal path (engine rules by version, the vision tower in the profiling pass: cost/engine.py
profile_vision, cost/vision.py): the KV cache in GiB, the # GPU blocks or KV tokens, the V0
activation peak and the weights. An entry that cannot be judged says why in `not_judged:`. A case
model under tests/ resolves against the repository root, any other against the corpus folder.

A figure outside the 10% band is a known miss below: what is not explained, bounded so that it
cannot silently get worse.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import REPO

from shardplan.cost.estimate import estimate
from shardplan.cost.report import CostReport
from shardplan.knowledge.load import engine_rules
from shardplan.specs.cases import EngineFlags, EngineLogCase
from shardplan.specs.loading import load_model
from shardplan.validation.predict import engine_log_inputs
from shardplan.validation.shipped import CORPUS_DIR, engine_log_cases
from shardplan.units import BYTES_PER_GIB

LOGS = CORPUS_DIR / "engine_logs"
FILES = sorted(LOGS.glob("multimodal_*.yaml"))
TOLERANCE = 0.10

# (id, reported figure) -> (bound on |error|, what is not explained). Each is out of the 10% band today.
KNOWN_MISSES = {
    ("multimodal_vllm_v0_80g_qwen2vl_7b_v073_15783", "activation_peak_gib"): (
        0.30, "Qwen2-VL-7B on V0 0.7.3: 1.29 GiB predicted, the text pass of 10,240 tokens alone (with the released "
              "max_pixels an image of 16,384 tokens does not fit the 10,240-token dummy sequence, so V0 profiles text "
              "only) vs 1.72 GiB logged; the run passed mm_processor_kwargs that the excerpt does not show (it ends in "
              "'...: 2007040}'), under which the dummy prompt's image and video fit and the tower runs; the tower on a "
              "video item and the run's processor settings are not modelled. The KV cache (46.11 GiB) is within 1%"),
    ("multimodal_vllm_v1_rtx4090d_qwen25vl_3b_bnb_v092_unsloth", "weights_gib"): (
        0.30, "Qwen2.5-VL-3B loaded by vLLM 0.9.2's in-flight bitsandbytes: 3.20 GiB predicted vs 2.60 logged. vLLM "
              "hands the bitsandbytes config to the vision tower too (qwen2_5_vl.py _maybe_ignore_quant_config drops "
              "only GPTQ configs; bitsandbytes_loader.py _get_bnb_target_modules takes every LinearBase), so the "
              "tower's and merger's linears (1.2 GiB in bf16) are 4-bit, where shardplan's weights quantize the text "
              "blocks only; the LoRA slots Unsloth enables are not modelled either. The KV cache is within 2% because "
              "the 0.6 GiB over here meets about as much under in the activation and non-torch terms, which V1 does "
              "not print apart"),
}


def _entries() -> list[dict]:
    return [e for path in FILES for e in yaml.safe_load(path.read_text())]


def _case(entry: dict) -> EngineLogCase:
    c = entry["case"]
    model = str(REPO / c["model"]) if c["model"].startswith("tests/") else c["model"]
    return EngineLogCase(
        id=entry["id"], source=entry["source"], model=model, hardware=c["hardware"], gpus=c["gpus"],
        engine=c["engine"], engine_version=str(c["engine_version"]), tp=c["tp"], pp=c.get("pp") or 1,
        device_total_gib=c.get("device_total_gib"), device_free_gib=c.get("device_free_gib"),
        flags=EngineFlags(**(c.get("flags") or {})), kv_cache_tokens=c.get("kv_tokens"), started=c["started"])


ENTRIES = {e["id"]: e for e in _entries()}
JUDGED = [_case(e) for e in ENTRIES.values() if e.get("case")]


def _vision(model: str):
    """The model's vision tower (None: a text model); a relative file is the corpus folder's, any other
    name a bundled model."""
    if model.endswith((".yaml", ".yml", ".json")) and not Path(model).is_absolute():
        model = str(CORPUS_DIR / model)
    return load_model(model).spec.vision


def predict(case: EngineLogCase) -> CostReport:
    return estimate(*engine_log_inputs(case, CORPUS_DIR))


def _predicted(rep: CostReport, figure: str) -> float:
    """The prediction of one `reported:` figure: KV and activations on the binding rank (vLLM sizes the
    cache by the minimum over ranks), the activation peak on the first stage (where the tower runs)."""
    ranks = rep.memory.per_rank
    if figure == "kv_cache_gib":
        return min(r.per_gpu_bytes["kv_cache"] for r in ranks) / BYTES_PER_GIB
    if figure == "activation_peak_gib":
        return ranks[0].per_gpu_bytes["activations"] / BYTES_PER_GIB
    if figure == "weights_gib":
        return ranks[0].per_gpu_bytes["weights"] / BYTES_PER_GIB
    if figure == "num_gpu_blocks":
        return rep.kv_cache.num_blocks
    return rep.kv_cache.capacity_tokens  # kv_cache_tokens


FIGURES = ("kv_cache_gib", "num_gpu_blocks", "kv_cache_tokens", "activation_peak_gib", "weights_gib")


def _logged(entry: dict) -> dict[str, float]:
    """The figures the log printed as numbers (an 'inferred: ...' text is not a measurement)."""
    reported = entry.get("reported") or {}
    return {f: float(reported[f]) for f in FIGURES
            if isinstance(reported.get(f), (int, float)) and not isinstance(reported.get(f), bool)}


COMPARED = [(c, f) for c in JUDGED for f in _logged(ENTRIES[c.id])]


def test_every_collected_log_is_judged_or_says_why_not():
    for e in ENTRIES.values():
        assert e.get("case") or str(e.get("not_judged") or "").strip(), e["id"]
        assert not (e.get("case") and e.get("not_judged")), e["id"]
        assert e["source"].startswith("https://"), e["id"]
    for c in JUDGED:
        model = Path(c.model) if Path(c.model).is_absolute() else CORPUS_DIR / c.model
        assert model.is_file(), (c.id, c.model)
        assert _vision(c.model) is not None, c.id  # judged as a multimodal model


@pytest.mark.parametrize("case", JUDGED, ids=[c.id for c in JUDGED])
def test_verdict_is_the_engines(case):
    rep = predict(case)
    assert rep.fits is case.started, rep.reason


@pytest.mark.parametrize("case, figure", COMPARED, ids=[f"{c.id}-{f}" for c, f in COMPARED])
def test_logged_figure_within_10_percent(case, figure):
    logged = _logged(ENTRIES[case.id])[figure]
    predicted = _predicted(predict(case), figure)
    error = predicted / logged - 1
    bound, why = KNOWN_MISSES.get((case.id, figure), (TOLERANCE, ""))
    assert abs(error) <= bound, f"{figure}: {predicted:,.2f} predicted vs {logged:,.2f} logged ({error:+.1%}) {why}"
    if (case.id, figure) in KNOWN_MISSES:
        assert abs(error) > TOLERANCE, "a known miss now within 10%: take it off KNOWN_MISSES"


def test_an_out_of_memory_profile_needed_at_least_what_the_oom_shows():
    """A profiling pass that ran out of memory had allocated its weights and part of its peak when it
    asked for more: the predicted peak cannot be below that (`activation_at_least_gib`)."""
    bounded = [c for c in JUDGED if ENTRIES[c.id]["case"].get("activation_at_least_gib")]
    assert bounded
    for c in bounded:
        floor = ENTRIES[c.id]["case"]["activation_at_least_gib"]
        assert _predicted(predict(c), "activation_peak_gib") >= floor, c.id


def _index_multimodal() -> list[EngineLogCase]:
    return [c for c in engine_log_cases(CORPUS_DIR)[0]
            if c.kv_cache_tokens and _vision(c.model) is not None]


def test_multimodal_kv_within_10_percent_on_at_least_3_logs():
    """Issue 27: at least 3 multimodal start-up logs whose KV cache is predicted within 10%, the encoder's
    profiling pass included, from more than one vLLM engine generation."""
    within = []
    for c in _index_multimodal():
        if abs(predict(c).kv_cache.capacity_tokens / c.kv_cache_tokens - 1) <= TOLERANCE:
            within.append(c)
    for c in JUDGED:
        logged = _logged(ENTRIES[c.id])
        kv = [f for f in ("kv_cache_gib", "num_gpu_blocks", "kv_cache_tokens") if f in logged]
        rep = predict(c)
        if kv and all(abs(_predicted(rep, f) / logged[f] - 1) <= TOLERANCE for f in kv):
            within.append(c)
    assert len(within) >= 3, [c.id for c in within]
    assert len({engine_rules(c.engine, c.engine_version).era.generation for c in within}) >= 2  # V0 and V1
