"""llama.cpp's quantized KV cache (--cache-type-k/v q8_0|q4_0): ggml's block bytes per value, the
engine rule that only llama.cpp takes them, the decode time that reads fewer bytes, and the export."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shardplan.cli import app
from shardplan.cost.gguf import GGML_BLOCKS, GgmlType
from shardplan.cost.inputs import inference_workload
from shardplan.cost.kv import kv_cache_bytes_per_token, kv_elements_per_token_per_layer, num_kv_layers
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import engine_rules
from shardplan.specs.loading import load_hardware, load_model
from shardplan.units import DType, bytes_per_element

SPEC = load_model("llama-3.1-8b").spec
HW = load_hardware("rtx-4090-24gb").with_topology(gpus_per_node=1, num_nodes=1)
BASE = ["estimate", "llama-3.1-8b", "-H", "rtx-4090-24gb", "--gpus", "1", "--engine", "llamacpp",
        "--quantization", "q4_k_m", "--max-model-len", "8192", "--batch-size", "1", "--json"]


@pytest.mark.parametrize("fmt,block", [(DType.Q8_0, (32, 34)), (DType.Q4_0, (32, 18))])
def test_kv_bytes_per_token_use_ggml_blocks(fmt, block):
    values = kv_elements_per_token_per_layer(SPEC) * num_kv_layers(SPEC)  # 2 x 8 x 128 x 32 = 65,536
    assert values == 65536
    assert kv_cache_bytes_per_token(SPEC, bytes_per_element(fmt)) == values * block[1] / block[0]
    assert GGML_BLOCKS[GgmlType(fmt.value)] == block  # one table for weights and KV


def _wl(engine: str, kv: str):
    return inference_workload(
        engine=engine_rules(engine), hw=HW, model_max_len=SPEC.max_position_embeddings, max_model_len=8192,
        max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
        kv_cache_dtype=kv, weight_dtype=None, quantization=None, enforce_eager=False, input_len=1024,
        output_len=128, batch_size=1)


def test_only_llama_cpp_takes_ggml_kv_formats():
    with pytest.raises(ShardplanError) as e:
        _wl("vllm", "q8_0")
    assert e.value.field == "--kv-cache-dtype"
    wl = _wl("llamacpp", "q4_0")
    assert wl.kv_cache_dtype is DType.Q4_0
    assert any("flash_attn" in a for a in wl.assumptions)  # the quantized-V rule is printed


def _estimate(*extra: str) -> dict:
    result = CliRunner().invoke(app, [*BASE, *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_json_sizes_and_times_a_q8_0_cache():
    f16, q8 = _estimate(), _estimate("--kv-cache-dtype", "q8_0")
    assert q8["kv_cache"]["bytes_per_token"] == f16["kv_cache"]["bytes_per_token"] * 34 / 64
    # Decode attention reads the cache: fewer bytes, a shorter token (weights dominate at 8k).
    assert q8["time"]["tpot_seconds"] < f16["time"]["tpot_seconds"]
    at_long = [_estimate("--max-model-len", "131072", "--input-len", "100000", *kv)["time"]["tpot_seconds"]
               for kv in ((), ("--kv-cache-dtype", "q4_0"))]
    assert at_long[1] < 0.9 * at_long[0]


def test_cli_refuses_q8_0_kv_for_vllm_in_one_line(cli):
    result = cli("estimate", "llama-3.1-8b", "-H", "rtx-4090-24gb", "--gpus", "1", "--kv-cache-dtype", "q8_0")
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "ggml block format" in result.stderr


def test_export_emits_the_cache_type(cli, tmp_path):
    plan = tmp_path / "plan.yaml"
    r = cli("recommend", "llama-3.1-8b", "--hardware", "rtx-3090-24gb", "--gpus", "1", "--engine", "llamacpp",
            "--max-model-len", "8192", "--kv-cache-dtype", "q8_0", "-o", str(plan), "--json")
    assert r.exit_code == 0, r.stderr
    r = cli("export", str(plan), "--to", "llamacpp", "-o", str(tmp_path / "out"))
    assert r.exit_code == 0, r.stderr
    serve = (tmp_path / "out" / "serve.sh").read_text().replace("\\\n", " ")
    assert "--cache-type-k q8_0 --cache-type-v q8_0 --flash-attn on" in " ".join(serve.split())
