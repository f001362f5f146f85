"""gpt-oss as it ships (issue 27: MXFP4 experts): engines that run the checkpoint's MXFP4 experts
plan them at 4.25 bits a weight (OCP MX: 32 FP4 values share one 8-bit scale), so gpt-oss-120b
fits one 80 GB GPU, as OpenAI's model card says it runs ("gpt-oss-120b ... runs efficiently on a
single 80 GB GPU", https://openai.com/index/introducing-gpt-oss/); asking for MXFP4 where it does
not apply is one line, exit 2."""

from __future__ import annotations

from conftest import REPO

from shardplan.cost.params import count_params
from shardplan.cost.weights import MXFP4_BYTES_PER_ELEMENT
from shardplan.specs.loading import load_model
from shardplan.units import BYTES_PER_GIB

GPT_OSS = str(REPO / "shardplan" / "validation" / "corpus" / "serving_load" / "models" / "gpt-oss-120b.json")


def _ok(res):
    assert res.exit_code == 0, (res.exit_code, res.stderr[-2000:])
    return res.json()


def _one_line_error(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.stdout[-500:], res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("note:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _weights(d):
    return d["memory"]["per_gpu_bytes"]["weights"]


def test_the_checkpoint_as_shipped_holds_its_experts_at_4_25_bits(cli):
    """--quantization mxfp4: the checkpoint's bytes, experts' matrices at 4.25 bits, the rest at 16."""
    d = _ok(cli("estimate", GPT_OSS, "-H", "h100-sxm-80gb", "--gpus", "1", "--engine", "vllm",
                "--engine-version", "0.11.0", "--quantization", "mxfp4", "--max-model-len", "32768", "--json"))
    assert d["workload"]["quantization"] == "mxfp4"
    spec = load_model(GPT_OSS).spec
    counts = count_params(spec)
    experts = counts.by_component["experts"]
    bias = spec.num_layers * spec.moe.num_experts * (2 * spec.moe.expert_intermediate_size + spec.hidden_size)
    expected = (experts - bias) * MXFP4_BYTES_PER_ELEMENT + (counts.total - experts + bias) * 2
    assert abs(_weights(d) - expected) / expected < 0.01, (_weights(d) / BYTES_PER_GIB, expected / BYTES_PER_GIB)


def test_vllm_on_an_h100_pads_the_experts_for_marlin_and_refuses_the_full_context_as_it_did(cli):
    """Without FP4 tensor cores (and triton_kernels) vLLM runs MXFP4 on Marlin, padding each expert
    to 2,944 x 3,072 (mxfp4.py at 0.11.0): it logged "Model loading took 65.9651 GiB" for gpt-oss-120b
    on an H100 at 0.10.1 and failed to start at the default 131,072-token context ("Available KV
    cache memory: -2.14 GiB", https://github.com/vllm-project/vllm/issues/23278)."""
    res = cli("estimate", GPT_OSS, "-H", "h100-sxm-80gb", "--gpus", "1", "--engine", "vllm",
              "--engine-version", "0.10.1", "--json")
    assert res.exit_code == 3, res.stderr  # a plan that does not fit
    d = res.json()
    assert d["workload"]["quantization"] == "mxfp4_marlin"
    assert any("Marlin" in a for a in d["assumptions"])
    logged = 65.9651 * BYTES_PER_GIB
    assert abs(_weights(d) / logged - 1) < 0.01, _weights(d) / BYTES_PER_GIB
    assert not d["fits"] and "max seq len (131072)" in d["reason"]


def test_gpt_oss_120b_serves_on_one_80gb_gpu_at_a_32k_context(cli):
    """OpenAI: gpt-oss-120b "runs efficiently on a single 80 GB GPU" (https://openai.com/index/introducing-gpt-oss/);
    GPUStack served it on one H100 with vLLM 0.10.2 at --max-model-len 32768 (shardplan/validation/corpus/serving_load)."""
    d = _ok(cli("estimate", GPT_OSS, "-H", "h100-sxm-80gb", "--gpus", "1", "--engine", "vllm",
                "--engine-version", "0.10.2", "--max-model-len", "32768", "--json"))
    assert d["fits"] and d["workload"]["quantization"] == "mxfp4_marlin"
    assert 55 * BYTES_PER_GIB < _weights(d) < 70 * BYTES_PER_GIB


def test_an_engine_before_mxfp4_plans_the_experts_at_16_bits(cli):
    d = _ok(cli("estimate", GPT_OSS, "-H", "h100-sxm-80gb", "--gpus", "4", "--tp", "4", "--engine", "vllm",
                "--engine-version", "0.10.0", "--json"))
    assert d["workload"]["quantization"] == "none"
    assert d["memory"]["per_gpu_bytes"]["weights"] > 50 * BYTES_PER_GIB  # 217 GiB over 4 GPUs
    _one_line_error(cli("estimate", GPT_OSS, "-H", "h100-sxm-80gb", "--gpus", "4", "--engine", "vllm",
                        "--engine-version", "0.10.0", "--quantization", "mxfp4"),
                    "does not run MXFP4", "--quantization")


def test_mxfp4_on_a_model_without_mxfp4_experts_is_one_line(cli):
    _one_line_error(cli("estimate", "llama-3.1-8b", "--gpus", "1", "--quantization", "mxfp4"),
                    "mxfp4", "--quantization")
