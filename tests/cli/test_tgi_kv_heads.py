"""TGI gives each tensor-parallel rank num_key_value_heads // num_shard KV heads of its own and copies
none: flash_llama_modeling.py refuses a split that leaves a rank part of a head ("`num_key_value_heads`
must be divisible by `num_shards`", PR #2039, first in v2.1.0, still in v3.3.7), and the Gemma, Mistral and Qwen2 files
divide by zero heads (huggingface/text-generation-inference#1987: Gemma on 4 shards, "ShardCannotStart").
vLLM and SGLang copy a KV head to the ranks that share it, so the same split starts there."""

from __future__ import annotations

import json

import yaml
from conftest import REPO


def _estimate(cli, model: str, gpu: str, tp: int, engine: str) -> dict:
    res = cli("estimate", model, "-H", gpu, "--gpus", str(tp), "--tp", str(tp), "--engine", engine,
              "--max-model-len", "8192", "--json")
    assert res.exit_code in (0, 3), res.stderr  # 3: does not fit, the report still printed
    return res.json()


def test_tgi_refuses_a_tp_that_does_not_divide_the_kv_heads(cli):
    """Qwen3-235B-A22B has 64 query heads and 4 KV heads: tp 8 splits the query heads evenly and
    the KV heads into halves."""
    d = _estimate(cli, "qwen3-235b-a22b", "h200-sxm-141gb", 8, "tgi")
    assert not d["fits"] and "num_key_value_heads 4 / tp 8 is not whole heads per rank" in d["reason"]
    assert d["workload"]["kv_heads_copied"] is False
    vllm = _estimate(cli, "qwen3-235b-a22b", "h200-sxm-141gb", 8, "vllm")
    assert vllm["fits"] and vllm["workload"]["kv_heads_copied"] is True
    assert _estimate(cli, "qwen3-235b-a22b", "h200-sxm-141gb", 4, "tgi")["fits"]


def test_a_multi_query_model_on_tgi_runs_on_one_shard_only(cli, tmp_path):
    """Gemma 2B keeps one KV head (multi-query attention): the #1987 case, 4 shards, and 2 likewise."""
    cfg = dict(yaml.safe_load((REPO / "model_specs" / "gemma-2-9b.yaml").read_text())["hf_config"])
    cfg.update(num_key_value_heads=1, num_attention_heads=8, hidden_size=2048, head_dim=256, intermediate_size=16384,
               num_hidden_layers=18, model_type="gemma")
    for k in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "sliding_window",
              "cache_implementation"):
        cfg.pop(k, None)
    path = tmp_path / "gemma-2b.json"
    path.write_text(json.dumps(cfg))
    for tp in (2, 4):
        d = _estimate(cli, str(path), "a10g-24gb", tp, "tgi")
        assert not d["fits"] and f"num_key_value_heads 1 / tp {tp}" in d["reason"], tp
    assert _estimate(cli, str(path), "a10g-24gb", 1, "tgi")["fits"]


def test_recommend_for_tgi_keeps_to_the_splits_it_starts(cli):
    res = cli("recommend", "qwen3-235b-a22b", "-H", "h200-sxm-141gb", "--gpus", "8", "--engine", "tgi",
              "--max-model-len", "8192", "--top", "10", "--json")
    assert res.exit_code == 0, res.stderr
    top = res.json()["top"]
    assert top and all(4 % e["plan"]["tp"] == 0 for e in top), [e["plan"]["tp"] for e in top]


def test_a_plan_written_before_the_rule_was_recorded_takes_the_engines_own(cli, tmp_path):
    """A manifest without the workload's kv_heads_copied (written before it was recorded) is re-planned
    by the rules of its engine version: TGI's, so 8 GPUs still give tp 4, not tp 8."""
    plan = tmp_path / "plan.yaml"
    assert cli("recommend", "qwen3-235b-a22b", "-H", "h200-sxm-141gb", "--gpus", "4", "--engine", "tgi",
               "--max-model-len", "8192", "-o", plan).exit_code == 0
    d = yaml.safe_load(plan.read_text())
    for key in ("kv_heads_copied", "speculative_with_pp", "fp8_marlin_architectures"):
        d["workload"].pop(key)
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(d, sort_keys=False))
    res = cli("replan", old, "--gpus", "8", "--json")
    assert res.exit_code == 0, res.stderr
    text = json.dumps(res.json())
    assert '"tp": 8' not in text and '"tp": 4' in text
