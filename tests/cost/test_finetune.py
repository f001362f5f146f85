"""LoRA / QLoRA fine-tuning: adapter counts against PEFT's own wrapping on the meta device, NF4
storage against the QLoRA paper, what a frozen base keeps and skips, and the CLI."""

from __future__ import annotations

import dataclasses

import pytest

from shardplan.cost.finetune import PEFT_EXPERT_WRAPPING, BaseFormat, FineTune, adapter_params, nf4_bytes_per_weight
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, Recompute
from shardplan.cost.memory_training import activation_bytes_per_layer, training_memory
from shardplan.cost.params import count_params
from shardplan.cost.time_training import training_time
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import stack_rules
from shardplan.specs.hf import spec_from_hf_config
from shardplan.specs.loading import load_hardware, load_model, model_specs_dir, read_structured
from shardplan.validation.shipped import CORPUS_DIR

H100 = "h100-sxm-80gb"


def _wl(method: str, **kw):
    spec = kw.pop("spec", load_model("llama-3.1-8b").spec)
    stack = kw.pop("stack", "hf")
    return training_workload(seq_len=kw.pop("seq_len", 2048), global_batch_size=kw.pop("global_batch_size", 8),
                             optimizer="adamw", framework=None, flash_attention=None, dropout=False,
                             stack=stack_rules(stack), finetune=method, spec=spec, **kw)


# ----- counts -----------------------------------------------------------------------------------


LAYERS_WRAPPED = 3


@pytest.mark.consumers
@pytest.mark.parametrize("name,targets", [
    ("llama-3.1-8b", "all-linear"), ("llama-3.1-8b", ["q_proj", "v_proj"]), ("mixtral-8x7b", "all-linear"),
    ("mixtral-8x7b", ["q_proj", "v_proj", "o_proj"]), ("qwen3-30b-a3b", "all-linear"), ("gpt2", "all-linear"),
    ("falcon-40b", "all-linear"), ("qwen2.5-7b", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
])
def test_adapter_parameters_equal_what_peft_trains_on_the_meta_device(name, targets):
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(read_structured(model_specs_dir() / f"{name}.yaml")["hf_config"])
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    # The first layers of the full-size config (every layer of these models is of one kind, and a
    # layer's adapters do not depend on how many follow it): PEFT wraps each linear module in Python,
    # 18,000 of them for all of Qwen3-30B-A3B's experts.
    spec = load_model(name).spec
    layers = min(spec.num_layers, LAYERS_WRAPPED)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in cfg:
            cfg[key] = layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    assert model.config.num_hidden_layers == layers
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=targets))
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    assert adapter_params(spec, range(layers), 16, names) == trained
    whole = adapter_params(spec, range(spec.num_layers), 16, names)
    # shardplan's whole count is its per-layer count times the layers (every layer of these models is of
    # one kind, as said above); PEFT is checked on the first layers only.
    assert whole == trained * spec.num_layers // layers


# Small configs of families whose layers differ in kind: gpt-oss (MoE whose experts PEFT does not
# wrap: adapters on attention only), Qwen3-Next (3 Gated DeltaNet layers to 1 softmax one, experts
# wrapped under all-linear, its shared expert's projections then not). Full sizes from the corpus.
_SMALL = {"hidden_size": 256, "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 512,
          "num_local_experts": 8, "num_experts": 16, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}


@pytest.mark.consumers
@pytest.mark.parametrize("name,targets", [
    ("gpt-oss-120b", "all-linear"), ("gpt-oss-120b", ["q_proj", "v_proj"]),
    ("qwen3-next-80b-a3b-thinking", "all-linear"), ("qwen3-next-80b-a3b-thinking", ["q_proj", "v_proj"]),
    ("qwen3-next-80b-a3b-thinking", ["in_proj_qkvz", "out_proj", "o_proj"]),
])
def test_adapter_parameters_of_small_moe_and_linear_attention_configs_equal_peft(name, targets):
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(read_structured(CORPUS_DIR / "models" / f"{name}.yaml")["hf_config"])
    cfg.pop("architectures", None)
    for key in ("quantization_config", "pad_token_id", "bos_token_id", "eos_token_id"):
        cfg.pop(key, None)  # gpt-oss's mxfp4 storage (the meta model is bf16); ids past the small vocabulary
    cfg.update({k: v for k, v in _SMALL.items() if k in cfg})
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:cfg["num_hidden_layers"]]
    spec = spec_from_hf_config(cfg, name)
    assert len({(spec.is_moe_layer(i), spec.is_linear_attention_layer(i), spec.is_sliding_layer(i))
                for i in range(spec.num_layers)}) > 1  # the small config keeps layers of two kinds
    model_type = cfg.pop("model_type")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=targets))
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    assert adapter_params(spec, range(spec.num_layers), 16, names) == trained


@pytest.mark.consumers
def test_the_families_whose_experts_peft_wraps_are_the_installed_peft_s():
    from peft.utils.transformers_weight_conversion import (
        _MODEL_TO_CONVERSION_PATTERN,
        _MOE_TARGET_MODULE_MAPPING,
    )

    installed = {t: tuple(_MOE_TARGET_MODULE_MAPPING[p]) for t, p in _MODEL_TO_CONVERSION_PATTERN.items()
                 if p in _MOE_TARGET_MODULE_MAPPING}
    assert {t: set(n) for t, n in PEFT_EXPERT_WRAPPING.items()} == {t: set(n) for t, n in installed.items()}


def test_lora_refuses_targets_under_which_peft_wraps_routed_experts():
    mixtral = load_model("mixtral-8x7b").spec
    for targets in ("all-linear", "q_proj,gate"):
        with pytest.raises(ShardplanError) as e:
            _wl("lora", spec=mixtral, lora_targets=targets)
        assert e.value.field == "--lora-targets" and "q_proj,k_proj,v_proj,o_proj" in (e.value.hint or "")
    with pytest.raises(ShardplanError):  # a shared expert's name is an expert name to PEFT
        _wl("qlora", spec=load_model("qwen3-30b-a3b").spec, lora_targets="q_proj,down_proj")
    assert _wl("lora", spec=mixtral, lora_targets="q_proj,k_proj,v_proj,o_proj").lora_targets == (
        "q_proj", "k_proj", "v_proj", "o_proj")
    gpt_oss = load_model(str(CORPUS_DIR / "models" / "gpt-oss-120b.yaml")).spec
    assert _wl("lora", spec=gpt_oss).lora_targets == ("all-linear",)  # PEFT leaves its experts alone


def test_cli_refuses_all_linear_on_mixtral_in_one_line(cli):
    res = cli("estimate", "mixtral-8x7b", "--gpus", "8", "--workload", "training", "--stack", "hf",
              "--finetune", "lora", "--lora-targets", "all-linear")
    assert res.exit_code == 2
    assert "--lora-targets" in res.stderr and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_nf4_storage_is_the_qlora_papers_bits_per_weight():
    # QLoRA (Dettmers et al. 2023) Sec. 3: blocksize 64 costs 32/64 = 0.5 bits a weight for the
    # constants; double quantization brings it to 8/64 + 32/(64*256) = 0.127 bits.
    assert 8 * nf4_bytes_per_weight(False) == pytest.approx(4.5)
    assert 8 * nf4_bytes_per_weight(True) - 4 == pytest.approx(0.127, abs=5e-4)


def test_qlora_weights_are_nf4_linears_plus_fp32_embeddings_and_norms_under_peft():
    spec = load_model("llama-3.1-8b").spec
    hw = load_hardware(H100)
    layout = Layout(recompute=Recompute.FULL, micro_batch_size=1)
    wl = _wl("qlora", lora_rank=8)
    assert wl.base_format is BaseFormat.NF4_DQ and wl.base_fp32_non_quantized
    rank = training_memory(spec, hw, layout, wl).ranks[0]
    c = count_params(spec).by_component
    linears = c["attention"] + c["mlp"]  # no biases in Llama
    rest = count_params(spec).total - linears
    assert rank.detail["weights.frozen_base"] == pytest.approx(linears * nf4_bytes_per_weight(True) + 4 * rest, rel=1e-9)
    adapters = adapter_params(spec, range(spec.num_layers), 8, ("all-linear",))
    assert rank.detail["weights.adapters"] == pytest.approx(4 * adapters)
    assert rank.breakdown.gradients == pytest.approx(4 * adapters)  # fp32 adapter gradients, none for the base
    assert rank.breakdown.optimizer_states == pytest.approx(8 * adapters)  # AdamW's m and v, fp32
    # the dequantized bf16 copy of the largest linear (the 14336 x 4096 MLP projections)
    assert rank.detail["temporary.dequantized_base_weight"] == pytest.approx(2 * 14336 * 4096)
    # without PEFT's upcast (no stack) the same base keeps bf16 embeddings
    bare = dataclasses.replace(wl, base_fp32_non_quantized=False)
    assert training_memory(spec, hw, layout, bare).ranks[0].detail["weights.frozen_base"] == pytest.approx(
        linears * nf4_bytes_per_weight(True) + 2 * rest, rel=1e-9)


def test_a_frozen_linear_saves_no_input_unless_an_adapter_sits_on_it():
    spec = load_model("llama-3.1-8b").spec
    layout = Layout(recompute=Recompute.NONE, micro_batch_size=2)
    full = _wl("full")
    qv = _wl("lora", lora_rank=16, lora_targets="q_proj,v_proj")
    s, b, h, f = 2048, 2, spec.hidden_size, spec.intermediate_size
    dropped = 2 * s * b * h + 2 * s * b * f  # the MLP's input and the down projection's input (bf16)
    lora_kept = 2 * 2 * s * b * 16  # each adapter keeps A x (r a token) for B's gradient
    delta = activation_bytes_per_layer(spec, layout, full, False, 2) - activation_bytes_per_layer(spec, layout, qv, False, 2)
    assert delta == pytest.approx(dropped - lora_kept)
    # lora_dropout: each adapter keeps its own dropped copy of the input (bf16) and the 1-byte mask,
    # 2 x 3 bytes a hidden element for q and v; the shared input x itself is no longer saved (the
    # frozen base linears save nothing, A saves dropout(x)): 6 - 2 = 4 bytes a hidden element
    drop = _wl("lora", lora_rank=16, lora_targets="q_proj,v_proj", lora_dropout=0.05)
    extra = activation_bytes_per_layer(spec, layout, drop, False, 2) - activation_bytes_per_layer(spec, layout, qv, False, 2)
    assert extra == pytest.approx(2 * (2 + 1) * s * b * h - 2 * s * b * h)
    # all-linear with dropout: q, k, v, gate, up share two inputs and down has its own; none is kept
    every = _wl("lora", lora_rank=16)
    every_drop = _wl("lora", lora_rank=16, lora_dropout=0.05)
    copies = 3 * (2 + 1) * s * b * h + 1 * (2 + 1) * s * b * spec.num_attention_heads * spec.attention_head_dim \
        + 2 * (2 + 1) * s * b * h + (2 + 1) * s * b * f  # q,k,v; o; gate, up; down
    unkept = 2 * s * b * h + 2 * s * b * h + 2 * s * b * f  # qkv input, MLP input, down input
    extra = activation_bytes_per_layer(spec, layout, every_drop, False, 2) - activation_bytes_per_layer(spec, layout, every, False, 2)
    assert extra == pytest.approx(copies - unkept)


def test_qlora_keeps_routed_experts_and_routers_out_of_nf4():
    # transformers 5 converts only nn.Linear to bnb Linear4bit; Mixtral's experts are fused 3-D
    # parameters and its router a MixtralTopKRouter, so both stay and PEFT's prepare_model_for_kbit_training
    # casts them to fp32 with embeddings, norms and lm_head. Mixtral-8x7B by hand:
    spec = load_model("mixtral-8x7b").spec
    assert spec.model_type == "mixtral"
    h, f, e, layers, vocab = 4096, 14336, 8, 32, 32000
    attention = layers * (h * 4096 + 2 * h * 1024 + 4096 * h)  # q, k, v (8 KV heads of 128), o
    experts = layers * e * 3 * h * f
    router = layers * e * h
    norms = layers * 2 * h + h
    embeddings = 2 * vocab * h  # untied embedding and lm_head
    expected = attention * nf4_bytes_per_weight(True) + 4 * (experts + router + norms + embeddings)
    wl = _wl("qlora", spec=spec, lora_targets="q_proj,v_proj")
    rank = training_memory(spec, load_hardware(H100), Layout(recompute=Recompute.FULL, micro_batch_size=1), wl).ranks[0]
    assert rank.detail["weights.frozen_base"] == pytest.approx(expected, rel=1e-12)
    assert rank.detail["weights.frozen_base"] > 168 * 2**30  # 45.1B expert weights in fp32
    # the largest 4-bit linear is an attention projection, dequantized to bf16
    assert rank.detail["temporary.dequantized_base_weight"] == pytest.approx(2 * 4096 * h)


def test_qlora_norms_keep_no_second_fp32_copy_of_an_fp32_residual_stream():
    spec = load_model("llama-3.1-8b").spec
    layout = Layout(recompute=Recompute.NONE, micro_batch_size=1)
    q = _wl("qlora", lora_targets="q_proj,v_proj")
    assert q.base_fp32_non_quantized and q.norms_fp32
    bare = dataclasses.replace(q, base_fp32_non_quantized=False)
    s, h = 2048, spec.hidden_size
    # bf16 residual: 2 norm inputs (2 bytes) plus their fp32 copies (4); fp32 residual: the inputs (4) only
    delta = activation_bytes_per_layer(spec, layout, q, False, 1) - activation_bytes_per_layer(spec, layout, bare, False, 1)
    assert delta == pytest.approx(2 * s * h * (4 - (2 + 4)))


def test_frozen_base_backward_runs_one_gemm_per_linear():
    spec = load_model("llama-3.1-8b").spec
    hw = load_hardware(H100)
    layout = Layout(recompute=Recompute.NONE, micro_batch_size=4)
    full = training_time(spec, hw, layout, _wl("full"), 2).stages[0]
    lora = training_time(spec, hw, layout, _wl("lora", lora_rank=1, lora_targets="q_proj"), 2).stages[0]
    assert full.backward.matmul_seconds == pytest.approx(2 * full.forward.matmul_seconds)
    # rank-1 adapters on q only: the base's input-gradient GEMMs and a sliver of adapter work
    assert lora.backward.matmul_seconds / lora.forward.matmul_seconds == pytest.approx(1.0, abs=0.02)
    t_full = training_time(spec, hw, layout, _wl("full"), 2).step_seconds
    t_lora = training_time(spec, hw, layout, _wl("lora"), 2).step_seconds
    assert t_lora < t_full


def test_qlora_dequantizes_every_linear_once_per_pass():
    spec = load_model("llama-3.1-8b").spec
    hw = load_hardware(H100)
    layout = Layout(recompute=Recompute.FULL, micro_batch_size=1)
    lora = training_time(spec, hw, layout, _wl("lora"), 1).stages[0]
    qlora = training_time(spec, hw, layout, _wl("qlora"), 1).stages[0]
    c = count_params(spec).by_component
    per_pass = (c["attention"] + c["mlp"]) * (nf4_bytes_per_weight(True) + 2)
    bw = hw.memory_bandwidth_bytes_per_second * hw.memory_bandwidth_efficiency
    # forward, the recomputed forward and the input-gradient backward
    extra = (qlora.forward.memory_seconds + qlora.backward.memory_seconds) - (lora.forward.memory_seconds + lora.backward.memory_seconds)
    assert extra == pytest.approx(3 * per_pass / bw, rel=1e-6)


# ----- inputs -----------------------------------------------------------------------------------


def test_stacks_refuse_what_they_do_not_run():
    with pytest.raises(ShardplanError) as e:
        _wl("qlora", stack="torchtitan")
    assert e.value.field == "--finetune"
    with pytest.raises(ShardplanError) as e:
        _wl("lora", lora_targets="q_proj,wq")
    assert e.value.field == "--lora-targets" and "wq" in str(e.value)
    assert _wl("lora", stack="megatron").finetune is FineTune.LORA


def test_cli_qlora_estimate_reports_the_frozen_base(cli):
    res = cli("estimate", "llama-3.1-8b", "--hardware", "rtx-4090-24gb", "--gpus", "1", "--workload", "training",
              "--stack", "hf", "--finetune", "qlora", "--lora-rank", "16", "--recompute", "full", "--seq-len", "1024",
              "--global-batch-size", "4", "--micro-batch-size", "1", "--json")
    assert res.exit_code == 0, res.stderr
    rep = res.json()
    w = rep["workload"]
    assert (w["finetune"], w["lora_rank"], w["lora_alpha"], w["base_format"]) == ("qlora", 16, 32.0, "nf4-dq")
    rank = rep["memory"]["per_rank"][0]
    assert rank["detail_bytes"]["weights.frozen_base"] < 8e9  # an 8B base in about 4.1 bits plus fp32 embeddings
    assert rank["per_gpu_bytes"]["total"] < 24 * 2**30
    assert any("qlora: frozen base" in a for a in rep["assumptions"])


def test_cli_refuses_qlora_on_torchtitan_in_one_line(cli):
    res = cli("estimate", "llama-3.1-8b", "--gpus", "1", "--workload", "training", "--stack", "torchtitan",
              "--finetune", "qlora")
    assert res.exit_code == 2
    assert "--finetune" in res.stderr and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


# ----- exports ----------------------------------------------------------------------------------


@pytest.mark.consumers
@pytest.mark.parametrize("target", ["accelerate", "deepspeed"])
def test_qlora_exports_carry_a_peft_and_bitsandbytes_config_their_libraries_accept(target):
    import json

    import peft
    from transformers import BitsAndBytesConfig

    from conftest import build_plan
    from shardplan.exporters import ExportOptions, export

    wl = _wl("qlora", lora_rank=32, lora_targets="q_proj,v_proj", lora_dropout=0.05)
    layout = Layout(dp=2, zero_stage=3, recompute=Recompute.FULL, micro_batch_size=1)
    manifest, _ = build_plan("llama-3.1-8b", 2, layout, wl, hardware="a100-sxm-80gb")
    files = {f.name: f.text for f in export(manifest, target, spec=load_model("llama-3.1-8b").spec, options=ExportOptions())}
    lora = peft.LoraConfig(**json.loads(files["peft_config.json"]))
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, set(lora.target_modules)) == (32, 64.0, 0.05, {"q_proj", "v_proj"})
    bnb = BitsAndBytesConfig(**json.loads(files["bnb_config.json"]))  # transformers' own checks of the fields
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
    assert "prepare_model_for_kbit_training" in files["launch.sh"]
