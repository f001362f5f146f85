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


VISION_WORDS = ("vision_tower", "vision_model", "visual", "multi_modal_projector", "image_newline")


def _layer_list(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The decoder's layers: a ModuleList of num_layers outside the vision tower (a multimodal
    model's tower may have as many blocks)."""
    import torch

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers and not any(w in name for w in VISION_WORDS):
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
    # OPT-1.3b's layout (pre-LN, final LayerNorm, positions offset by 2, tied head) and OPT-350m's
    # post-LN blocks without a final LayerNorm (its narrower word embeddings aside).
    "opt_pre_ln": dict(
        model_type="opt", vocab_size=1000, hidden_size=128, ffn_dim=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=128, do_layer_norm_before=True,
    ),
    "opt_post_ln": dict(
        model_type="opt", vocab_size=1000, hidden_size=128, ffn_dim=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=128, do_layer_norm_before=False,
    ),
    "opt_350m_style": dict(
        model_type="opt", vocab_size=1000, hidden_size=128, ffn_dim=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=64, do_layer_norm_before=False,
    ),
    # Nemotron-4 / Minitron: a gate-free squared-ReLU MLP, LayerNorm1P with biases, half-rotary heads;
    # once with the linears' biases on
    "nemotron": dict(
        model_type="nemotron", vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
    ),
    "nemotron_biases": dict(
        model_type="nemotron", vocab_size=1000, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=True,
    ),
    # BLOOM: ALiBi, the embeddings' own LayerNorm, fused QKV and a GeLU MLP of 4h, all with biases, tied head
    "bloom": dict(model_type="bloom", vocab_size=1000, hidden_size=128, n_layer=2, n_head=4),
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


# ----- issue 27 families: real configs (shardplan/validation/corpus/models) and small ones, built by their own class ---

from conftest import REPO  # noqa: E402

DATA_MODELS = REPO / "shardplan" / "validation" / "corpus" / "models"
ISSUE27_FILES = [
    "gemma-3-1b-it", "gemma-3-4b-it", "gpt-oss-120b", "llama-4-maverick-17b-128e-instruct", "llama-4-scout-17b-16e",
    "llava-1.5-7b", "mistral-small-3-24b-flux2-text-encoder", "qwen2.5-vl-7b-qwen-image-text-encoder",
    "qwen3-next-80b-a3b-thinking", "llama-3.2-11b-vision-instruct",
]


def _build_by_architecture(hf_config: dict) -> torch.nn.Module:
    """The model class the config's `architectures` names (composites are not causal-LM autos)."""
    import torch
    import transformers
    from transformers import AutoConfig

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    arch = cfg.pop("architectures")[0]
    cfg.pop("quantization_config", None)  # MXFP4 needs kernels to build; the shapes are the bf16 ones
    text = cfg.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("attn_temperature_tuning"), int):
        # Llama 4 Scout's published config writes 4 where transformers >= 5's strict config takes a
        # bool; it switches a runtime scaling on and shapes no parameter.
        cfg["text_config"] = {**text, "attn_temperature_tuning": bool(text["attn_temperature_tuning"])}
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        return getattr(transformers, arch)(config)


def _language_numel(model: torch.nn.Module) -> int:
    """Parameters outside the vision tower and projector: the text model and lm_head."""
    return sum(p.numel() for n, p in model.named_parameters() if not any(w in n for w in VISION_WORDS))


def _check_against_meta(spec, model) -> None:
    import transformers

    counts = count_params(spec)
    assert _stored_numel(model) == counts.total, f"transformers {transformers.__version__}"
    assert _stored_numel(model) - _language_numel(model) == counts.vision + counts.projector
    layers = _layer_list(model, spec.num_layers)
    from shardplan.cost.params import layer_numel

    for i in sorted({0, 1, 2, 3, spec.num_layers - 1} & set(range(spec.num_layers))):
        assert _stored_numel(layers[i]) == layer_numel(spec, i), f"layer {i}"


@pytest.mark.parametrize("name", ISSUE27_FILES)
def test_issue27_real_configs_match_meta_model(name):
    path = DATA_MODELS / f"{name}.yaml"
    hf_config = read_structured(path)["hf_config"]
    spec = load_model(str(path)).spec
    _check_against_meta(spec, _build_by_architecture(hf_config))


def test_qwen_vl_top_level_copies_of_text_config_raise_no_unknown_key_warning():
    """Qwen2.5-VL re-saved by transformers >= 4.53 repeats the text keys beside text_config, which
    alone transformers reads: equal copies are not reported, a differing one says which value counts."""
    from shardplan.specs.hf import translate

    hf_config = read_structured(DATA_MODELS / "qwen2.5-vl-7b-qwen-image-text-encoder.yaml")["hf_config"]
    warnings = translate(hf_config, "qwen2.5-vl").warnings
    assert not any("not understood" in w for w in warnings), warnings
    assert warnings == ("config key 'sliding_window' (32768) is ignored, as transformers ignores it: its text "
                        "model reads text_config.sliding_window (None)",)
    sliding = {**hf_config["text_config"], "layer_types": ["sliding_attention"] * 28}
    assert any("text_config.layer_types" in w for w in translate({**hf_config, "text_config": sliding}, "x").warnings)


ISSUE27_SMALL = {
    "qwen2_vl_flat": dict(model_type="qwen2_vl", architectures=["Qwen2VLForConditionalGeneration"], vocab_size=100,
                          hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4,
                                                                    mlp_ratio=2, model_type="qwen2_vl")),
    "qwen2_5_vl": dict(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"],
                       text_config=dict(vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2),
                       vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, num_heads=4, intermediate_size=40)),
    "llava_next": dict(model_type="llava_next", architectures=["LlavaNextForConditionalGeneration"],
                       text_config=dict(model_type="mistral", vocab_size=100, hidden_size=64, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                       vision_config=dict(model_type="clip_vision_model", hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=64, image_size=56, patch_size=14)),
    "mistral3": dict(model_type="mistral3", architectures=["Mistral3ForConditionalGeneration"],
                     text_config=dict(model_type="mistral", vocab_size=100, hidden_size=64, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                     vision_config=dict(model_type="pixtral", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, image_size=56, patch_size=14, head_dim=8),
                     multimodal_projector_bias=True, vision_feature_layer=[-1, -2]),
    "phimoe": dict(model_type="phimoe", architectures=["PhimoeForCausalLM"], vocab_size=100, hidden_size=64,
                   intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True),
    "qwen3_next": dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=100, hidden_size=64,
                       intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, mlp_only_layers=[1]),
    "llama4_interleaved": dict(model_type="llama4", architectures=["Llama4ForConditionalGeneration"],
                               text_config=dict(vocab_size=100, hidden_size=64, intermediate_size=48,
                                                intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4,
                                                num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                                interleave_moe_layer_step=2),
                               vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=64, image_size=56, patch_size=14,
                                                  projector_input_dim=40, projector_output_dim=48, vision_output_dim=24)),
    "mllama_two_tiles": dict(model_type="mllama", architectures=["MllamaForConditionalGeneration"],
                             text_config=dict(vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              cross_attention_layers=[1, 3], pad_token_id=0),
                             vision_config=dict(hidden_size=32, num_hidden_layers=3, num_global_layers=2,
                                                attention_heads=4, intermediate_size=64, image_size=28, patch_size=14,
                                                max_num_tiles=2, vision_output_dim=96,
                                                intermediate_layers_indices=[0, 1],
                                                supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])),
    "gemma3_siglip_head": dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                               text_config=dict(vocab_size=100, hidden_size=64, intermediate_size=48,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=16),
                               vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=64, image_size=56, patch_size=14)),
}


@pytest.mark.parametrize("label", sorted(ISSUE27_SMALL))
def test_issue27_small_configs_match_meta_model(label):
    from shardplan.specs.hf import spec_from_hf_config

    cfg = ISSUE27_SMALL[label]
    _check_against_meta(spec_from_hf_config(cfg, label), _build_by_architecture(cfg))


def test_unknown_model_type_falls_back_to_transformers_on_meta(capsys):
    """OLMo has no translation: transformers builds it and the total is the module's, exactly."""
    from shardplan.specs.hf import translate
    from shardplan.specs.model import ModelSpec

    cfg = dict(model_type="olmo", architectures=["OlmoForCausalLM"], vocab_size=100, hidden_size=64,
               intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    t = translate(cfg, "olmo-tiny")
    assert any("spec derived from transformers" in n and "meta device" in n for n in t.notes)
    spec = ModelSpec(**t.fields)
    assert count_params(spec).total == _stored_numel(_build_by_architecture(cfg))
    assert spec.num_layers == 2 and spec.kv_heads == 2 and spec.vocab_size == 100


# bigscience/bloom's config.json (huggingface.co/bigscience/bloom/blob/main/config.json), key for key
BLOOM_176B = dict(
    apply_residual_connection_post_layernorm=False, attention_dropout=0.0, attention_softmax_in_fp32=True,
    bias_dropout_fusion=True, bos_token_id=1, eos_token_id=2, hidden_dropout=0.0, hidden_size=14336,
    initializer_range=0.02, layer_norm_epsilon=1e-05, masked_softmax_fusion=True, model_type="bloom", n_head=112,
    n_inner=None, n_layer=70, offset_alibi=100, pad_token_id=3, pretraining_tp=4, skip_bias_add=True,
    skip_bias_add_qkv=False, slow_but_exact=False, transformers_version="4.21.0", unk_token_id=0, use_cache=True,
    vocab_size=250880, architectures=["BloomForCausalLM"],
)


def test_bloom_176b_reads_every_key_and_counts_the_model_cards_parameters():
    """BLOOM's model card: 176,247,271,424 parameters (huggingface.co/bigscience/bloom, "Model Details");
    transformers' BloomForCausalLM on the meta device agrees, layer by layer."""
    from shardplan.specs.hf import spec_from_hf_config, translate

    assert translate(BLOOM_176B, "bloom").warnings == ()
    spec = spec_from_hf_config(BLOOM_176B, "bloom")
    assert count_params(spec).total == 176_247_271_424
    small = dict(BLOOM_176B, hidden_size=128, n_head=4, n_layer=2, vocab_size=1000)
    _check_against_meta(spec_from_hf_config(small, "bloom-small"), _build_by_architecture(small))
