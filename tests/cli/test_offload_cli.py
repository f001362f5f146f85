"""Serving offload options through the real entry point: what each engine accepts, and bad input
as one line with exit 2."""

from __future__ import annotations

import pytest


def _one_line_exit_2(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args,needles", [
    (("--cpu-offload-gb", "-3"), ("--cpu-offload-gb", "at least 0")),
    (("--quantization", "q4_k_z"), ("--quantization", "q4_k_m")),  # an unknown GGUF type names the known ones
    (("--engine", "sglang", "--offload-layers", "4"), ("--offload-layers", "sglang")),
    (("--engine", "vllm", "--offload", "all-nvme", "--offload-layers", "4"), ("--offload", "cpu")),
    (("--offload-layers", "4", "--n-gpu-layers", "20"), ("--n-gpu-layers", "one of them")),
    (("--offload-layers", "40"), ("--offload-layers", "has 32")),
    (("--workload", "training", "--offload-layers", "4"), ("--offload-layers", "serving")),
    (("--engine", "transformers", "--offload", "all-nvme"), ("--offload", "--offload-layers N")),
])
def test_bad_offload_options_are_one_line(cli, args, needles):
    _one_line_exit_2(cli("estimate", "llama-3.1-8b", "-H", "rtx-4090-24gb", "--gpus", "1", *args), *needles)


def test_a_profile_without_host_dram_bandwidth_says_which_field_llama_cpp_needs(cli):
    res = cli("estimate", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", "--engine", "llamacpp",
              "--quantization", "q4_k_m", "--n-gpu-layers", "20")
    _one_line_exit_2(res, "node.host_memory_bandwidth_gb_per_s", "h100-sxm-80gb")


def test_cpu_offload_gb_becomes_whole_layers_holding_at_least_that_much(cli):
    d = cli("estimate", "llama-3.1-8b", "-H", "rtx-4090-24gb", "--gpus", "1", "--engine", "vllm",
            "--cpu-offload-gb", "4", "--max-model-len", "8192", "--json").json()
    off = d["plan"]["offload"]
    assert off["params"] == "cpu" and off["layers"] > 0
    host = d["memory"]["per_rank"][0]["host_offload_bytes"]
    per_layer = host / off["layers"]
    assert host >= 4 * 2**30 > host - per_layer  # the fewest whole layers holding 4 GiB
    assert d["time"]["breakdown"]["decode_step"]["offload"] > 0


def test_n_gpu_layers_is_llama_cpps_count_of_layers_on_the_gpu(cli):
    d = cli("estimate", "llama-3.1-8b", "-H", "rtx-4090-24gb", "--gpus", "1", "--engine", "llamacpp",
            "--quantization", "q4_k_m", "--n-gpu-layers", "20", "--max-model-len", "8192", "--json").json()
    assert d["plan"]["offload"]["layers"] == 32 + 1 - 20  # llama.cpp counts the output layer as one of the 20
    assert d["workload"]["quantization"] == "q4_k_m"


def test_disk_offload_of_layers_for_serving_names_where_not_an_optimizer(cli):
    """`--offload all-nvme --offload-layers N` on transformers (accelerate's disk offload): the layers
    go to NVMe; the optimizer half of the training choice does not apply to serving."""
    d = cli("estimate", "llama-3.1-8b", "-H", "rtx-4090-24gb", "--gpus", "1", "--engine", "transformers",
            "--offload", "all-nvme", "--offload-layers", "10", "--json").json()
    assert d["plan"]["offload"] == {"optimizer": "none", "params": "nvme", "layers": 10}
    assert d["time"]["breakdown"]["decode_step"]["offload"] > 0
