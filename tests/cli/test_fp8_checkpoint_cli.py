"""A block-quantized FP8 checkpoint as it ships (DeepSeek-V3/R1, Qwen3's FP8 releases: a
quantization_config with quant_method fp8 and a weight_block_size): vLLM from 0.6.6 and SGLang from
0.4.1 serve its FP8 weights with no --quantization (knowledge/engines/{vllm,sglang}.yaml
checkpoint_formats, with their sources), so on GPUs with FP8 tensor cores a plan that names no
format is planned in FP8, exactly as `--quantization fp8` plans it; `--weight-dtype bf16` plans a
16-bit copy; older releases, and GPUs without FP8 tensor cores, keep the model's dtype.

The published figure: DeepSeek-R1 (DeepSeek-V3's architecture, the same 163-shard FP8 checkpoint
layout) loaded at tensor parallelism 8 by vLLM's Gaudi fork: "Pre-loading model weights on hpu:0 took
79.41 GiB of device memory" on each of the 8 devices (https://github.com/HabanaAI/vllm-fork/issues/809,
the issue's start-up log). The weights a rank holds do not depend on the accelerator."""

from __future__ import annotations

import pytest
from conftest import REPO

from shardplan.units import BYTES_PER_GIB

QWEN3_8B_FP8 = str(REPO / "shardplan" / "validation" / "corpus" / "serving_load" / "models" / "qwen3-8b-fp8.json")
DS_R1_TP8_WEIGHTS_GIB = 79.41  # HabanaAI/vllm-fork#809, per device at tp 8
DS_ON_H200 = ("estimate", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "8", "--tp", "8", "--json")


def _json(res):
    assert res.exit_code in (0, 3), (res.exit_code, res.stderr[-2000:])  # 3: does not fit, the report still printed
    return res.json()


def _weights_gib(d) -> float:
    return d["memory"]["per_gpu_bytes"]["weights"] / BYTES_PER_GIB


def test_deepseek_v3_is_planned_in_the_fp8_it_ships_in(cli):
    shipped = _json(cli(*DS_ON_H200))
    asked = _json(cli(*DS_ON_H200, "--quantization", "fp8"))
    assert shipped["workload"]["quantization"] == asked["workload"]["quantization"] == "fp8"
    assert shipped["memory"] == asked["memory"]
    assert _weights_gib(shipped) == pytest.approx(DS_R1_TP8_WEIGHTS_GIB, rel=0.01)
    assert any("stay in FP8 as the block-quantized checkpoint ships them" in a for a in shipped["assumptions"])
    copy = _json(cli(*DS_ON_H200, "--weight-dtype", "bf16"))  # a 16-bit copy of the checkpoint: twice the bytes
    assert copy["workload"]["quantization"] == "none" and 1.9 < _weights_gib(copy) / _weights_gib(shipped) < 2.0


@pytest.mark.parametrize("engine,before,first", [("vllm", "0.6.5", "0.6.6"), ("sglang", "0.4.0", "0.4.1")])
def test_releases_before_the_format_keep_the_models_dtype(cli, engine, before, first):
    for version, expected in ((before, "none"), (first, "fp8")):
        d = _json(cli(*DS_ON_H200, "--engine", engine, "--engine-version", version))
        assert d["workload"]["quantization"] == expected, (engine, version)


def test_a_config_json_of_an_fp8_release_and_gpus_without_fp8_tensor_cores(cli):
    """Qwen3-8B-FP8's config.json (quant_method fp8, weight_block_size [128, 128]): FP8 on an H100; on an
    A100, which has no FP8 tensor cores, the model's bf16 (how an engine runs the block format there is
    not established: the knowledge's needs_fp8_tensor_cores_source)."""
    h100 = _json(cli("estimate", QWEN3_8B_FP8, "-H", "h100-sxm-80gb", "--gpus", "1", "--json"))
    a100 = _json(cli("estimate", QWEN3_8B_FP8, "-H", "a100-sxm-80gb", "--gpus", "1", "--json"))
    assert (h100["workload"]["quantization"], a100["workload"]["quantization"]) == ("fp8", "none")
    assert 1.5 < _weights_gib(a100) / _weights_gib(h100) < 2.0  # the embeddings and lm_head stay 16-bit in both


def test_recommend_ranks_deepseek_v3_in_fp8_on_two_h200_nodes(cli):
    """Without --allow-quantization the search keeps to the format the checkpoint ships in: every ranked
    plan on 16 H200s is FP8 (it was bf16, a copy no engine loads from this checkpoint)."""
    d = _json(cli("recommend", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "16", "--json"))
    assert d["top"] and {e["plan"]["quantization"] for e in d["top"]} == {"fp8"}


def test_a_checkpoint_in_another_shipped_format_is_named_in_a_note(cli, tmp_path):
    """Qwen2.5-7B's config with an 8-bit GPTQ quantization_config (Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8's:
    bits 8, group_size 128, sym, desc_act false): engines load it as GPTQ, shardplan plans the model's
    dtype unless told (4-bit AWQ and GPTQ are planned as shipped: tests/cli/test_quantized_checkpoint_cli.py),
    and says so on stderr; --quantization int8 plans 8-bit weights."""
    import json

    import yaml

    cfg = dict(yaml.safe_load((REPO / "model_specs" / "qwen2.5-7b.yaml").read_text())["hf_config"])
    cfg["quantization_config"] = {"bits": 8, "group_size": 128, "quant_method": "gptq", "sym": True, "desc_act": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    base = ("estimate", str(path), "-H", "l40s-48gb", "--gpus", "1", "--json")
    plain = cli(*base)
    d = _json(plain)
    assert d["workload"]["quantization"] == "none"
    assert "note: the checkpoint's weights are quantized (8-bit gptq, its quantization_config)" in plain.stderr
    assert "unless --quantization names the format (--quantization int8)" in plain.stderr
    asked = _json(cli(*base, "--quantization", "int8"))
    assert asked["workload"]["quantization"] == "int8" and _weights_gib(asked) < 0.7 * _weights_gib(d)
    cfg["quantization_config"] = {"quant_method": "\x1b[31mevil", "bits": True}  # a hostile method name: not printed
    path.write_text(json.dumps(cfg))
    hostile = cli(*base)
    assert hostile.exit_code in (0, 3) and "\x1b" not in hostile.stderr and "(a method shardplan does not print," in hostile.stderr


def test_a_split_the_engines_refuse_to_load_does_not_fit(cli):
    """vLLM and SGLang refuse DeepSeek-R1 at tp 32: "Weight output_partition_size = 576 is not divisible by
    weight quantization block_n = 128" (18,432 / 32; https://github.com/sgl-project/sglang/issues/3491). At
    tp 16 every width splits into whole blocks (18,432 / 16 = 1,152, the experts' 2,048 / 16 = 128)."""
    r = cli("estimate", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "32", "--tp", "32", "--json")
    assert r.exit_code == 3, r.stderr
    assert "intermediate_size 18,432 / 32 = 576 per rank is not a multiple of its 128-wide weight blocks" in \
        r.json()["reason"]
    assert cli("estimate", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "16", "--tp", "16", "--json").exit_code == 0
    top = _json(cli("recommend", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "32", "--json"))["top"]
    assert top and all(e["plan"]["tp"] <= 16 or e["plan"]["quantization"] != "fp8" for e in top)


def test_capacity_starts_from_the_format_the_checkpoint_ships(cli):
    d = _json(cli("capacity", "deepseek-v3", "-H", "h200-sxm-141gb", "--json"))
    formats = [f["quantization"] for f in d["formats"]]
    assert formats[0] == "fp8" and "none" not in formats  # no row for a 16-bit copy the engines do not load


def test_exports_leave_the_shipped_format_to_the_engine_and_flag_a_copy(cli, tmp_path):
    """An FP8 plan of the FP8 checkpoint: no --quantization (the engine reads the checkpoint's config, as it
    does with no flag). A 16-bit plan of it: the launch script says the engine would load FP8 from it."""
    plan = tmp_path / "fp8.yaml"
    assert cli("recommend", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "8", "-o", plan).exit_code == 0
    for target, launcher in (("vllm", "vllm serve"), ("sglang", "sglang.launch_server")):
        text = cli("export", plan, "--to", target).stdout
        assert launcher in text and "--quantization" not in text and "ships fp8 weights" not in text, target
    copy = tmp_path / "bf16.yaml"
    assert cli("recommend", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "16", "--weight-dtype", "bf16",
               "-o", copy).exit_code == 0
    text = cli("export", copy, "--to", "vllm").stdout
    assert "the checkpoint ships fp8 weights (its quantization_config), which vLLM loads as they are; this plan's " \
           "16-bit weights need a checkpoint in that format" in " ".join(text.replace("#", " ").split())


def test_a_block_fp8_config_translated_through_transformers_is_planned_in_fp8(cli, tmp_path):
    """A model_type shardplan has no translator for (olmo2: built on the meta device by transformers) with
    a block-FP8 quantization_config: the same default as the translated families."""
    import json

    from transformers import AutoConfig

    cfg = AutoConfig.for_model("olmo2").to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                                  "activation_scheme": "dynamic"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    d = _json(cli("estimate", str(path), "-H", "h100-sxm-80gb", "--gpus", "1", "--json"))
    assert d["workload"]["quantization"] == "fp8"


def _fp8(cli, model: str, gpu: str, tp: int) -> dict:
    return _json(cli("estimate", model, "-H", gpu, "--gpus", str(tp), "--tp", str(tp), "--quantization", "fp8",
                     "--max-model-len", "4096", "--json"))


def test_fp8_on_gpus_without_fp8_tensor_cores_needs_marlin_tiles(cli, tmp_path):
    """Below compute capability 8.9 the engines multiply FP8 weights through Marlin, weight-only; its
    repack needs each rank's output width in 64-wide tiles and its GEMM a (64 or 128)-wide k and n tile
    pair. GLM-4.5V-FP8 at tp 4 on RTX A6000s: "size_n = 5472 is not divisible by tile_n_size = 64"
    (its dense MLP's gate and up, 2 x 10,944 / 4; zai-org/GLM-V#178), and GLM-4.5-Air-FP8 at tp 8 on RTX
    3090s, "size_n = 2736" (zai-org/GLM-4.5#94). A dense stand-in of that MLP on RTX 3090s; Qwen2.5-72B (29,568 wide) on A100s splits into whole tiles at tp 2 only, and on H100s,
    whose FP8 tensor cores take another kernel, at tp 8 too."""
    import json

    import yaml

    cfg = dict(yaml.safe_load((REPO / "model_specs" / "llama-3.1-8b.yaml").read_text())["hf_config"])
    cfg.update(intermediate_size=10944, num_hidden_layers=4)
    path = tmp_path / "glm-mlp.json"
    path.write_text(json.dumps(cfg))
    d = _fp8(cli, str(path), "rtx-3090-24gb", 4)
    assert not d["fits"] and "the MLP's gate and up's rank share (5,472 outputs x 4,096 inputs at tp 4)" in d["reason"]
    # At tp 2 the gate and up repack (10,944 wide), but the down projection's 5,472 inputs take no 64-wide k tile.
    d = _fp8(cli, str(path), "rtx-3090-24gb", 2)
    assert not d["fits"] and "the MLP's down projection's rank share (4,096 outputs x 5,472 inputs at tp 2)" in d["reason"]
    assert _fp8(cli, str(path), "rtx-3090-24gb", 1)["fits"]
    assert _fp8(cli, "qwen2.5-72b", "a100-sxm-80gb", 2)["fits"]
    for tp in (4, 8):
        d = _fp8(cli, "qwen2.5-72b", "a100-sxm-80gb", tp)
        assert not d["fits"] and "Marlin kernel" in d["reason"], tp
    assert _fp8(cli, "qwen2.5-72b", "h100-sxm-80gb", 8)["fits"]
    assert _fp8(cli, "llama-3.1-70b", "a100-sxm-80gb", 8)["fits"]  # 28,672 / 8 = 3,584: whole 128-wide tiles


def test_tgi_runs_fp8_through_marlin_on_ada_too(cli, tmp_path):
    """TGI from 2.2.0 takes FP8-Marlin on every compute capability 8.x, 8.9 included ("W8A8 FP8 GEMM is
    supported, but Marlin-FP8 is faster", layers/fp8.py get_fp8_linear): the GLM-width stand-in at tp 4
    does not fit there on an L4; vLLM runs W8A8 on the L4 and it fits."""
    import json

    import yaml

    cfg = dict(yaml.safe_load((REPO / "model_specs" / "llama-3.1-8b.yaml").read_text())["hf_config"])
    cfg.update(intermediate_size=10944, num_hidden_layers=4)
    path = tmp_path / "glm-mlp.json"
    path.write_text(json.dumps(cfg))
    args = ("estimate", str(path), "-H", "l4-24gb", "--gpus", "4", "--tp", "4", "--quantization", "fp8",
            "--max-model-len", "4096", "--json")
    tgi = _json(cli(*args, "--engine", "tgi"))
    assert not tgi["fits"] and "5,472 outputs" in tgi["reason"] and tgi["workload"]["fp8_marlin_architectures"] == ["ada"]
    assert _json(cli(*args, "--engine", "vllm"))["fits"]
    assert _json(cli(*args, "--engine", "tgi", "--engine-version", "2.0.4"))["workload"]["fp8_marlin_architectures"] == []


def test_vllm_runs_no_fp8_on_volta(cli):
    """vLLM's start-up gate: 'The quantization method fp8 is not supported for the current GPU. Minimum
    capability: 75. Current capability: 70.' (Fp8Config.get_min_capability). Asked for, it is refused (exit
    2, naming the formats that run); offered to the search, left out with a warning; and the formats tried
    when nothing fits at 16 bits (the workload's weight_formats) do not include it."""
    res = cli("estimate", "llama-3.1-8b", "-H", "v100-sxm-32gb", "--gpus", "1", "--quantization", "fp8", "--json")
    assert res.exit_code == 2 and "does not run FP8 on volta GPUs" in res.stderr and "(int8, int4)" in res.stderr
    res = cli("recommend", "llama-3.1-8b", "-H", "v100-sxm-32gb", "--gpus", "1", "--max-model-len", "4096",
              "--allow-quantization", "fp8,int8", "--top", "10", "--json")
    assert res.exit_code == 0 and "fp8 left out: vllm does not run it on volta GPUs" in res.stderr
    assert {e["plan"]["quantization"] for e in res.json()["top"]} <= {"none", "int8"}
    # Only formats the engine itself lists and this GPU refuses are left out: llama.cpp lists none of fp8, int8, int4.
    res = cli("recommend", "llama-3.1-8b", "-H", "rtx-4090-24gb", "--gpus", "1", "--engine", "llamacpp",
              "--allow-quantization", "int8", "--max-model-len", "4096", "--json")
    assert "left out" not in res.stderr, res.stderr
    volta = _json(cli("estimate", "llama-3.1-8b", "-H", "v100-sxm-32gb", "--gpus", "1", "--json"))["workload"]
    assert "fp8" not in volta["weight_formats"] and {"int8", "int4"} <= set(volta["weight_formats"])
    # An Ampere GPU runs it (W8A16 Marlin).
    ampere = _json(cli("estimate", "llama-3.1-8b", "-H", "a100-sxm-80gb", "--gpus", "1", "--quantization", "fp8",
                       "--json"))["workload"]
    assert ampere["quantization"] == "fp8" and "fp8" in ampere["weight_formats"]
