"""Qwen3-Next's Gated DeltaNet layers in the compute model and the serving KV pool, worked by hand
on a small Qwen3-Next config (tests/data/models/tiny-qwen3-next.yaml, read by the real loader): a linear-
attention layer runs its own projections as GEMMs and the chunked delta rule instead of softmax
attention, so its FLOPs differ from a full-attention layer's by amounts derived here, and do not
grow with the context; only the full-attention layers keep KV, the others one state a sequence."""

from __future__ import annotations

import math

import pytest
from conftest import REPO

from shardplan.cost.compute import DELTA_RULE_CHUNK_TOKENS, Work, layer_forward, layers_forward
from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost.workload import InferenceWorkload
from shardplan.specs.loading import load_hardware, load_model
from shardplan.specs.model import ModelSpec

# tests/data/models: two full-attention layers (3 and 7) among six Gated DeltaNet layers, every layer MoE.
TINY_QWEN3_NEXT = str(REPO / "tests" / "data" / "models" / "tiny-qwen3-next.yaml")
H = 256
KEY_DIM, VALUE_DIM, VALUE_HEADS, K, V = 4 * 32, 8 * 32, 8, 32, 32
LINEAR, FULL = 0, 3  # a linear-attention layer and a full-attention layer, both MoE
BF16 = 2


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return load_model(TINY_QWEN3_NEXT).spec


@pytest.fixture(scope="module")
def hw():
    return load_hardware("h100-sxm-80gb")


def _prefill(num_seqs: int, q_len: int) -> Work:
    return Work(tokens=num_seqs * q_len, num_seqs=num_seqs, q_len=q_len, kv_len=q_len, decode=False)


def _decode(num_seqs: int, kv_len: int) -> Work:
    return Work(tokens=num_seqs, num_seqs=num_seqs, q_len=1, kv_len=kv_len, decode=True)


def test_the_tiny_spec_has_the_layer_pattern_the_figures_assume(spec):
    assert [spec.is_linear_attention_layer(i) for i in range(8)] == [True, True, True, False] * 2
    assert spec.num_moe_layers == 8 and spec.attention_output_gate


def test_a_linear_layer_differs_from_a_full_layer_by_its_projections_and_its_mixer(spec, hw):
    seqs, q_len = 2, 128
    tokens = seqs * q_len
    work = _prefill(seqs, q_len)
    lin = layer_forward(spec, hw, Layout(), work, LINEAR)
    full = layer_forward(spec, hw, Layout(), work, FULL)
    # Projections, 2 x tokens x in x out each:
    # linear: in_proj_qkvz h -> 2*128 + 2*256 = 768, in_proj_ba h -> 2*8 = 16, out_proj 256 -> h
    linear_gemms = 2 * tokens * (H * 768 + H * 16 + 256 * H)
    # full: q_proj with its output gate h -> 2*4*64 = 512, k and v h -> 2*64 = 128, o 256 -> h
    full_gemms = 2 * tokens * (H * 512 + 2 * H * 128 + 256 * H)
    assert (linear_gemms, full_gemms) == (136_314_880, 134_217_728)
    # The delta rule, chunks of 64, per token and value head: 6KV + 64 (6K + 4V) + 64^2 / 3.
    c = DELTA_RULE_CHUNK_TOKENS
    assert c == 64
    delta_rule = tokens * VALUE_HEADS * (6 * K * V + c * (6 * K + 4 * V) + c * c / 3)
    assert delta_rule == pytest.approx(57_322_154.67, abs=0.01)
    # Causal flash attention: 2 x seqs x heads x q x (kv - (q - 1) / 2) x (d_qk + d_v).
    attention = 2 * seqs * 4 * q_len * (q_len - (q_len - 1) / 2) * (64 + 64)
    assert attention == 16_908_288
    assert lin.attention_flops == pytest.approx(delta_rule, rel=1e-12)
    assert full.attention_flops == pytest.approx(attention, rel=1e-12)
    assert lin.flops - full.flops == pytest.approx((linear_gemms - full_gemms) + (delta_rule - attention), rel=1e-12)
    # The MLP (MoE, shared expert, router) is the same in both: the difference is all of it.
    assert lin.flops - lin.attention_flops - linear_gemms == pytest.approx(full.flops - full.attention_flops - full_gemms)


def test_the_mixer_of_a_linear_layer_does_not_grow_with_the_context(spec, hw):
    short, long = (layer_forward(spec, hw, Layout(), _decode(4, n), LINEAR) for n in (100, 100_000))
    assert short.attention_flops == long.attention_flops == pytest.approx(4 * VALUE_HEADS * (6 * K * V + 6 * K + 4 * V + 1 / 3))
    assert short.attention_seconds == long.attention_seconds
    full_short, full_long = (layer_forward(spec, hw, Layout(), _decode(4, n), FULL) for n in (100, 100_000))
    assert full_long.attention_flops == 1000 * full_short.attention_flops  # attention reads every cached token


def test_tensor_parallelism_splits_the_value_heads(spec, hw):
    work = _prefill(1, 256)
    one, two = (layer_forward(spec, hw, Layout(tp=t), work, LINEAR) for t in (1, 2))
    assert two.attention_flops == pytest.approx(one.attention_flops / 2)


def test_layers_forward_costs_each_kind_once_and_counts_its_layers(spec, hw):
    work = _prefill(2, 128)
    total = layers_forward(spec, hw, Layout(), work, range(8))
    lin = layer_forward(spec, hw, Layout(), work, LINEAR)
    full = layer_forward(spec, hw, Layout(), work, FULL)
    assert total.flops == pytest.approx(6 * lin.flops + 2 * full.flops, rel=1e-12)
    assert total.attention_flops == pytest.approx(6 * lin.attention_flops + 2 * full.attention_flops, rel=1e-12)


def test_only_full_attention_layers_keep_kv_and_linear_layers_a_state_per_sequence(spec, hw):
    wl = InferenceWorkload(max_model_len=2048)
    mem = serving_memory(spec, hw, Layout(), wl)
    kv_layer_token = 2 * 2 * 64 * BF16  # K and V of 2 KV heads x 64
    assert mem.kv_bytes_per_token_per_rank == [2 * kv_layer_token]  # layers 3 and 7, not all 8
    # Per linear layer: 8 value heads x 32 x 32 delta-rule state + conv window 3 x (2*128 + 256).
    state = 8 * 32 * 32 + 3 * (2 * KEY_DIM + VALUE_DIM)
    assert state == 9728
    blocks = math.ceil(2048 / wl.block_size) * wl.block_size
    assert mem.kv_bytes_per_sequence == blocks * 2 * kv_layer_token + 6 * state * BF16
    half = serving_memory(spec, hw, Layout(tp=2), wl)
    assert half.kv_bytes_per_sequence == blocks * 2 * kv_layer_token / 2 + 6 * state * BF16 / 2
