"""TGI sizes its KV cache from the memory free after a warm-up prefill (knowledge/engines/tgi.yaml,
cost/memory_serving.py `warmup_reserved_bytes`): what the warm-up's prompt log-probabilities hold per
logit by version and sharding, and what PyTorch's caching allocator still holds when TGI reads the
free memory. The two shipped start-up logs judge the whole rule (tests/golden/test_engine_logs_golden.py:
Llama 3.1 70B on 2 x A100 with TGI 2.4.0 logs 30,816 tokens); these pin each part."""

from __future__ import annotations

import dataclasses

import pytest

from shardplan.cost.inputs import inference_workload
from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import prompt_logit_bytes, serving_memory, warmup_reserved_bytes
from shardplan.knowledge.load import engine_rules
from shardplan.specs.loading import load_hardware, load_model
from shardplan.units import BYTES_PER_MIB

MODEL = load_model("llama-3.1-8b").spec
A100 = load_hardware("a100-sxm-80gb")


def tgi(version: str, spec=MODEL, hw=A100):
    return inference_workload(
        engine=engine_rules("tgi", version), hw=hw, model_max_len=spec.max_position_embeddings, max_model_len=None,
        max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
        kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False, input_len=1024, output_len=128,
        batch_size=None)


@pytest.mark.parametrize(("version", "tp", "expected"), [
    ("2.2.0", 1, 4.0),  # the logits and an out-of-place log_softmax
    ("2.4.0", 1, 2.0),  # TGI PR #2661: log_softmax in place
    ("3.3.0", 1, 2.0),
    ("2.2.0", 2, 6.0),  # the gathered head's transposed logits: a contiguous copy beside the output
    ("2.4.0", 2, 6.0),  # in place on a non-contiguous tensor: a contiguous temporary and a contiguous copy
    ("2.4.0", 8, 6.0),
])
def test_prompt_logit_bytes_by_version_and_sharding(version, tp, expected):
    assert prompt_logit_bytes(MODEL, Layout(tp=tp), tgi(version)) == expected


def test_a_vocabulary_the_shards_do_not_divide_keeps_the_whole_head_on_every_rank():
    odd = MODEL.model_copy(update={"vocab_size": 128_257})
    assert prompt_logit_bytes(odd, Layout(tp=2), tgi("2.4.0", odd)) == 2.0


def test_other_engines_hold_no_prompt_logits():
    wl = inference_workload(
        engine=engine_rules("vllm", "0.11.0"), hw=A100, model_max_len=MODEL.max_position_embeddings,
        max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None)
    assert prompt_logit_bytes(MODEL, Layout(tp=2), wl) == 0.0


def _parts(wl, tp):
    """(one logits copy, the live logits, the layers' cached segments' size above the live stream)."""
    tokens = wl.max_num_batched_tokens
    one = tokens * MODEL.vocab_size * 2
    free = warmup_reserved_bytes(MODEL, Layout(tp=tp), wl, room_bytes=float("inf")) - wl.attention_workspace_bytes
    flushed = warmup_reserved_bytes(MODEL, Layout(tp=tp), wl, room_bytes=0.0) - wl.attention_workspace_bytes
    return one, free, flushed


def test_the_allocator_keeps_the_layers_segments_beside_the_logits_unless_they_do_not_fit():
    wl = tgi("2.2.0")
    one, kept, flushed = _parts(wl, 1)
    tokens = wl.max_num_batched_tokens
    stream = 3 * tokens * MODEL.hidden_size * 2
    gate_up_and_act = 3 * tokens * MODEL.intermediate_size * 2
    # flushed: only the live tensors, the residual stream and two logits copies
    assert flushed == pytest.approx(stream + 2 * one)
    # kept: the layers' segments (the stream and the larger of attention and the gated MLP) beside the logits
    assert kept == pytest.approx(stream + gate_up_and_act + 2 * one)


def test_a_gathered_head_leaves_its_share_of_the_logits_cached():
    wl = tgi("2.4.0")
    one, kept, flushed = _parts(wl, 2)
    _, kept_tp1, _ = _parts(wl, 1)
    assert flushed == pytest.approx(3 * MODEL.hidden_size * wl.max_num_batched_tokens * 2 + 3 * one)
    # beside the three copies, the rank's half of the logits it gathered from (tensor_parallel.py gather_input)
    layers_tp2 = kept - flushed - one / 2
    assert 0 < layers_tp2 < kept_tp1 - one  # the layers' temporaries, smaller with tp 2 than with tp 1


def test_logits_no_larger_than_a_layer_temporary_reuse_its_segment():
    # A tiny vocabulary: each logits copy fits in the cached gate/up block, so nothing is added beside it.
    small = MODEL.model_copy(update={"vocab_size": 1024})
    wl = tgi("2.2.0", small)
    kept = warmup_reserved_bytes(small, Layout(tp=1), wl, room_bytes=float("inf"))
    flushed = warmup_reserved_bytes(small, Layout(tp=1), wl, room_bytes=0.0)
    assert kept == flushed


def test_flashinfer_workspace_from_2_3_0():
    assert tgi("2.2.0").attention_workspace_bytes == 0
    for version in ("2.3.0", "2.4.0", "3.3.0"):
        assert tgi(version).attention_workspace_bytes == 128 * BYTES_PER_MIB


def test_the_logged_70b_warmup_frees_the_cache_and_a_larger_device_keeps_it():
    """The shipped log of Llama 3.1 70B on 2 x A100 with TGI 2.4.0 (max_input_tokens 9,999): the 10,049-token
    warm-up's three logits copies (7.2 GiB a rank), the rank's cached half copy and the layers' segments
    exceed the ~9.6 GiB the allocator has beside the weights and the warm-up's KV, so the cache is freed
    and only the live tensors count (the log's 30,816 tokens are matched within 1%); on a device with
    twice the memory the same warm-up keeps them."""
    from shardplan.validation.predict import engine_log_inputs
    from shardplan.validation.shipped import CORPUS_DIR, engine_log_cases

    case = next(c for c in engine_log_cases(CORPUS_DIR)[0] if c.id == "tgi_a100x2_llama31_70b_v240")
    spec, hw, layout, wl = engine_log_inputs(case, CORPUS_DIR)[:4]
    act = serving_memory(spec, hw, layout, wl).ranks[0].breakdown.activations
    assert act == warmup_reserved_bytes(spec, layout, wl, room_bytes=0.0)
    roomy_hw = dataclasses.replace(hw, memory_capacity_bytes=hw.memory_capacity_bytes * 2)
    act_roomy = serving_memory(spec, roomy_hw, layout, wl).ranks[0].breakdown.activations
    assert act_roomy == warmup_reserved_bytes(spec, layout, wl, room_bytes=float("inf"))
    assert act_roomy - act == pytest.approx(2.0 * 1024**3, rel=0.25)  # the layers' segments and the half copy


def test_torch_log_softmax_on_a_transposed_tensor_allocates_two_more_copies():
    """The figure behind prefill_logit_bytes_gathered, from torch itself: log_softmax(x.T, out=x.T)
    (TGI >= 2.4.0 on a gathered head) allocates a contiguous temporary and a contiguous input copy; on a
    contiguous tensor it allocates nothing (the in-place case)."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    vocab, tokens = 512, 256
    one = vocab * tokens * 2

    def copies(make) -> int:
        """Allocations of a whole logits matrix during the call."""
        x = make()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
            torch.log_softmax(x, -1, out=x)
        return sum(1 for e in p.events() if e.name.startswith("aten::empty") and e.self_cpu_memory_usage == one)

    assert copies(lambda: torch.randn(tokens, vocab, dtype=torch.bfloat16)) == 0
    assert copies(lambda: torch.randn(vocab, tokens, dtype=torch.bfloat16).T) == 2
