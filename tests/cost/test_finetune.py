"""LoRA / QLoRA fine-tuning: adapter counts against PEFT's own wrapping on the meta device, NF4
storage against the QLoRA paper, what a frozen base keeps and skips, and the CLI."""

from __future__ import annotations

import dataclasses

import pytest

from shardplan.cost.finetune import BaseFormat, FineTune, adapter_params, nf4_bytes_per_weight
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, Recompute
from shardplan.cost.memory_training import activation_bytes_per_layer, training_memory
from shardplan.cost.params import count_params
from shardplan.cost.time_training import training_time
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import stack_rules
from shardplan.specs.loading import load_hardware, load_model, model_specs_dir, read_structured

H100 = "h100-sxm-80gb"


def _wl(method: str, **kw):
    spec = kw.pop("spec", load_model("llama-3.1-8b").spec)
    stack = kw.pop("stack", "hf")
    return training_workload(seq_len=kw.pop("seq_len", 2048), global_batch_size=kw.pop("global_batch_size", 8),
                             optimizer="adamw", framework=None, flash_attention=None, dropout=False,
                             stack=stack_rules(stack), finetune=method, spec=spec, **kw)


# ----- counts -----------------------------------------------------------------------------------


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
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=targets))
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    spec = load_model(name).spec
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    assert adapter_params(spec, range(spec.num_layers), 16, names) == trained


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
    # lora_dropout keeps a dropped copy of each adapter's input and its 1-byte mask
    drop = _wl("lora", lora_rank=16, lora_targets="q_proj,v_proj", lora_dropout=0.05)
    extra = activation_bytes_per_layer(spec, layout, drop, False, 2) - activation_bytes_per_layer(spec, layout, qv, False, 2)
    assert extra == pytest.approx(2 * 3 * s * b * h)


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
