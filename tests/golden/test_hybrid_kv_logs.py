"""vLLM's hybrid KV cache manager against the start-up logs of sliding-window models.

shardplan/validation/corpus/engine_logs/sliding_window_logs.yaml holds Gemma 3 and gpt-oss logs from vLLM
0.10.1 to 0.26.0 (their sources in the file). Each `check:` gives the KV memory the log printed
("Available KV cache memory: X GiB", rounded to 0.01 GiB, or the pool's blocks where the log also
printed them); from it `vllm_kv_pool` must give what the log printed next: "GPU KV cache size: N
tokens" (blocks // KV cache groups x 16 up to 0.20.0, int(concurrency x max_model_len) from 0.20.1) and
"Maximum concurrency for L tokens per request: Cx" (blocks / the blocks one request takes in each
group; a sliding group's window plus one chunk of the token budget, two from 0.26 with async scheduling). Padding layers (Gemma 3: 52 sliding layers in 6 groups of 10) count in both.

The rule of vLLM before 0.9.1 (every layer holding the whole sequence) misses every one of the
0.10-0.13 logs on the same memory, in its tokens or its concurrency (the last test).
"""

from __future__ import annotations


import pytest
import yaml

from shardplan.cost.kv import vllm_kv_cache_groups
from shardplan.cost.memory_serving import kv_bytes_per_token_per_layer_per_rank, vllm_kv_pool
from shardplan.cost.workload import InferenceWorkload
from shardplan.knowledge.load import engine_rules
from shardplan.specs.loading import load_model
from shardplan.specs.model import LayerType
from shardplan.validation.shipped import CORPUS_DIR

LOGS = CORPUS_DIR / "engine_logs" / "sliding_window_logs.yaml"
GIB = 1024**3

# id -> the mechanism the rules lack (the miss is asserted, so a fix shows up). The MedGemma 27B log
# of 0.26.0 (2.87x) left this list when the 0.26 era took two in-flight batches per sliding group
# (kv_cache_interface.py SlidingWindowSpec with VllmConfig.max_in_flight_tokens, read at 0.26.0).
KNOWN_MISSES: dict[str, str] = {}


def _gemma3_27b():
    """google/gemma-3-27b-it's text config: 62 layers, 16 KV heads of 128, a 1,024-token window on five
    layers of every six (sliding_window_pattern 6) - the KV shape only; the rest is Gemma 3 4B's."""
    base = load_model(str(CORPUS_DIR / "models" / "gemma-3-4b-it.yaml")).spec
    types = tuple(LayerType.FULL if (i + 1) % 6 == 0 else LayerType.SLIDING for i in range(62))
    return base.model_copy(update={"num_layers": 62, "num_kv_heads": 16, "head_dim": 128, "sliding_window": 1024,
                                   "layer_types": types})


def _spec(ref: str):
    if ref == "gemma-3-27b":
        return _gemma3_27b()
    return load_model(str(CORPUS_DIR / ref)).spec


def _checks():
    return [pytest.param(e["id"], e["check"], id=e["id"]) for e in yaml.safe_load(LOGS.read_text()) if "check" in e]


def _era(version: str):
    """The era of `version`; past the newest release shardplan knows, the newest era, which has no
    upper bound."""
    from shardplan.knowledge.load import engine_file
    from shardplan.knowledge.schema import parse_version

    newest = engine_file("vllm").newest
    return engine_rules("vllm", newest if parse_version(version) > parse_version(newest) else version).era


def _pool(spec, check, kv_bytes, hybrid=None, in_flight=None):
    era = _era(check["version"])
    wl = InferenceWorkload(block_size=16, max_num_batched_tokens=check["max_num_batched_tokens"],
                           max_model_len=check["max_model_len"],
                           hybrid_kv_cache=era.hybrid_kv_cache if hybrid is None else hybrid,
                           kv_tokens_reported=era.kv_tokens_reported,
                           sliding_window_in_flight_batches=(era.sliding_window_in_flight_batches if in_flight is None
                                                             else in_flight))
    per_layer_token = kv_bytes_per_token_per_layer_per_rank(spec, check["tp"], check["kv_bytes_per_element"])
    return vllm_kv_pool(spec, wl, range(spec.num_layers), per_layer_token, 0.0, 0.0, kv_bytes, check["max_model_len"])


def _predicted(log_id: str, check: dict, hybrid=None, in_flight=None):
    """(tokens low, tokens high, concurrency low, concurrency high) over the KV memory the log may have
    had: the printed blocks exactly, else the printed GiB +- 0.005."""
    spec = _spec(check["model"])
    if "num_gpu_blocks" in check:
        per_layer_token = kv_bytes_per_token_per_layer_per_rank(spec, check["tp"], check["kv_bytes_per_element"])
        size, _, _ = vllm_kv_cache_groups(spec.num_layers - spec.num_sliding_layers, spec.num_sliding_layers)
        lo = hi = check["num_gpu_blocks"] * 16 * per_layer_token * size  # a block spans one layer of each group
    else:
        lo, hi = (check["available_kv_gib"] - 0.005) * GIB, (check["available_kv_gib"] + 0.005) * GIB
    a, b = _pool(spec, check, lo, hybrid, in_flight), _pool(spec, check, hi, hybrid, in_flight)
    return a.tokens, b.tokens, a.concurrency, b.concurrency


@pytest.mark.parametrize(("log_id", "check"), _checks())
def test_logged_kv_tokens_and_concurrency_follow_the_versions_rules(log_id, check):
    t_lo, t_hi, c_lo, c_hi = _predicted(log_id, check)
    tokens_ok, conc_ok = _matches(check, (t_lo, t_hi, c_lo, c_hi))
    if log_id in KNOWN_MISSES:
        assert not (tokens_ok and conc_ok), f"{log_id} now matches: take it out of KNOWN_MISSES"
        return
    assert tokens_ok, f"{log_id}: logged {check['kv_tokens']:,} tokens, predicted {t_lo:,}..{t_hi:,}"
    assert conc_ok, f"{log_id}: logged {check['max_concurrency']}x, predicted {c_lo:.3f}..{c_hi:.3f}x"


def _matches(check: dict, predicted: tuple[int, int, float, float]) -> tuple[bool, bool]:
    t_lo, t_hi, c_lo, c_hi = predicted
    tokens_ok = t_lo <= check["kv_tokens"] <= t_hi
    conc_ok = "max_concurrency" not in check or round(c_lo, 2) - 0.01 <= check["max_concurrency"] <= round(c_hi, 2) + 0.01
    return tokens_ok, conc_ok


def test_every_layer_holding_the_sequence_misses_the_hybrid_logs():
    """The rule before vLLM 0.9.1 on the same memory: every 0.10-0.13 log printed a token count or a
    concurrency it cannot give (gpt-oss's tokens agree by construction - one full and one sliding
    group of 18 layers print blocks // 2 x 16 - but its 284.25x is 161x under that rule)."""
    for param in _checks():
        log_id, check = param.values
        if _era(check["version"]).kv_tokens_reported != "blocks":
            continue
        assert not all(_matches(check, _predicted(log_id, check, hybrid=False))), log_id


def test_the_0_26_log_needs_two_batches_in_flight_per_sliding_group():
    """MedGemma 27B (FP8 KV, L40S, 65,536 tokens, 2,048 batched) on vLLM 0.26.0 logged 188,347 tokens and
    2.87x; its era sizes each sliding group for window - 1 + 2 x 2,048 tokens (VllmConfig.max_in_flight_tokens
    with async scheduling). One chunk, the rule to 0.25.1, gives 3.29x and 215,804 tokens."""
    (log_id, check), = [p.values for p in _checks() if p.values[1]["version"] == "0.26.0"]
    assert _era("0.26.0").sliding_window_in_flight_batches == 2
    assert all(_matches(check, _predicted(log_id, check)))
    t_lo, t_hi, c_lo, c_hi = _predicted(log_id, check, in_flight=1)
    assert not any(_matches(check, (t_lo, t_hi, c_lo, c_hi)))
    assert round(c_lo, 2) == 3.29


def _gpt_oss_20b():
    """gpt-oss-20b's KV shape: gpt-oss-120b's attention (8 KV heads of 64, a 128-token window on every
    other layer) over 24 layers, as the logs' GGUF metadata prints it (block_count 24, n_swa 128)."""
    base = load_model(str(CORPUS_DIR / "models" / "gpt-oss-120b.yaml")).spec
    return base.model_copy(update={"num_layers": 24, "layer_types": base.layer_types[:24]})


@pytest.mark.parametrize("entry", [e for e in yaml.safe_load(LOGS.read_text()) if "llamacpp_check" in e],
                         ids=lambda e: e["id"])
def test_llamacpp_sliding_layers_get_their_window_and_a_ubatch(entry):
    """llama.cpp's iSWA cache: the full layers hold n_ctx cells, the sliding ones min(n_ctx,
    pad(n_swa x sequences + n_ubatch, 256)); the KV memory the log prints, to the MiB."""
    from shardplan.cost import inputs
    from shardplan.cost.layout import Layout
    from shardplan.cost.memory_serving import iswa_cells, serving_memory
    from shardplan.specs.loading import load_hardware

    check = entry["llamacpp_check"]
    spec, hw = _gpt_oss_20b(), load_hardware("h100-sxm-80gb")
    wl = inputs.inference_workload(
        engine=engine_rules("llamacpp"), hw=hw, model_max_len=spec.max_position_embeddings,
        max_model_len=check["n_ctx"], max_num_seqs=check["n_seq"], max_num_batched_tokens=check["n_ubatch"],
        gpu_memory_utilization=None, block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None,
        enforce_eager=False, input_len=1024, output_len=128, batch_size=None,
        checkpoint_format=spec.expert_dtype, sliding_window=True)
    assert iswa_cells(spec, wl, check["n_ctx"]) == check["swa_cells"]
    kv = serving_memory(spec, hw, Layout(tp=1, pp=1, dp=1), wl).ranks[0].breakdown.kv_cache
    assert kv / 2**20 == pytest.approx(check["kv_mib"], abs=0.01)
    # Every layer holding n_ctx cells, as before, would have been twice the memory.
    assert check["kv_mib"] < 0.51 * 24 * check["n_ctx"] * 2 * 8 * 64 * 2 / 2**20
