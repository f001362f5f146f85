"""A config.json read strictly: booleans that are JSON booleans, KV heads that divide the attention
heads, a dtype shardplan knows, a warning for every key no translation reads (every family, not
only those with transformers' defaults), and one-line errors naming the file, the field and the fix
for files that are not a model. Through the CLI where the user meets them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK, InputFileError
from shardplan.specs.hf import TRANSLATORS, translate
from shardplan.specs.loading import bundled_names, load_model, model_specs_dir, read_structured
from shardplan.specs.model import ModelSpec

CORPUS = REPO / "shardplan" / "validation" / "corpus" / "models"
QA_LLAMA = {  # QA's Llama-3-8B-shaped config: 8 KV heads, untied
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rope_theta": 500000.0,
}
UNTIED_PARAMS = 7_241_732_096  # embedding and lm_head of 32000 x 4096 apart
TIED_PARAMS = UNTIED_PARAMS - 32000 * 4096
GQA_KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head_dim x bf16
MHA_KV_BYTES_PER_TOKEN = 32 * 2 * 32 * 128 * 2

_DENSE = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=64)
# A small config of each family TRANSLATORS reads (no transformers defaults under them).
FAMILIES = {
    "llama": dict(model_type="llama", **_DENSE),
    "mistral": dict(model_type="mistral", sliding_window=64, **_DENSE),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **_DENSE),
    "granitemoe": dict(model_type="granitemoe", num_local_experts=4, num_experts_per_tok=2, **_DENSE),
    "qwen2": dict(model_type="qwen2", **_DENSE),
    "qwen2_moe": dict(model_type="qwen2_moe", shared_expert_intermediate_size=96, **_DENSE, **_MOE),
    "qwen3": dict(model_type="qwen3", head_dim=32, **_DENSE),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=32, **_DENSE, **_MOE),
    "gemma": dict(model_type="gemma", head_dim=32, **_DENSE),
    "gemma2": dict(model_type="gemma2", head_dim=32, **_DENSE),
    "gpt2": dict(model_type="gpt2", vocab_size=1000, n_embd=128, n_layer=2, n_head=4),
    "opt": dict(model_type="opt", vocab_size=1000, hidden_size=128, ffn_dim=512, num_hidden_layers=2,
                num_attention_heads=4, word_embed_proj_dim=128),
    "gpt_neox": dict(model_type="gpt_neox", vocab_size=1000, hidden_size=128, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4),
    "falcon": dict(model_type="falcon", vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   new_decoder_architecture=True, num_kv_heads=2),
    "phi3": dict(model_type="phi3", **_DENSE),
    "deepseek_v2": dict(model_type="deepseek_v2", **{**_DENSE, "num_key_value_heads": 4}, **_MLA),
    "deepseek_v3": dict(model_type="deepseek_v3", **{**_DENSE, "num_key_value_heads": 4}, **_MLA),
}


def _write(tmp_path: Path, cfg: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg) if name.endswith(".json") else yaml.safe_dump(cfg))
    return path


def _one_error(res, path: Path, field: str) -> str:
    """The CLI's refusal: exit 2, nothing on stdout, one line naming the file, the field and a fix."""
    assert res.exit_code == EXIT_BAD_INPUT, (res.exit_code, res.stderr)
    assert res.stdout == ""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith(f"error: {path}: field '{field}': "), line
    assert re.search(r"\(fix: [^)]", line), line
    return line


def _show(cli, path: Path) -> dict:
    res = cli("models", "show", str(path), "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    return res.json()


# ----- 1. booleans --------------------------------------------------------------------------------


def test_tie_word_embeddings_as_the_string_false_is_refused_and_the_boolean_counts(cli, tmp_path):
    bad = _write(tmp_path, {**QA_LLAMA, "tie_word_embeddings": "false"})
    line = _one_error(cli("models", "show", str(bad), "--json"), bad, "tie_word_embeddings")
    assert "the string 'false'" in line and "true or false" in line
    untied = _show(cli, _write(tmp_path, {**QA_LLAMA, "tie_word_embeddings": False}, "untied.json"))
    tied = _show(cli, _write(tmp_path, {**QA_LLAMA, "tie_word_embeddings": True}, "tied.json"))
    absent = _show(cli, _write(tmp_path, QA_LLAMA, "absent.json"))  # LlamaConfig's default: untied
    assert untied["num_params"] == absent["num_params"] == UNTIED_PARAMS
    assert tied["num_params"] == TIED_PARAMS


def test_estimate_refuses_a_string_boolean_with_exit_2(cli, tmp_path):
    bad = _write(tmp_path, {**QA_LLAMA, "tie_word_embeddings": "false"})
    _one_error(cli("estimate", str(bad), "--gpus", "1"), bad, "tie_word_embeddings")


BOOL_KEYS = [
    ("llama", "tie_word_embeddings"), ("llama", "attention_bias"), ("llama", "mlp_bias"),
    ("mistral", "tie_word_embeddings"), ("granitemoe", "tie_word_embeddings"),
    ("qwen2", "use_sliding_window"), ("qwen2_moe", "qkv_bias"), ("qwen3", "attention_bias"),
    ("qwen3", "use_sliding_window"), ("gemma", "attention_bias"), ("gemma2", "tie_word_embeddings"),
    ("gpt2", "tie_word_embeddings"), ("opt", "do_layer_norm_before"), ("opt", "enable_bias"),
    ("opt", "_remove_final_layer_norm"), ("gpt_neox", "use_parallel_residual"), ("gpt_neox", "attention_bias"),
    ("falcon", "new_decoder_architecture"), ("falcon", "parallel_attn"), ("falcon", "bias"), ("falcon", "alibi"),
    ("phi3", "tie_word_embeddings"), ("deepseek_v2", "attention_bias"), ("deepseek_v3", "tie_word_embeddings"),
]


@pytest.mark.parametrize("family,key", BOOL_KEYS, ids=[f"{f}-{k}" for f, k in BOOL_KEYS])
@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_every_boolean_key_takes_json_booleans_only(family, key, value):
    cfg = FAMILIES[family]
    with pytest.raises(InputFileError) as e:
        translate({**cfg, key: value}, "x")
    assert e.value.field == key and e.value.hint
    for ok in (True, False):  # JSON's own booleans read
        ModelSpec(**translate({**cfg, key: ok}, "x").fields)


def test_falcon_multi_query_string_is_refused_where_it_shapes_qkv():
    old = {**FAMILIES["falcon"], "new_decoder_architecture": False}
    with pytest.raises(InputFileError) as e:
        translate({**old, "multi_query": "false"}, "x")
    assert e.value.field == "multi_query"
    assert translate({**old, "multi_query": False}, "x").fields["num_kv_heads"] == 4  # 3 x hidden: MHA
    assert translate({**old, "multi_query": True}, "x").fields["num_kv_heads"] == 1


def test_a_composite_and_its_towers_take_json_booleans_only():
    llava = yaml.safe_load((CORPUS / "llava-1.5-7b.yaml").read_text())["hf_config"]
    with pytest.raises(InputFileError) as e:
        translate({**llava, "multimodal_projector_bias": "false"}, "x")
    assert e.value.field == "multimodal_projector_bias"
    gemma3 = yaml.safe_load((CORPUS / "gemma-3-4b-it.yaml").read_text())["hf_config"]
    bad = {**gemma3, "vision_config": {**gemma3.get("vision_config", {}), "vision_use_head": "false"}}
    with pytest.raises(InputFileError) as e:
        translate(bad, "x")
    assert e.value.field == "vision_config.vision_use_head"
    gpt_oss = yaml.safe_load((CORPUS / "gpt-oss-120b.yaml").read_text())["hf_config"]
    with pytest.raises(InputFileError) as e:
        translate({**gpt_oss, "attention_bias": "true"}, "x")
    assert e.value.field == "attention_bias"


# ----- 2. KV heads --------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", [0, -2, 3, 64, "8", True, 2.5])
def test_kv_heads_must_divide_the_attention_heads(cli, tmp_path, kv):
    bad = _write(tmp_path, {**QA_LLAMA, "num_key_value_heads": kv})
    line = _one_error(cli("models", "show", str(bad), "--json"), bad, "num_key_value_heads")
    assert "num_attention_heads (32)" in line


def test_kv_heads_null_or_absent_is_multi_head_and_a_divisor_is_grouped(cli, tmp_path):
    no_kv = {k: v for k, v in QA_LLAMA.items() if k != "num_key_value_heads"}
    for name, cfg in (("null.json", {**QA_LLAMA, "num_key_value_heads": None}), ("absent.json", no_kv),
                      ("same.json", {**QA_LLAMA, "num_key_value_heads": 32})):
        shown = _show(cli, _write(tmp_path, cfg, name))
        assert shown["kv_cache_bytes_per_token"] == MHA_KV_BYTES_PER_TOKEN, name
    for kv, expected in ((8, GQA_KV_BYTES_PER_TOKEN), (1, MHA_KV_BYTES_PER_TOKEN // 32)):
        shown = _show(cli, _write(tmp_path, {**QA_LLAMA, "num_key_value_heads": kv}, f"kv{kv}.json"))
        assert shown["kv_cache_bytes_per_token"] == expected


def test_kv_heads_named_under_the_key_each_family_uses():
    with pytest.raises(InputFileError) as e:
        translate({**FAMILIES["falcon"], "num_kv_heads": 0}, "x")
    assert e.value.field == "num_kv_heads"
    for family in ("mixtral", "qwen3_moe", "gemma2", "phi3"):
        with pytest.raises(InputFileError) as e:
            translate({**FAMILIES[family], "num_key_value_heads": 0}, "x")
        assert e.value.field == "num_key_value_heads", family
    paligemma_like = {"model_type": "paligemma", "text_config": {**FAMILIES["gemma"], "num_key_value_heads": 3}}
    with pytest.raises(InputFileError) as e:
        translate(paligemma_like, "x")
    assert e.value.field == "text_config.num_key_value_heads"
    gpt_oss = yaml.safe_load((CORPUS / "gpt-oss-120b.yaml").read_text())["hf_config"]
    with pytest.raises(InputFileError) as e:
        translate({**gpt_oss, "num_key_value_heads": 0}, "x")
    assert e.value.field == "num_key_value_heads"


# ----- 3. dtype -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value", [("torch_dtype", "int3"), ("torch_dtype", 5), ("dtype", "int3"),
                                       ("torch_dtype", ""), ("torch_dtype", ["bfloat16"])])
def test_an_unknown_dtype_in_a_config_names_its_key(cli, tmp_path, key, value):
    cfg = {**{k: v for k, v in QA_LLAMA.items() if k != "torch_dtype"}, key: value}
    bad = _write(tmp_path, cfg)
    line = _one_error(cli("models", "show", str(bad), "--json"), bad, key)
    assert "unknown dtype" in line and "bfloat16" in line


def test_known_dtypes_read_as_before(cli, tmp_path):
    for name in ("float16", "bfloat16", "float32", "BF16"):
        cfg = {**QA_LLAMA, "torch_dtype": name}
        assert _show(cli, _write(tmp_path, cfg, f"{name}.json"))["num_params"] == UNTIED_PARAMS
        assert translate(cfg, "x").fields["dtype"] == name
    assert translate({**QA_LLAMA, "torch_dtype": None, "dtype": "float16"}, "x").fields["dtype"] == "float16"
    assert translate({k: v for k, v in QA_LLAMA.items() if k != "torch_dtype"}, "x").fields["dtype"] == "bfloat16"
    with pytest.raises(InputFileError) as e:  # a composite's top-level dtype
        translate({**yaml.safe_load((CORPUS / "llava-1.5-7b.yaml").read_text())["hf_config"], "torch_dtype": "int3"},
                  "x")
    assert e.value.field == "torch_dtype"


def test_a_model_yaml_with_an_unknown_dtype_is_refused_at_load_naming_the_file_key(cli, tmp_path):
    spec = read_structured(model_specs_dir() / "debug.yaml")
    spec["architecture"]["dtype"] = "int3"
    bad = _write(tmp_path, spec, "model.yaml")
    line = _one_error(cli("models", "show", str(bad), "--json"), bad, "architecture.dtype")
    assert "'int3'" in line and "--dtype" not in line


def test_checkpoint_names_the_model_files_dtype_not_a_flag(cli, tmp_path):
    spec = read_structured(model_specs_dir() / "debug.yaml")
    model = _write(tmp_path, spec, "model.yaml")
    plan = tmp_path / "plan.yaml"
    res = cli("recommend", str(model), "--gpus", "1", "-o", str(plan))
    assert res.exit_code == EXIT_OK and plan.is_file(), res.stderr
    spec["architecture"]["dtype"] = "int3"  # the model file changes after the plan was made
    _write(tmp_path, spec, "model.yaml")
    (tmp_path / "ckpt").mkdir()
    line = _one_error(cli("checkpoint", str(plan), str(tmp_path / "ckpt")), model, "architecture.dtype")
    assert "--dtype" not in line


def test_model_spec_refuses_an_unknown_dtype():
    fields = translate(QA_LLAMA, "x").fields
    assert ModelSpec(**fields).dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        ModelSpec(**{**fields, "dtype": "int3"})


# ----- 4. unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_names_an_unknown_key_and_only_it(family):
    cfg = FAMILIES[family]
    plain = translate(cfg, "x")
    assert plain.warnings == ()
    ModelSpec(**plain.fields)
    ordinary = {**cfg, "torch_dtype": "bfloat16", "transformers_version": "4.57.0", "bos_token_id": 1,
                "eos_token_id": 2, "initializer_range": 0.02, "use_cache": True, "rope_scaling": None}
    assert translate(ordinary, "x").warnings == ()
    warned = translate({**cfg, "foo_bar": 1}, "x")
    assert len(warned.warnings) == 1 and "'foo_bar'" in warned.warnings[0]
    assert warned.fields == plain.fields  # named, and the plan the same


def test_an_unknown_key_is_a_warning_on_stderr_through_the_cli(cli, tmp_path):
    path = _write(tmp_path, {**QA_LLAMA, "foo_bar": 1})
    res = cli("models", "show", str(path), "--json")
    assert res.exit_code == EXIT_OK
    assert res.json()["num_params"] == UNTIED_PARAMS
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert warnings == [f"warning: {path}: config key 'foo_bar' is not understood by shardplan and was ignored; "
                        "check that it changes no parameter count or cache size"]


def test_keys_harmless_at_one_value_warn_at_another():
    gpt2 = FAMILIES["gpt2"]
    assert translate({**gpt2, "add_cross_attention": False}, "x").warnings == ()
    assert any("'add_cross_attention'" in w for w in translate({**gpt2, "add_cross_attention": True}, "x").warnings)
    opt = FAMILIES["opt"]
    assert translate({**opt, "layer_norm_elementwise_affine": True}, "x").warnings == ()
    assert translate({**opt, "layer_norm_elementwise_affine": False}, "x").warnings


def test_layer_types_a_family_derives_itself_are_not_named_and_others_are():
    qwen3 = FAMILIES["qwen3"]
    assert translate({**qwen3, "layer_types": ["full_attention"] * 2, "sliding_window": None}, "x").warnings == ()
    assert translate({**qwen3, "layer_types": ["sliding_attention", "full_attention"]}, "x").warnings
    gemma2 = FAMILIES["gemma2"]
    assert translate({**gemma2, "layer_types": ["sliding_attention", "full_attention"]}, "x").warnings == ()
    assert translate({**gemma2, "layer_types": ["full_attention", "full_attention"]}, "x").warnings


def test_a_composite_read_for_its_text_model_names_what_it_leaves_out():
    cfg = {"model_type": "paligemma", "text_config": {**FAMILIES["gemma"], "wiggle": 1}, "vision_config": {"x": 1}}
    warnings = translate(cfg, "x").warnings
    assert len(warnings) == 2
    assert "'vision_config'" in warnings[0] and "'text_config.wiggle'" in warnings[1]


def _bundled_hf_configs() -> list[tuple[str, dict]]:
    out = []
    for path in [model_specs_dir() / f"{n}.yaml" for n in bundled_names(model_specs_dir())] + sorted(
            CORPUS.glob("*.yaml")) + sorted((REPO / "tests" / "data" / "models").glob("*.yaml")):
        hf = read_structured(path).get("hf_config")
        if hf:
            out.append((path.stem, hf))
    for path in sorted((CORPUS.parent / "serving_load" / "models").glob("*.json")):
        out.append((path.stem, read_structured(path)))
    return out


def test_no_shipped_config_warns_about_an_ordinary_key():
    configs = _bundled_hf_configs()
    assert len(configs) >= 40
    for name, hf in configs:
        warnings = [w for w in translate(hf, name).warnings if "not understood" in w]
        assert warnings == [], name


def test_shipped_counts_are_unchanged():
    """Published totals the bundled files carry, counted to the parameter."""
    from shardplan.cost.params import count_params

    checked = 0
    for name in bundled_names(model_specs_dir()):
        m = load_model(str(model_specs_dir() / f"{name}.yaml"))
        if m.published_num_params:
            assert count_params(m.spec).total == m.published_num_params, name
            checked += 1
    assert checked >= 5


# ----- 5. files that are not a model, and malformed structure --------------------------------------


def test_a_hardware_profile_given_as_the_model_says_so(cli):
    profile = REPO / "hardware_profiles" / "a100-pcie-80gb.yaml"
    line = _one_error(cli("models", "show", str(profile)), profile, "model_type")
    assert "hardware profile" in line and "-H" in line and "unsupported model_type" not in line
    line = _one_error(cli("estimate", str(profile), "--gpus", "1"), profile, "model_type")
    assert "hardware profile" in line


def test_a_model_yaml_without_architecture_says_what_is_missing(cli, tmp_path):
    spec = _write(tmp_path, {"name": "x", "sources": {"spec": "mine"}}, "model.yaml")
    line = _one_error(cli("models", "show", str(spec)), spec, "architecture")
    assert "architecture:" in line and "unsupported model_type" not in line


def test_a_config_without_model_type_says_it_is_missing(cli, tmp_path):
    bare = _write(tmp_path, {k: v for k, v in QA_LLAMA.items() if k != "model_type"})
    line = _one_error(cli("models", "show", str(bare)), bare, "model_type")
    assert "missing" in line and "None" not in line
    nested = _write(tmp_path, {"name": "x", "hf_config": {"hidden_size": 64}}, "model.yaml")
    _one_error(cli("models", "show", str(nested)), nested, "hf_config.model_type")
    # architectures alone still name the family
    only_arch = {**{k: v for k, v in QA_LLAMA.items() if k != "model_type"}, "architectures": ["LlamaForCausalLM"]}
    assert _show(cli, _write(tmp_path, only_arch, "arch.json"))["num_params"] == UNTIED_PARAMS


def test_a_plan_given_as_the_model_says_so(cli, tmp_path):
    model = _write(tmp_path, read_structured(model_specs_dir() / "debug.yaml"), "model.yaml")
    plan = tmp_path / "plan.yaml"
    assert cli("recommend", str(model), "--gpus", "1", "-o", str(plan)).exit_code == EXIT_OK
    line = _one_error(cli("models", "show", str(plan)), plan, "model_type")
    assert "plan" in line


def test_an_unknown_layer_type_names_layer_types_and_the_fix(cli, tmp_path):
    cfg = read_structured(REPO / "tests" / "data" / "models" / "tiny-qwen3-next.yaml")["hf_config"]
    layers = cfg["num_hidden_layers"]
    bad = _write(tmp_path, {**cfg, "layer_types": ["x"] * layers})
    line = _one_error(cli("models", "show", str(bad)), bad, "layer_types")
    assert "'x'" in line and "linear_attention" in line and "is not a valid LayerType" not in line
    # a type the family does not build (a sliding layer in Qwen3-Next), and a list of the wrong length
    sliding = _write(tmp_path, {**cfg, "layer_types": ["sliding_attention"] * layers}, "sliding.json")
    _one_error(cli("models", "show", str(sliding)), sliding, "layer_types")
    short = _write(tmp_path, {**cfg, "layer_types": ["full_attention"]}, "short.json")
    _one_error(cli("models", "show", str(short)), short, "layer_types")
    ok = _write(tmp_path, {**cfg, "layer_types": ["linear_attention"] * (layers - 1) + ["full_attention"]}, "ok.json")
    assert _show(cli, ok)["num_params"] > 0


def test_a_sub_config_that_is_not_a_mapping_names_it_and_the_fix(cli, tmp_path):
    bad = _write(tmp_path, {"model_type": "llava", "text_config": [1, 2], "vision_config": "x"})
    _one_error(cli("models", "show", str(bad)), bad, "text_config")
    llava = yaml.safe_load((CORPUS / "llava-1.5-7b.yaml").read_text())["hf_config"]
    vision = _write(tmp_path, {**llava, "vision_config": "x"}, "vision.json")
    _one_error(cli("models", "show", str(vision)), vision, "vision_config")


def test_sliding_window_pattern_names_its_key_and_the_fix():
    gemma3 = yaml.safe_load((CORPUS / "gemma-3-1b-it.yaml").read_text())["hf_config"]
    cfg = {k: v for k, v in gemma3.items() if k != "layer_types"}
    with pytest.raises(InputFileError) as e:
        translate({**cfg, "sliding_window_pattern": 0}, "x")
    assert e.value.field == "sliding_window_pattern" and e.value.hint


# ----- against transformers (its config classes and the models it builds on the meta device) ------


def _saved_by_transformers(model_type: str) -> dict:
    """The config.json transformers writes for `model_type`'s defaults (to_json_string(use_diff=True))."""
    from transformers import AutoConfig

    saved = json.loads(AutoConfig.for_model(model_type).to_json_string(use_diff=True))
    return {**saved, "model_type": model_type}


@pytest.mark.consumers
@pytest.mark.parametrize("family", sorted(TRANSLATORS))
def test_a_config_transformers_saves_raises_no_warning(family):
    pytest.importorskip("transformers")
    cfg = _saved_by_transformers(family)
    if family == "qwen3_moe":
        cfg.setdefault("moe_intermediate_size", 768)
    if family == "deepseek_v2":  # DeepseekV2Config leaves num_experts_per_tok None
        cfg["num_experts_per_tok"] = 6
    assert [w for w in translate(cfg, family).warnings if "not understood" in w] == []


@pytest.mark.consumers
def test_a_model_type_built_by_transformers_names_keys_its_config_class_lacks():
    pytest.importorskip("transformers")
    olmo = dict(model_type="olmo", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, torch_dtype="float32", rope_theta=10000.0,
                pretraining_tp=1, clip_qkv=None, use_cache=True)
    plain = translate(olmo, "olmo")
    assert plain.warnings == () and plain.fields["dtype"] == "float32"
    warned = translate({**olmo, "foo_bar": 1}, "olmo")
    assert len(warned.warnings) == 1 and "'foo_bar'" in warned.warnings[0] and "OlmoConfig" in warned.warnings[0]
    assert warned.fields["measured_num_params"] == plain.fields["measured_num_params"]
    with pytest.raises(InputFileError) as e:
        translate({**olmo, "torch_dtype": "int3"}, "olmo")
    assert e.value.field == "torch_dtype"


def _meta_numel(cfg: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **kwargs))
    return sum(p.numel() for p in model.parameters())


FALCON_NORMS = {  # (new_decoder_architecture, parallel_attn, num_ln_in_parallel_attn)
    "new_parallel_default": (True, True, None), "new_parallel_one": (True, True, 1),
    "new_sequential": (True, False, 1), "old_parallel_two": (False, True, 2), "old_parallel": (False, True, None),
    "old_sequential": (False, False, None),
}


@pytest.mark.consumers
@pytest.mark.parametrize("label", sorted(FALCON_NORMS))
def test_falcon_norms_per_layer_match_transformers(label):
    pytest.importorskip("transformers")
    from shardplan.cost.params import count_params

    new, parallel, num_ln = FALCON_NORMS[label]
    cfg = dict(model_type="falcon", vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_kv_heads=2 if new else 4, new_decoder_architecture=new, parallel_attn=parallel,
               multi_query=False, num_ln_in_parallel_attn=num_ln, bias=False, alibi=False)
    translation = translate(cfg, label)
    assert translation.warnings == ()
    assert count_params(ModelSpec(**translation.fields)).total == _meta_numel(cfg)


@pytest.mark.consumers
@pytest.mark.parametrize("qkv_bias", [True, False])
def test_qwen2_moe_qkv_bias_matches_transformers(qkv_bias):
    pytest.importorskip("transformers")
    from shardplan.cost.params import count_params

    cfg = {**FAMILIES["qwen2_moe"], "qkv_bias": qkv_bias, "tie_word_embeddings": False}
    assert count_params(ModelSpec(**translate(cfg, "x").fields)).total == _meta_numel(cfg)


@pytest.mark.consumers
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_a_qwen3_config_without_head_dim_has_the_heads_transformers_builds(model_type):
    """Qwen3Config defaults head_dim to 128; Qwen3MoeConfig has no default, and its attention falls back
    to hidden_size / num_attention_heads: the same config.json without head_dim, counted on the meta
    device, has different widths in the two families."""
    pytest.importorskip("transformers")
    from shardplan.cost.params import count_params

    cfg = dict(model_type=model_type, vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if model_type == "qwen3_moe":
        cfg.update(moe_intermediate_size=64, num_experts_per_tok=2, num_experts=4)
    spec = ModelSpec(**translate(cfg, "x").fields)
    assert spec.attention_head_dim == (128 if model_type == "qwen3" else 64)
    assert count_params(spec).total == _meta_numel(cfg)


@pytest.mark.consumers
@pytest.mark.parametrize("key", ["num_local_experts", "num_experts"])
def test_qwen3_moe_reads_the_experts_under_either_name_as_transformers_builds_them(key):
    """transformers 5 writes Qwen3-MoE's routed experts as num_local_experts, earlier ones as num_experts."""
    pytest.importorskip("transformers")
    from shardplan.cost.params import count_params

    cfg = dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts_per_tok=2,
               tie_word_embeddings=False, **{key: 8})
    spec = ModelSpec(**translate(cfg, "x").fields)
    built = {k: v for k, v in cfg.items() if k != key} | {"num_local_experts": 8}  # transformers 5's name
    assert spec.moe.num_experts == 8 and count_params(spec).total == _meta_numel(built)
    with pytest.raises(InputFileError) as e:
        translate({**cfg, "num_local_experts": 8, "num_experts": 16}, "x")
    assert e.value.field == "num_local_experts"
