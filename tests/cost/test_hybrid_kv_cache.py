"""vLLM V1's hybrid KV cache manager against the arithmetic of its source (docs/research/vllm-hybrid-kv.md).

A small spec, 2 full-attention and 5 sliding-window layers (window 64), worked by hand as
vllm/v1/core/kv_cache_utils.py (v0.9.1-v0.21.0) does it:
  groups: size min(2, 5) = 2; one full group, cdiv(5, 2) = 3 sliding groups (the last padded): 4 groups
  pool:   blocks = kv // (page x 2), page = 16 tokens x 1024 bytes
  one request of L = 1000 (max_num_batched_tokens 256): full cdiv(1000, 16) = 63 blocks; sliding
          cdiv(min(64 - 1 + 256, 1000), 16) + 1 = 21 blocks; 63 + 3 x 21 = 126 blocks
"""

from __future__ import annotations

import pytest

from shardplan.cost.kv import sliding_window_blocks_per_request, vllm_kv_cache_groups
from shardplan.cost.memory_serving import vllm_kv_pool
from shardplan.cost.workload import InferenceWorkload
from shardplan.knowledge.load import engine_rules
from shardplan.specs.loading import load_model
from shardplan.specs.model import LayerType

F, S = LayerType.FULL, LayerType.SLIDING
PER_LAYER_TOKEN_BYTES = 1024.0
PAGE_BYTES = 16 * PER_LAYER_TOKEN_BYTES
KV_BYTES = 1000 * PAGE_BYTES * 2 + 5000.0  # 1000 blocks of a 2-layer group, and a remainder


@pytest.fixture(scope="module")
def spec():
    base = load_model("debug").spec
    return base.model_copy(update={"num_layers": 7, "sliding_window": 64, "layer_types": (S, S, F, S, S, F, S)})


def _wl(**kw) -> InferenceWorkload:
    return InferenceWorkload(block_size=16, max_num_batched_tokens=256, max_model_len=1000, **kw)


def test_groups_follow_the_smaller_type_with_padding():
    assert vllm_kv_cache_groups(2, 5) == (2, 1, 3)
    assert vllm_kv_cache_groups(10, 52) == (10, 1, 6)  # Gemma 3 27B: 7 groups of 10 (8 layers padding)
    assert vllm_kv_cache_groups(18, 18) == (18, 1, 1)  # gpt-oss-120b
    assert vllm_kv_cache_groups(0, 32) == (32, 0, 1)  # Mistral 7B v0.1: every layer slides


def test_sliding_window_blocks_per_request():
    assert sliding_window_blocks_per_request(64, 1000, 256, 16) == 21
    assert sliding_window_blocks_per_request(128, 131072, 8192, 16) == 521  # gpt-oss on an H100 (8,192 batched)
    assert sliding_window_blocks_per_request(4096, 2048, 8192, 16) == 129  # capped by max_model_len, + 1


def test_hybrid_pool_as_vllm_sizes_and_logs_it(spec):
    pool = vllm_kv_pool(spec, _wl(hybrid_kv_cache=True), range(7), PER_LAYER_TOKEN_BYTES, 0.0, 0.0, KV_BYTES, 1000)
    assert pool.blocks == 1000
    assert pool.tokens == 1000 // 4 * 16 == 4000  # num_blocks // len(kv_cache_groups) * block_size
    assert pool.concurrency == pytest.approx(1000 / 126)
    assert pool.bytes_per_sequence == 126 * PAGE_BYTES * 2  # padding included
    assert pool.needed_bytes == (2 * 63 + 5 * 21) * PAGE_BYTES  # check_enough_kv_cache_memory: layer by layer


def test_from_0_21_the_log_is_concurrency_times_max_model_len(spec):
    wl = _wl(hybrid_kv_cache=True, kv_tokens_reported="concurrency")
    pool = vllm_kv_pool(spec, wl, range(7), PER_LAYER_TOKEN_BYTES, 0.0, 0.0, KV_BYTES, 1000)
    assert pool.tokens == int(1000 / 126 * 1000) == 7936


def test_without_the_hybrid_manager_every_layer_holds_the_sequence(spec):
    pool = vllm_kv_pool(spec, _wl(), range(7), PER_LAYER_TOKEN_BYTES, 0.0, 0.0, KV_BYTES, 1000)
    assert pool.blocks == int(KV_BYTES // (7 * PAGE_BYTES)) == 285
    assert pool.tokens == 285 * 16
    assert pool.concurrency == pytest.approx(KV_BYTES / (63 * 7 * PAGE_BYTES))
    # V1's start-up check still counts the sliding layers by their window (it runs before the unifying).
    assert pool.needed_bytes == (2 * 63 + 5 * 21) * PAGE_BYTES


def test_every_layer_sliding_is_one_group(spec):
    mistral_like = spec.model_copy(update={"layer_types": (S,) * 7})
    pool = vllm_kv_pool(mistral_like, _wl(hybrid_kv_cache=True), range(7), PER_LAYER_TOKEN_BYTES, 0.0, 0.0,
                        KV_BYTES, 1000)
    assert pool.blocks == 285
    assert pool.tokens == 285 * 16
    assert pool.concurrency == pytest.approx(285 / 21)


@pytest.mark.parametrize(("version", "hybrid", "reported"), [
    ("0.8.5", False, "blocks"), ("0.9.0", False, "blocks"), ("0.9.1", True, "blocks"), ("0.10.2", True, "blocks"),
    ("0.11.0", True, "blocks"), ("0.21.0", True, "concurrency")])
def test_the_rule_holds_from_0_9_1(version, hybrid, reported):
    era = engine_rules("vllm", version).era
    assert (era.hybrid_kv_cache, era.kv_tokens_reported) == (hybrid, reported)
    assert engine_rules("vllm", "0.6.4").era.hybrid_kv_cache is False  # V0


# --- The simulation's charge: a request holding t tokens takes t + charge x min(t, window) -------------

def _serving(spec_name: str = "llama-3.1-8b", batched_tokens: int | None = None):
    from dataclasses import replace

    from shardplan.cost import inputs
    from shardplan.cost.layout import Layout
    from shardplan.cost.step_model import StepModel
    from shardplan.specs.loading import load_hardware

    m, hw = load_model(spec_name).spec, load_hardware("h100-sxm-80gb")
    wl = inputs.inference_workload(
        engine=engine_rules("vllm", "0.11.0"), hw=hw, model_max_len=m.max_position_embeddings, max_model_len=8192,
        max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
        kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False, input_len=1024,
        output_len=128, batch_size=None)
    if batched_tokens is not None:
        wl = replace(wl, max_num_batched_tokens=batched_tokens)
    return wl, StepModel(m, hw, Layout(tp=1, pp=1, dp=1), wl, wl.max_num_batched_tokens, wl.max_num_seqs)


def test_a_burst_admits_as_many_requests_as_their_window_share_allows():
    """1,000-token prompts into 11,200 tokens of a full group's capacity, one sliding group per full
    group (gpt-oss) with a 144-token hold (window 128 + the straddled block): 1,144 a request, so 9
    run at once; counted without the sliding groups 11 would, with them holding every token 5. (A
    budget of 100,000 tokens a step admits whole prompts only.)"""
    from shardplan.cost.memory_serving import KvAccount
    from shardplan.cost.serving_load import Traffic, scheduler_for, simulate

    wl, model = _serving(batched_tokens=100_000)
    burst = Traffic(requests=((1000, 10),) * 30)
    peaks = {name: simulate(model, scheduler_for(wl, kv), burst).peak_running for name, kv in {
        "hybrid": KvAccount(11_200, 144, 1.0), "full only": KvAccount(11_200),
        "all hold": KvAccount(11_200, 10**9, 1.0)}.items()}
    assert peaks == {"hybrid": 9, "full only": 11, "all hold": 5}


def test_a_request_inside_the_window_pays_for_every_group_until_it_reaches_it():
    """One request of 100 prompt and 101 output tokens alone: at its last step it holds 199 tokens
    plus its window share, which stopped growing at 144 (charge 1): 199 + 144 + the step's one token
    = 344. A cache of 344 serves it without a preemption, one of 343 cannot."""
    from shardplan.cost.memory_serving import KvAccount
    from shardplan.cost.serving_load import Traffic, scheduler_for, simulate

    wl, model = _serving()
    alone = Traffic(requests=((100, 101),))
    ok = simulate(model, scheduler_for(wl, KvAccount(344, 144, 1.0)), alone)
    short = simulate(model, scheduler_for(wl, KvAccount(343, 144, 1.0)), alone)
    assert (ok.num_preemptions, ok.num_refused, ok.num_requests) == (0, 0, 1)
    assert short.num_preemptions + short.num_refused > 0
    # Without a window share the same request needs 200.
    assert simulate(model, scheduler_for(wl, 200), alone).num_preemptions == 0
    assert simulate(model, scheduler_for(wl, 199), alone).num_preemptions > 0


def test_the_window_share_is_returned_whatever_ends_a_request():
    """Under preemption and a stream of arrivals, every request still finishes, and a cache whose
    sliding share is charged serves the load more slowly than one without it (it holds fewer)."""
    from shardplan.cost.memory_serving import KvAccount
    from shardplan.cost.serving_load import Traffic, scheduler_for, simulate

    wl, model = _serving()
    reqs = tuple((60 + 37 * i % 500, 20 + 53 * i % 300) for i in range(300))
    traffic = Traffic(requests=reqs, request_rate_per_second=200.0, seed=4)
    windowed = simulate(model, scheduler_for(wl, KvAccount(12_000, 144, 6.0)), traffic)
    plain = simulate(model, scheduler_for(wl, 12_000), traffic)
    assert windowed.num_requests == plain.num_requests == 300
    assert windowed.num_preemptions > 0  # the preempted requests' shares came back: all 300 finished
    assert windowed.peak_running < plain.peak_running
    assert windowed.output_tokens_per_second < plain.output_tokens_per_second


@pytest.mark.parametrize(("version", "said", "tokens"), [
    # Gemma 2 9B at 8,192 tokens on one H100: 21 full and 21 sliding layers (window 4,096), one group
    # of each; every layer holding the sequence (0.8.5) gives about half the tokens 0.9.1+ logs.
    ("0.8.5", "holds a request's whole sequence", None),
    ("0.10.2", "up to 8,192 scheduled tokens", "blocks"),
    ("0.26.0", "up to 2 x 8,192 scheduled tokens", "concurrency"),
])
def test_the_answer_says_how_the_version_caches_sliding_window_layers(cli, version, said, tokens):
    res = cli("estimate", "gemma-2-9b", "-H", "h100-sxm-80gb", "--engine", "vllm", "--engine-version", version,
              "--max-model-len", "8192", "--json")
    assert res.exit_code == 0, res.stderr
    d = res.json()
    notes = [a for a in d["assumptions"] if "sliding-window" in a]
    assert len(notes) == 1 and said in notes[0], notes
    assert d["workload"]["kv_tokens_reported"] == (tokens or "blocks")
    assert d["workload"]["hybrid_kv_cache"] is (tokens is not None)


def test_a_model_without_sliding_windows_gets_no_such_line(cli):
    res = cli("estimate", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--engine", "vllm", "--json")
    assert res.exit_code == 0, res.stderr
    assert not [a for a in res.json()["assumptions"] if "sliding-window" in a]
