"""Quantized checkpoints as they ship (the compressed-tensors ones at the end of this file). A 4-bit
AWQ or GPTQ checkpoint (quantization_config quant_method awq or gptq, bits 4: Qwen's -AWQ and
-GPTQ-Int4 releases, AutoAWQ and GPTQModel exports): vLLM reads the method from the
checkpoint and serves the 4-bit weights with no --quantization, on the GPU architectures its kernels
run on (knowledge/engines/vllm.yaml checkpoint_formats, from vLLM's quantization hardware table: AWQ on
Turing to Hopper, GPTQ on Volta to Hopper, neither on AMD GPUs). So a config.json of such a checkpoint
is planned in its 4-bit format there (it was planned at the model's 16-bit dtype, with a note: a
72B model "needed" 145 GB where vLLM loads 39 GiB), and at the model's dtype, with a note naming why,
where the engine does not run it.

The weights each rank holds, against vLLM's own start-up log line ("Loading model weights took X GB",
which divides by 2**30 before 0.6; "Model loading took X GiB" in V1), per tensor-parallel rank:

- Qwen/Qwen2.5-72B-Instruct-AWQ at tp 2 (2 A40s, vLLM 0.7.2, awq_marlin): 19.3952 GiB. The blog post
  "Running private LARGE AI Models on Your Hardware", https://weisser-zwerg.dev/posts/local-llm-large-llms/
  (its source: github.com/cs224/weisser-zwerg-dev-indie-web-sources, site/src/posts/local-llm-large-llms.md,
  section "Startup Timing and Performance"). The checkpoint's config.json pads intermediate_size to
  29,696 (29,568 in the 16-bit model) and quantizes with bits 4, group_size 128, zero_point (AutoAWQ GEMM).
- Llama 3.1 8B Instruct, AWQ and GPTQ 4-bit exports (kaitchup/Meta-Llama-3.1-8B-Instruct-awq-4bit and
  -gptq-4bit) at tp 1, vLLM 0.5.4 (awq_marlin, gptq_marlin): 5.3748 and 5.3494 GiB; the same run's bf16
  model 14.9888 GiB. https://kaitchup.substack.com/p/the-best-quantization-methods-to (benchmark_throughput
  logs, copied in github.com/xinyuwei-david/david-share, Deep-Learning/Quantization-Methods-Comparison-and-Practice).
- Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 at tp 1 on an L40S (vLLM 0.8.5.post1, gptq_marlin, no flag): 5.1811 GiB
  (shardplan/validation/corpus/engine_logs/vllm_v1_l40sx1_qwen25_7b_32k_gptq_int4.log, with its source).
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO

from shardplan.units import BYTES_PER_GIB

AWQ = {"bits": 4, "group_size": 128, "quant_method": "awq", "version": "gemm", "zero_point": True}
GPTQ = {"bits": 4, "group_size": 128, "quant_method": "gptq", "sym": True, "desc_act": False}


def _config(tmp_path, model: str, quant: dict, **changes) -> str:
    cfg = dict(yaml.safe_load((REPO / "model_specs" / f"{model}.yaml").read_text())["hf_config"])
    cfg.update(changes, quantization_config=quant)
    path = tmp_path / f"{model}-{quant['quant_method']}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _estimate(cli, config: str, gpu: str, tp: int, *more: str) -> tuple[dict, str]:
    res = cli("estimate", config, "-H", gpu, "--gpus", str(tp), "--tp", str(tp), "--json", *more)
    assert res.exit_code in (0, 3), res.stderr  # 3: does not fit, the report still printed
    return res.json(), res.stderr


def _weights_gib(d: dict) -> float:
    return d["memory"]["per_gpu_bytes"]["weights"] / BYTES_PER_GIB


@pytest.mark.parametrize("model,quant,changes,gpu,tp,version,logged_gib", [
    ("qwen2.5-72b", AWQ, {"intermediate_size": 29696}, "l40s-48gb", 2, "0.7.2", 19.3952),
    ("llama-3.1-8b", AWQ, {}, "a100-sxm-40gb", 1, "0.5.4", 5.3748),
    ("llama-3.1-8b", GPTQ, {}, "a100-sxm-40gb", 1, "0.5.4", 5.3494),
    ("qwen2.5-7b", GPTQ, {}, "l40s-48gb", 1, "0.8.5", 5.1811),
], ids=["qwen2.5-72b-awq-tp2", "llama-3.1-8b-awq", "llama-3.1-8b-gptq", "qwen2.5-7b-gptq-l40s"])
def test_a_4bit_checkpoint_is_planned_as_vllm_loads_it(cli, tmp_path, model, quant, changes, gpu, tp, version,
                                                       logged_gib):
    config = _config(tmp_path, model, quant, **changes)
    d, _ = _estimate(cli, config, gpu, tp, "--engine-version", version)
    method = quant["quant_method"]
    assert d["workload"]["quantization"] == method
    assert _weights_gib(d) == pytest.approx(logged_gib, rel=0.01)
    assert any(f"the linear weights stay 4-bit {method.upper()} as the checkpoint ships them" in a
               for a in d["assumptions"])
    # The same as asking for the format; a 16-bit copy on request (the bf16 Llama 3.1 8B logged 14.9888 GiB).
    asked, _ = _estimate(cli, config, gpu, tp, "--engine-version", version, "--quantization", method)
    assert asked["memory"] == d["memory"]
    copy, _ = _estimate(cli, config, gpu, tp, "--engine-version", version, "--weight-dtype", "bf16")
    assert copy["workload"]["quantization"] == "none" and _weights_gib(copy) > 2.5 * _weights_gib(d)
    if model == "llama-3.1-8b":
        assert _weights_gib(copy) == pytest.approx(14.9888, rel=0.005)


@pytest.mark.parametrize("gpu,method,planned", [
    ("v100-sxm-32gb", "awq", "none"),  # Volta: GPTQ only
    ("v100-sxm-32gb", "gptq", "gptq"),
    ("mi300x-192gb", "awq", "none"),  # AMD GPUs: neither
    ("mi300x-192gb", "gptq", "none"),
    ("rtx-4090-24gb", "awq", "awq"),  # Ada
    ("h100-sxm-80gb", "gptq", "gptq"),
])
def test_only_where_the_engine_runs_the_format(cli, tmp_path, gpu, method, planned):
    config = _config(tmp_path, "llama-3.1-8b", AWQ if method == "awq" else GPTQ)
    d, _ = _estimate(cli, config, gpu, 1)
    assert d["workload"]["quantization"] == planned
    if planned == "none":
        note = next(a for a in d["assumptions"] if "the checkpoint ships 4-bit" in a)
        arch = {"v100-sxm-32gb": "volta", "mi300x-192gb": "cdna3"}[gpu]
        assert f"not on a {arch} GPU" in note and "planned at the model's dtype, which needs the model's 16-bit checkpoint" in note
        assert "--quantization" not in note  # which would plan weights the engine cannot run here


def test_a_profile_that_states_no_architecture_keeps_the_models_dtype(cli, tmp_path):
    profile = yaml.safe_load((REPO / "hardware_profiles" / "l40s-48gb.yaml").read_text())
    del profile["gpu"]["architecture"]
    profile["name"] = "my-l40s"
    path = tmp_path / "my-l40s.yaml"
    path.write_text(yaml.safe_dump(profile))
    config = _config(tmp_path, "qwen2.5-7b", AWQ)
    d, _ = _estimate(cli, config, str(path), 1)
    assert d["workload"]["quantization"] == "none"
    assert any("not on a GPU whose profile states no gpu.architecture" in a for a in d["assumptions"])


def test_an_engine_that_does_not_load_the_format_says_so(cli, tmp_path):
    """llama.cpp loads GGUF files, not AWQ safetensors: the model's dtype, and why."""
    config = _config(tmp_path, "qwen2.5-7b", AWQ)
    d, _ = _estimate(cli, config, "l40s-48gb", 1, "--engine", "llamacpp")
    assert d["workload"]["quantization"] == "none"
    assert any("the checkpoint ships 4-bit AWQ weights" in a and "does not have it load the format as it ships" in a
               for a in d["assumptions"])


@pytest.mark.parametrize("engine,gpu,planned", [
    ("sglang", "l40s-48gb", "awq"),  # Marlin kernels: Ampere, Ada, Hopper
    ("sglang", "rtx-4090-24gb", "awq"),
    ("sglang", "v100-sxm-32gb", "none"),
    ("sglang", "mi300x-192gb", "none"),
])
def test_sglang_loads_the_format_where_its_marlin_kernels_run(cli, tmp_path, engine, gpu, planned):
    config = _config(tmp_path, "qwen2.5-7b", AWQ)
    d, _ = _estimate(cli, config, gpu, 1, "--engine", engine)
    assert d["workload"]["quantization"] == planned


@pytest.mark.parametrize("quant", [AWQ, GPTQ], ids=["awq", "gptq"])
@pytest.mark.parametrize("gpu,version,planned", [
    ("a100-sxm-80gb", None, True),  # compute capability 8.0: exllama (2.0), Marlin (2.1.1 on)
    ("l40s-48gb", "2.0.0", True),
    ("v100-sxm-32gb", None, False),  # 7.0: other kernels, not established
    ("a100-sxm-80gb", "1.4.5", False),  # before TGI read quantization_config (PR #1719, v2.0.0)
])
def test_tgi_loads_the_format_from_2_0_on_its_sm80_kernels(cli, tmp_path, quant, gpu, version, planned):
    """TGI 2.0.0 and later auto-select gptq or awq from the checkpoint's quantization_config, with no
    --quantize; the export still names it, which the launcher takes as the same choice."""
    config = _config(tmp_path, "qwen2.5-7b", quant)
    more = ("--engine", "tgi") + (("--engine-version", version) if version else ())
    d, _ = _estimate(cli, config, gpu, 1, *more)
    assert d["workload"]["quantization"] == (quant["quant_method"] if planned else "none")
    if planned:
        assert 5.0 < _weights_gib(d) < 5.5  # 4-bit weights, scales and zeros; 14.2 GiB at 16 bits
        plan = tmp_path / "plan.yaml"
        assert cli("recommend", config, "-H", gpu, "--gpus", "1", *more, "-o", plan).exit_code == 0
        assert f"--quantize {quant['quant_method']}" in cli("export", plan, "--to", "tgi").stdout
    else:
        assert any("the checkpoint ships 4-bit" in a for a in d["assumptions"])


def test_recommend_ranks_the_72b_awq_checkpoint_on_two_l40s(cli, tmp_path):
    """The 16-bit model (145 GB) holds on no fewer than four 48 GB GPUs; the AWQ checkpoint on two."""
    config = _config(tmp_path, "qwen2.5-72b", AWQ, intermediate_size=29696)
    res = cli("recommend", config, "-H", "l40s-48gb", "--gpus", "2", "--json")
    assert res.exit_code == 0, res.stderr
    top = res.json()["top"]
    assert top and {e["plan"]["quantization"] for e in top} == {"awq"}


def test_the_vllm_export_leaves_the_shipped_format_to_the_engine(cli, tmp_path):
    """No --quantization for a plan of the format the checkpoint ships (vLLM picks awq_marlin itself;
    `--quantization awq` would force the slower AWQ kernel)."""
    from shardplan.plan.manifest import load_manifest

    config = _config(tmp_path, "qwen2.5-7b", AWQ)
    plan = tmp_path / "plan.yaml"
    assert cli("recommend", config, "-H", "l40s-48gb", "--gpus", "1", "-o", plan).exit_code == 0
    assert load_manifest(plan).layout.weight_quantization == "awq"
    text = cli("export", plan, "--to", "vllm").stdout
    assert "vllm serve" in text and "--quantization" not in text
    # The 16-bit model's plan in AWQ needs the flag (and an AWQ checkpoint of it).
    other = tmp_path / "other.yaml"
    assert cli("recommend", "qwen2.5-7b", "-H", "l40s-48gb", "--gpus", "1", "--quantization", "awq",
               "-o", other).exit_code == 0
    assert "--quantization awq" in cli("export", other, "--to", "vllm").stdout


def test_other_widths_and_methods_keep_the_note(cli, tmp_path):
    """An 8-bit GPTQ or a 3-bit AWQ checkpoint is not one vLLM's 4-bit kernels take as such: the
    model's dtype, with the note at load naming the format to ask for."""
    eight = _config(tmp_path, "qwen2.5-7b", {**GPTQ, "bits": 8})
    d, err = _estimate(cli, eight, "l40s-48gb", 1)
    assert d["workload"]["quantization"] == "none" and "(--quantization int8)" in err


def test_a_split_into_partial_quantization_groups_does_not_fit(cli, tmp_path):
    """vLLM's AWQ and GPTQ layers refuse a rank's share of a row-parallel input that is not whole
    groups ("The input size is not aligned with the quantized weight shape", vllm#13980 for
    Qwen2.5-VL-72B-Instruct-AWQ): Qwen2.5-72B's 29,568-wide MLP is 115.5 groups of 128 at tp 2, which is
    why Qwen's 72B -AWQ release pads it to 29,696 (232 groups: whole at tp 2, 4 and 8)."""
    unpadded = _config(tmp_path, "qwen2.5-72b", AWQ)
    for tp in (2, 4, 8):
        d, _ = _estimate(cli, unpadded, "l40s-48gb", tp, "--max-model-len", "8192")
        assert not d["fits"] and "intermediate_size 29,568 / " in d["reason"] and "128-wide quantization groups" in d["reason"]
    padded = _config(tmp_path, "qwen2.5-72b", AWQ, intermediate_size=29696)
    for tp in (2, 4, 8):
        d, _ = _estimate(cli, padded, "l40s-48gb", tp, "--max-model-len", "8192")
        assert d["fits"], (tp, d["reason"])
    # A per-channel checkpoint (group_size -1) has no groups to split.
    channel = _config(tmp_path, "qwen2.5-72b", {**GPTQ, "group_size": -1})
    d, _ = _estimate(cli, channel, "l40s-48gb", 2, "--max-model-len", "8192")
    assert d["workload"]["quantization"] == "gptq" and "quantization groups" not in (d["reason"] or "")


@pytest.mark.parametrize("model,quant,gpu,starts,refused", [
    # vllm#17604: Qwen3-30B-A3B-AWQ (routed experts 768 wide) starts at tp 1 and 2, fails at tp 4 and 8
    # ("size_k must divisible by BLOCK_SIZE_K"); Qwen3-235B-A22B-GPTQ-Int4 (1,536) fails at tp 8 (vLLM 0.9.1).
    ("qwen3-30b-a3b", AWQ, "l40s-48gb", (1, 2), (4, 8)),
    ("qwen3-235b-a22b", GPTQ, "h100-sxm-80gb", (4,), (8,)),
])
def test_routed_experts_split_into_partial_quantization_groups_do_not_fit(cli, tmp_path, model, quant, gpu, starts, refused):
    """The routed experts' down projection is split over the expert tensor-parallel degree (tp without
    expert parallelism); vLLM's 4-bit MoE kernels need each rank's share in whole groups. With expert
    parallelism each rank holds whole experts, and the same GPUs load."""
    config = _config(tmp_path, model, quant)
    for tp in starts + refused:
        d, _ = _estimate(cli, config, gpu, tp, "--max-model-len", "8192")
        assert d["workload"]["quantization"] == quant["quant_method"]
        if tp in refused:
            width = 768 if model == "qwen3-30b-a3b" else 1536
            assert not d["fits"] and f"the routed experts' width {width:,} / {tp} = {width // tp:,} per rank" in d["reason"], tp
        else:
            assert "quantization groups" not in (d["reason"] or ""), (tp, d["reason"])
    for tp in refused:
        d, _ = _estimate(cli, config, gpu, tp, "--max-model-len", "8192", "--ep", str(tp))
        assert "quantization groups" not in (d["reason"] or ""), (tp, d["reason"])


def test_an_awq_checkpoint_that_fits_only_by_offloading_stays_awq(cli, tmp_path):
    """Llama 3.1 70B AWQ on one 24 GB L4: nothing fits on the GPU, so the fallback offloads layers. The
    plans are the shipped format's, not int4 (the same bytes, which an export would then ask to find
    another checkpoint for)."""
    config = _config(tmp_path, "llama-3.1-70b", AWQ)
    res = cli("recommend", config, "-H", "l4-24gb", "--gpus", "1", "--max-model-len", "4096", "--top", "6",
              "--expand", "--json")
    assert res.exit_code == 0, res.stderr
    formats = [e["plan"]["quantization"] for e in res.json()["top"]]
    assert formats[0] == "awq" and "int4" not in formats, formats
    plan = tmp_path / "plan.yaml"
    assert cli("recommend", config, "-H", "l4-24gb", "--gpus", "1", "--max-model-len", "4096", "-o", plan).exit_code == 0
    text = " ".join(cli("export", plan, "--to", "vllm").stdout.replace("#", " ").split())
    assert "need a checkpoint in that format" not in text and "--quantization" not in text


def test_a_hostile_bits_value_loads_with_a_note(cli, tmp_path):
    for bits in ([4], {"a": 4}, 4.0, "4", True):
        config = _config(tmp_path, "qwen2.5-7b", {**AWQ, "bits": bits})
        res = cli("estimate", config, "-H", "l40s-48gb", "--gpus", "1", "--json")
        assert res.exit_code in (0, 3), (bits, res.stderr)
        assert res.json()["workload"]["quantization"] == "none" and "note: the checkpoint's weights are quantized" in res.stderr


def test_a_plan_written_before_the_4bit_fields_still_names_its_model(cli, tmp_path):
    """Plans hash the model spec; a plan of an AWQ config written before shardplan read its
    quantization_config (a 16-bit plan) carries the hash of the spec without the new fields."""
    import yaml as _yaml

    from shardplan.plan.manifest import spec_sha256
    from shardplan.specs.loading import load_model

    config = _config(tmp_path, "qwen2.5-7b", AWQ)
    plan = tmp_path / "plan.yaml"
    assert cli("recommend", config, "-H", "l40s-48gb", "--gpus", "1", "--weight-dtype", "bf16", "-o", plan).exit_code == 0
    spec = load_model(config).spec
    older = spec_sha256(spec.model_copy(update={"checkpoint_quantization": None, "checkpoint_group_size": None}))
    doc = _yaml.safe_load(plan.read_text())
    assert doc["model"]["spec_sha256"] != older
    doc["model"]["spec_sha256"] = older
    plan.write_text(_yaml.safe_dump(doc, sort_keys=False))
    res = cli("export", plan, "--to", "vllm")
    assert res.exit_code == 0, res.stderr
    doc["model"]["spec_sha256"] = "0" * 64  # a spec that did change is still refused
    plan.write_text(_yaml.safe_dump(doc, sort_keys=False))
    assert cli("export", plan, "--to", "vllm").exit_code == 2


# ----- llm-compressor compressed-tensors checkpoints (RedHatAI / neuralmagic releases) ---------------------

CT_FP8_DYNAMIC = {  # RedHatAI/Qwen2.5-7B-Instruct-FP8-dynamic's quantization_config (quoted in the corpus log's source)
    "config_groups": {"group_0": {
        "input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "float"},
        "output_activations": None, "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": "channel", "symmetric": True,
                    "type": "float"}}},
    "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed"}
CT_INT8 = {**CT_FP8_DYNAMIC, "format": "int-quantized", "config_groups": {"group_0": {
    "input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "int"},
    "targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel", "symmetric": True, "type": "int"}}}}
CT_W4A16 = {**CT_FP8_DYNAMIC, "format": "pack-quantized", "config_groups": {"group_0": {
    "input_activations": None, "targets": ["Linear"],
    "weights": {"group_size": 128, "num_bits": 4, "strategy": "group", "symmetric": True, "type": "int"}}}}


def test_a_compressed_tensors_fp8_checkpoint_is_planned_in_fp8(cli, tmp_path):
    """RedHatAI/Qwen2.5-7B-Instruct-FP8-dynamic on one L40S, vLLM 0.8.5.post1 (no flag; it printed
    quantization=compressed-tensors): "Model loading took 8.1426 GiB", "GPU KV cache size: 553,216 tokens"
    (shardplan/validation/corpus/engine_logs/vllm_v1_l40sx1_qwen25_7b_32k_fp8dyn.log, with its source)."""
    config = _config(tmp_path, "qwen2.5-7b", CT_FP8_DYNAMIC)
    d, _ = _estimate(cli, config, "l40s-48gb", 1, "--engine-version", "0.8.5", "--max-model-len", "32768")
    assert d["workload"]["quantization"] == "fp8"
    assert _weights_gib(d) == pytest.approx(8.1426, rel=0.01)
    assert d["kv_cache"]["capacity_tokens"] == pytest.approx(553216, rel=0.05)
    assert any("the linear weights stay FP8 (compressed-tensors) as the checkpoint ships them" in a for a in d["assumptions"])
    # Ampere runs it as W8A16 (FP8 Marlin), MI300X as W8A8; Volta not: the model's dtype, and why.
    planned = {gpu: _estimate(cli, config, gpu, 1)[0]["workload"]["quantization"]
               for gpu in ("a100-sxm-80gb", "mi300x-192gb", "v100-sxm-32gb")}
    assert planned == {"a100-sxm-80gb": "fp8", "mi300x-192gb": "fp8", "v100-sxm-32gb": "none"}


@pytest.mark.parametrize("quant,planned,first", [(CT_INT8, "int8", "0.7.0"), (CT_W4A16, "int4", "0.8.0")],
                         ids=["int8-w8a8", "w4a16"])
def test_compressed_tensors_int_schemes_from_the_release_that_documents_them(cli, tmp_path, quant, planned, first):
    config = _config(tmp_path, "llama-3.1-8b", quant)
    d, _ = _estimate(cli, config, "a100-sxm-80gb", 1, "--engine-version", first)
    assert d["workload"]["quantization"] == planned
    asked, _ = _estimate(cli, config, "a100-sxm-80gb", 1, "--engine-version", first, "--quantization", planned)
    assert asked["memory"] == d["memory"]
    older, _ = _estimate(cli, config, "a100-sxm-80gb", 1, "--engine-version", "0.6.6")
    assert older["workload"]["quantization"] == "none"
    assert any("the checkpoint ships" in a and "(compressed-tensors)" in a for a in older["assumptions"])


def test_a_w4a16_checkpoint_splits_into_whole_groups_only(cli, tmp_path):
    config = _config(tmp_path, "qwen2.5-72b", CT_W4A16)
    d, _ = _estimate(cli, config, "l40s-48gb", 2, "--max-model-len", "8192")
    assert d["workload"]["quantization"] == "int4" and not d["fits"] and "128-wide quantization groups" in d["reason"]


def test_a_scheme_this_does_not_read_keeps_the_note(cli, tmp_path):
    """Two config groups with different schemes, or 8-bit integer weights alone (W8A16): the model's
    dtype, with the note at load."""
    mixed = {**CT_FP8_DYNAMIC, "config_groups": {**CT_FP8_DYNAMIC["config_groups"], **{"group_1": CT_INT8["config_groups"]["group_0"]}}}
    w8a16 = {**CT_FP8_DYNAMIC, "config_groups": {"group_0": {"input_activations": None, "targets": ["Linear"],
                                                             "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}
    for quant in (mixed, w8a16, {**CT_FP8_DYNAMIC, "config_groups": []}):
        d, err = _estimate(cli, _config(tmp_path, "qwen2.5-7b", quant), "l40s-48gb", 1)
        assert d["workload"]["quantization"] == "none" and "note: the checkpoint's weights are quantized (compressed-tensors" in err


@pytest.mark.parametrize("gpu,method,refused", [
    ("v100-sxm-32gb", "awq", True), ("v100-sxm-32gb", "gptq", False),
    ("mi300x-192gb", "awq", True), ("mi300x-192gb", "gptq", True),
    ("b200-sxm-180gb", "awq", False),  # not in vLLM's table either way: not established, not refused
    ("h100-sxm-80gb", "awq", False),
])
def test_a_format_the_engine_does_not_run_on_the_gpu_is_refused_when_asked_for(cli, gpu, method, refused):
    """vLLM's quantization hardware table marks AWQ unsupported on Volta and AMD GPUs and GPTQ on AMD
    GPUs: a plan in it would not start, so asking for it is bad input, one line naming the option."""
    res = cli("estimate", "llama-3.1-8b", "-H", gpu, "--gpus", "1", "--quantization", method, "--json")
    if refused:
        assert res.exit_code == 2 and res.stdout == "" and len(res.stderr.strip().splitlines()) == 1
        assert f"field '--quantization': vLLM 0.33.0 does not run {method.upper()} on" in res.stderr
    else:
        assert res.exit_code in (0, 3) and res.json()["workload"]["quantization"] == method
