"""Analytic parameter counts against the real architecture built by transformers on the meta
device (no memory, no weights): total, and per block for a dense and an MoE layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from shardplan.cost.params import count_params
from shardplan.specs.loading import bundled_names, load_model, model_specs_dir, read_structured

if TYPE_CHECKING:
    import torch

# transformers builds each model; torch and transformers are imported in the tests, so that the
# inner loop (`-m "not consumers ..."`) does not pay for importing them at collection.
pytestmark = pytest.mark.consumers


def _hf_bundled():
    out = []
    for name in bundled_names(model_specs_dir()):
        data = read_structured(model_specs_dir() / f"{name}.yaml")
        if data.get("hf_config"):
            out.append((name, data["hf_config"]))
    return out


def _stored_numel(module: torch.nn.Module) -> int:
    """Parameters (tied ones once) plus persistent buffers a checkpoint stores (e.g. DeepSeek-V3's
    e_score_correction_bias), but not rotary caches or masks."""
    n = sum(p.numel() for p in module.parameters())
    for mod in module.modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is not None and bname not in mod._non_persistent_buffers_set and "inv_freq" not in bname:
                if buf.is_floating_point():
                    n += buf.numel()
    return n


def _layer_list(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    import torch

    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers:
            return mod
    raise AssertionError("no ModuleList of the decoder layers found")


def _build(hf_config: dict) -> torch.nn.Module:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name,hf_config", _hf_bundled(), ids=[n for n, _ in _hf_bundled()])
def test_bundled_spec_count_matches_meta_model(name, hf_config):
    spec = load_model(name).spec
    counts = count_params(spec)
    model = _build(hf_config)
    import transformers

    assert _stored_numel(model) == counts.total, f"transformers {transformers.__version__}"
    layers = _layer_list(model, spec.num_layers)
    for i in (0, spec.num_layers - 1):
        expected = counts.per_layer_moe if spec.is_moe_layer(i) else counts.per_layer_dense
        assert _stored_numel(layers[i]) == expected, f"layer {i}"


def test_native_debug_spec_matches_meta_llama():
    spec = load_model("debug").spec
    model = _build(
        dict(
            model_type="llama",
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.kv_heads,
            head_dim=spec.attention_head_dim,
            tie_word_embeddings=spec.tie_word_embeddings,
        )
    )
    assert _stored_numel(model) == count_params(spec).total


# Families with no bundled spec: small configs of their shapes, checked the same way.
SMALL = {
    "qwen2_moe": dict(
        model_type="qwen2_moe", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=False,
    ),
    "phi3": dict(
        model_type="phi3", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5, tie_word_embeddings=False,
        pad_token_id=0,
    ),
    "deepseek_v2_no_q_lora": dict(
        model_type="deepseek_v2", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
    ),
    "falcon_7b_style": dict(
        model_type="falcon", vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False,
    ),
    "gemma": dict(
        model_type="gemma", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64,
    ),
    "gpt_neox_no_bias": dict(
        model_type="gpt_neox", vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, attention_bias=False, rotary_pct=0.25,
    ),
}


@pytest.mark.parametrize("label", sorted(SMALL))
def test_small_family_configs_match_meta_model(label):
    from shardplan.specs.hf import spec_from_hf_config

    cfg = SMALL[label]
    spec = spec_from_hf_config(cfg, label)
    counts = count_params(spec)
    model = _build(cfg)
    assert _stored_numel(model) == counts.total
    layers = _layer_list(model, spec.num_layers)
    for i in range(spec.num_layers):
        expected = counts.per_layer_moe if spec.is_moe_layer(i) else counts.per_layer_dense
        assert _stored_numel(layers[i]) == expected, f"layer {i}"
