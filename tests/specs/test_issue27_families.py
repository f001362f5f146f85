"""Issue 27 families without transformers: layer patterns, KV bytes worked by hand from the stored
configs, warnings for keys nothing reads, and bad input through the CLI."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO
from shardplan.cost.kv import kv_cache_bytes_per_sequence, kv_cache_bytes_per_token, kv_tokens_kept
from shardplan.cost.params import count_params
from shardplan.errors import UnsupportedModelError
from shardplan.specs.hf import translate
from shardplan.specs.loading import load_model
from shardplan.specs.model import LayerType, ModelSpec

MODELS = REPO / "shardplan" / "validation" / "corpus" / "models"
BF16 = 2.0


def _spec(name: str) -> ModelSpec:
    return load_model(str(MODELS / f"{name}.yaml")).spec


def test_gemma3_1b_five_local_to_one_global_and_kv_by_hand():
    spec = _spec("gemma-3-1b-it")
    # sliding_window_pattern 6: layers 5, 11, 17, 23 are global; the other 22 of 26 slide over 512.
    assert [i for i in range(26) if spec.layer_type(i) is LayerType.FULL] == [5, 11, 17, 23]
    per_token_layer = 2 * 1 * 256  # K and V, 1 KV head x head_dim 256
    assert kv_cache_bytes_per_token(spec, BF16) == 26 * per_token_layer * BF16
    # 32k tokens: 4 global layers keep all 32768, 22 sliding layers keep 512.
    assert kv_cache_bytes_per_sequence(spec, 32768, BF16) == (4 * 32768 + 22 * 512) * per_token_layer * BF16
    assert spec.tie_word_embeddings and spec.vocab_size == 262144 and spec.qk_norm.value == "per_head"


def test_gemma3_4b_text_tower_takes_transformers_defaults():
    spec = _spec("gemma-3-4b-it")
    # Omitted in the file: Gemma3TextConfig's 8 heads, 4 KV heads, head_dim 256, vocabulary 262208.
    assert (spec.num_attention_heads, spec.kv_heads, spec.attention_head_dim, spec.vocab_size) == (8, 4, 256, 262208)
    counts = count_params(spec)
    assert counts.vision == 416_866_032 and counts.projector == 1152 * 2560 + 1152
    assert sum(counts.by_component.values()) == counts.total == 4_300_079_472  # the model card's 4.3B


def test_gpt_oss_sinks_add_params_not_kv_and_windows_cap_kv():
    spec = _spec("gpt-oss-120b")
    assert spec.attention_sinks and spec.expert_dtype == "mxfp4"
    per_token_layer = 2 * 8 * 64
    assert kv_cache_bytes_per_token(spec, BF16) == 36 * per_token_layer * BF16
    # 18 sliding layers keep 128 tokens, 18 full layers keep all 131072.
    assert kv_cache_bytes_per_sequence(spec, 131072, BF16) == (18 * 128 + 18 * 131072) * per_token_layer * BF16
    no_sinks = spec.model_copy(update={"attention_sinks": False})
    assert count_params(spec).total - count_params(no_sinks).total == 36 * 64
    assert kv_cache_bytes_per_sequence(no_sinks, 4096, BF16) == kv_cache_bytes_per_sequence(spec, 4096, BF16)


def test_llama4_chunked_layers_cap_kv_at_the_chunk():
    spec = _spec("llama-4-scout-17b-16e")
    chunked = [i for i in range(48) if spec.layer_type(i) is LayerType.CHUNKED]
    assert len(chunked) == 36 and 3 not in chunked  # every 4th layer is a global NoPE layer
    per_token_layer = 2 * 8 * 128
    assert kv_tokens_kept(spec, 0, 100_000) == 8192 and kv_tokens_kept(spec, 3, 100_000) == 100_000
    assert kv_cache_bytes_per_sequence(spec, 100_000, BF16) == (36 * 8192 + 12 * 100_000) * per_token_layer * BF16
    assert count_params(spec).vision + count_params(spec).projector == 850_960_896 + 20_971_520


def test_qwen3_next_linear_layers_keep_a_constant_state():
    cfg = dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
               num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
               shared_expert_intermediate_size=512, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
               full_attention_interval=4)
    spec = ModelSpec(**translate(cfg, "qwen3-next").fields)
    assert sum(spec.is_linear_attention_layer(i) for i in range(48)) == 36
    kv_layer = 2 * 2 * 256  # full-attention layers: K and V of 2 heads x 256
    assert kv_cache_bytes_per_token(spec, BF16) == 12 * kv_layer * BF16
    # Per linear layer: 32 value heads x 128 x 128 delta-rule state + conv window 3 x (2*16*128 + 32*128).
    state = 32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)
    for n in (1, 1000, 200_000):
        assert kv_cache_bytes_per_sequence(spec, n, BF16) == (12 * n * kv_layer + 36 * state) * BF16


def test_llava_text_config_without_hidden_size_loads_llama_defaults():
    m = load_model(str(MODELS / "llava-1.5-7b.yaml"))
    s = m.spec
    # LlamaConfig defaults: hidden 4096, MLP 11008, 32 layers, 32 heads; vocabulary 32064 from the file.
    assert (s.hidden_size, s.intermediate_size, s.num_layers, s.num_attention_heads, s.vocab_size) == (
        4096, 11008, 32, 32, 32064)
    assert s.vision is not None and s.vision.model_type == "clip_vision_model"
    counts = count_params(s)
    assert counts.projector == 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert counts.total == counts.vision + counts.projector + (counts.total - counts.vision - counts.projector)
    assert counts.vision > 300e6


def test_an_unknown_key_is_named_in_a_warning_and_harmless_ones_are_not():
    cfg = dict(model_type="phimoe", vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_local_experts=4, num_experts_per_tok=2, torch_dtype="bfloat16",
               transformers_version="4.44", bos_token_id=1, frobnicate_layers=3)
    warnings = translate(cfg, "x").warnings
    assert len(warnings) == 1 and "frobnicate_layers" in warnings[0]
    nested = translate({"model_type": "llava", "text_config": {"model_type": "llama", "wiggle": 1},
                        "vision_config": {"model_type": "clip_vision_model"}}, "x").warnings
    assert any("text_config.wiggle" in w for w in nested)


def test_composite_counts_sum_to_the_total():
    for name in ("gemma-3-4b-it", "llava-1.5-7b", "llama-4-scout-17b-16e"):
        counts = count_params(_spec(name))
        assert sum(counts.by_component.values()) == counts.total
        assert counts.by_component["vision"] == counts.vision > 0


def test_bad_field_type_is_one_line_with_file_and_field_exit_2(cli, tmp_path):
    import yaml

    cfg = yaml.safe_load((MODELS / "gpt-oss-120b.yaml").read_text())["hf_config"]
    cfg["num_local_experts"] = "many"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    res = cli("estimate", str(path))
    assert res.exit_code == 2
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert str(path) in lines[0] and "num_local_experts" in lines[0] and "Traceback" not in res.stderr


def test_nested_bad_field_names_the_nested_key(cli, tmp_path):
    import yaml

    cfg = yaml.safe_load((MODELS / "llama-4-scout-17b-16e.yaml").read_text())["hf_config"]
    cfg["vision_config"]["projector_input_dim"] = 4096.5
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    res = cli("estimate", str(path))
    assert res.exit_code == 2 and "vision_config.projector_input_dim" in res.stderr


def test_without_transformers_the_fallback_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(UnsupportedModelError) as e:
        translate({"model_type": "olmo", "hidden_size": 64}, "x")
    assert "pip install 'shardplan[hf]'" in e.value.one_line()
