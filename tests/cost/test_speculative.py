"""Speculative decoding in serving memory (cost/speculative.py): the draft's or the MTP layers'
weights on the last stage, their KV in the same pool, the lookahead slots, the inputs' checks,
and the CLI's --json and one-line errors. Figures are worked by hand from the bundled configs."""

from __future__ import annotations

import json
import math

import pytest

from shardplan.cost.inputs import speculative_setup
from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost.speculative import Speculative, SpeculativeMethod
from shardplan.cost.workload import InferenceWorkload
from shardplan.errors import ShardplanError
from shardplan.specs.loading import load_hardware, load_model

PARTS = ("weights", "kv_cache", "activations", "gradients", "optimizer_states", "temporary", "overhead")


def _hw(gpus: int, profile: str = "h100-sxm-80gb"):
    return load_hardware(profile).with_topology(gpus_per_node=gpus, num_nodes=1)


def _llama_pair():
    return load_model("llama-3.1-70b").spec, load_model("llama-3.2-1b").spec


def _draft(k: int = 4) -> Speculative:
    _, draft = _llama_pair()
    return Speculative(method=SpeculativeMethod.DRAFT_MODEL, num_speculative_tokens=k, draft=draft)


# Llama 3.2 1B at tp 4 (hidden 2048, 16 layers, 32 q / 8 KV heads of 64, MLP 8192, vocab 128256 tied):
#   embedding 128256 x 2048 / 4                                 =  65,667,072
#   per layer: q, o 2048 x 2048 / 4 each; k, v 2048 x 512 / 4 each =   2,621,440
#              gate, up, down 3 x 2048 x 8192 / 4                 =  12,582,912
#              two RMSNorms 2 x 2048 (replicated)                 =       4,096
#   16 layers                                                     = 243,335,168
#   final norm                                                    =       2,048
#   elements 309,004,288 x 2 bytes (bf16)                        = 618,008,576
#   rotary cos/sin cache 131072 positions x 64 x 2 bytes          =  16,777,216
DRAFT_WEIGHTS_PER_RANK_BYTES = 634_785_792
# KV per token per rank: target 80 layers x 2 x (8 / 4 heads) x 128 x 2 bytes = 81,920;
# draft 16 layers x 2 x (8 / 4) x 64 x 2 = 8,192: 90,112 together, 11/10 of the target's.
TARGET_KV_PER_TOKEN_BYTES = 81_920
WITH_DRAFT_KV_PER_TOKEN_BYTES = 90_112


def test_draft_model_weights_and_kv_per_rank_llama_70b_with_1b_at_tp4():
    target, _ = _llama_pair()
    layout, hw = Layout(tp=4), _hw(4)
    base = serving_memory(target, hw, layout, InferenceWorkload(max_model_len=8192))
    spec = serving_memory(target, hw, layout, InferenceWorkload(max_model_len=8192, speculative=_draft()))
    r0, r1 = base.ranks[0], spec.ranks[0]
    assert r1.detail["weights.draft"] == DRAFT_WEIGHTS_PER_RANK_BYTES
    assert r1.breakdown.weights - r0.breakdown.weights == DRAFT_WEIGHTS_PER_RANK_BYTES
    assert base.kv_bytes_per_token_per_rank == [TARGET_KV_PER_TOKEN_BYTES]
    assert spec.kv_bytes_per_token_per_rank == [WITH_DRAFT_KV_PER_TOKEN_BYTES]
    # The 1B draft's profiling peak stays below the 70B's: the same activations, so the pool
    # shrinks by the draft's weights alone and each block costs 11/10 as much.
    assert r1.breakdown.activations == r0.breakdown.activations
    assert r1.breakdown.kv_cache == pytest.approx(r0.breakdown.kv_cache - DRAFT_WEIGHTS_PER_RANK_BYTES, abs=1e-3)
    assert base.kv_num_blocks == int(r0.breakdown.kv_cache // (16 * TARGET_KV_PER_TOKEN_BYTES))
    assert spec.kv_num_blocks == int((r0.breakdown.kv_cache - DRAFT_WEIGHTS_PER_RANK_BYTES) // (16 * WITH_DRAFT_KV_PER_TOKEN_BYTES))
    assert spec.kv_num_blocks < base.kv_num_blocks * 10 / 11
    # The draft's share of the one pool is its share of a token's bytes.
    assert r1.detail["kv_cache.draft"] == pytest.approx(r1.breakdown.kv_cache * 8_192 / 90_112)


def test_breakdown_still_sums_and_weight_details_add_up_with_a_draft():
    target, _ = _llama_pair()
    sm = serving_memory(target, _hw(8), Layout(tp=4, pp=2), InferenceWorkload(max_model_len=8192, speculative=_draft()))
    for r in sm.ranks:
        b = r.breakdown.as_dict()
        assert sum(b[p] for p in PARTS) == pytest.approx(b["total"], rel=1e-12)
        weights = sum(v for k, v in r.detail.items() if k.startswith("weights."))
        assert weights == pytest.approx(r.breakdown.weights, rel=1e-12)
    # The drafter lives on the last pipeline stage only.
    assert "weights.draft" not in sm.ranks[0].detail and "weights.draft" in sm.ranks[1].detail


def test_lookahead_slots_lower_the_running_concurrency_not_the_startup_check():
    target, _ = _llama_pair()
    sm = serving_memory(target, _hw(4), Layout(tp=4), InferenceWorkload(max_model_len=8192, speculative=_draft(k=4)))
    kv = sm.ranks[0].breakdown.kv_cache
    # start-up: 8192 / 16 = 512 blocks per sequence; running: ceil((8192 + 4) / 16) = 513
    assert sm.kv_bytes_per_sequence == 512 * 16 * WITH_DRAFT_KV_PER_TOKEN_BYTES
    assert sm.max_concurrency == pytest.approx(kv / (513 * 16 * WITH_DRAFT_KV_PER_TOKEN_BYTES))


# DeepSeek-V3's one MTP module at tp 8, bf16, experts over etp 8 (hidden 7168, vocab 129280):
#   enorm, hnorm 2 x 7168; eh_proj 2 x 7168 x 7168 (replicated)                 =   102,774,784
#   MLA attention: q_a 7168 x 1536 + its norm 1536 + kv_a 7168 x 576 + its norm 512 (replicated)
#                  + q_b 1536 x 128 x 192 / 8 + kv_b 512 x 128 x 256 / 8 + o 16384 x 7168 / 8
#                                                                               =    36,636,672
#   router 7168 x 256 + bias 256                                                =     1,835,264
#   routed experts 256 x 3 x 7168 x 2048 / 8                                    = 1,409,286,144
#   shared expert 3 x 7168 x 2048 / 8; block norms 2 x 7168; shared_head.norm 7168 = 5,526,528
#   SharedHead.head 129280 x 7168 / 8                                           =   115,834,880
#   elements 1,671,894,272 x 2 bytes                                            = 3,343,788,544
MTP_WEIGHTS_PER_RANK_BYTES = 3_343_788_544


def test_deepseek_v3_mtp_adds_one_layer_of_weights_and_kv():
    spec = load_model("deepseek-v3").spec
    assert spec.num_mtp_layers == 1
    mtp = Speculative(method=SpeculativeMethod.MTP, num_speculative_tokens=1)
    hw, layout = _hw(8, "h200-sxm-141gb"), Layout(tp=8)
    base = serving_memory(spec, hw, layout, InferenceWorkload(max_model_len=8192))
    with_mtp = serving_memory(spec, hw, layout, InferenceWorkload(max_model_len=8192, speculative=mtp))
    assert with_mtp.ranks[0].detail["weights.mtp"] == MTP_WEIGHTS_PER_RANK_BYTES
    assert with_mtp.ranks[0].breakdown.weights - base.ranks[0].breakdown.weights == MTP_WEIGHTS_PER_RANK_BYTES
    # MLA: (512 + 64) x 2 bytes = 1,152 per layer, replicated over tp: 61 layers, then 62.
    assert base.kv_bytes_per_token_per_rank == [61 * 1152]
    assert with_mtp.kv_bytes_per_token_per_rank == [62 * 1152]


def test_ngram_costs_no_memory_but_its_lookahead():
    target, _ = _llama_pair()
    ngram = Speculative(method=SpeculativeMethod.NGRAM, num_speculative_tokens=16)
    base = serving_memory(target, _hw(4), Layout(tp=4), InferenceWorkload(max_model_len=8192))
    sm = serving_memory(target, _hw(4), Layout(tp=4), InferenceWorkload(max_model_len=8192, speculative=ngram))
    assert sm.ranks[0].breakdown == base.ranks[0].breakdown and sm.kv_num_blocks == base.kv_num_blocks
    assert sm.max_concurrency == pytest.approx(base.max_concurrency * 512 / 513)  # ceil((8192 + 16) / 16) = 513


def test_a_draft_whose_heads_do_not_split_over_tp_does_not_fit():
    target, _ = _llama_pair()  # 70B: 64 heads; 1B: 32 heads, so tp 64 would not split the draft
    sm = serving_memory(target, _hw(8), Layout(tp=8), InferenceWorkload(max_model_len=8192, speculative=_draft()))
    assert sm.fits
    odd = load_model("llama-3.2-1b").spec.model_copy(update={"num_attention_heads": 12, "num_key_value_heads": 4})
    bad = Speculative(method=SpeculativeMethod.DRAFT_MODEL, num_speculative_tokens=2, draft=odd)
    sm = serving_memory(target, _hw(8), Layout(tp=8), InferenceWorkload(max_model_len=8192, speculative=bad))
    assert not sm.fits and "12 attention heads do not divide over tp = 8" in (sm.reason or "")


@pytest.mark.parametrize("kwargs,field,needle", [
    (dict(method=None, num_speculative_tokens=0, use_draft=True), "--num-speculative-tokens", "at least 1"),
    (dict(method=None, num_speculative_tokens=-3, use_draft=True), "--num-speculative-tokens", "at least 1"),
    (dict(method="mtp", num_speculative_tokens=1, use_draft=False), "--speculative-method", "no multi-token-prediction"),
    (dict(method="draft_model", num_speculative_tokens=2, use_draft=False), "--speculative-method", "needs a draft"),
    (dict(method="ngram", num_speculative_tokens=2, use_draft=True), "--speculative-model", "uses no draft model"),
    (dict(method=None, num_speculative_tokens=None, use_draft=True), "--num-speculative-tokens", "needs the number"),
    (dict(method=None, num_speculative_tokens=4, use_draft=False), "--num-speculative-tokens", "without a speculative"),
])
def test_bad_speculative_inputs_name_the_option(kwargs, field, needle):
    target, draft = _llama_pair()
    with pytest.raises(ShardplanError) as e:
        speculative_setup(target, method=kwargs["method"], num_speculative_tokens=kwargs["num_speculative_tokens"],
                          draft=draft if kwargs["use_draft"] else None, draft_source=None)
    assert e.value.field == field and needle in str(e.value)


def test_a_draft_of_another_vocabulary_is_refused_and_mtp_defaults_to_its_layers():
    target, _ = _llama_pair()
    other = load_model("qwen2.5-7b").spec
    with pytest.raises(ShardplanError, match="vocabulary of 152064 tokens"):
        speculative_setup(target, method=None, num_speculative_tokens=2, draft=other, draft_source=None)
    sp = speculative_setup(load_model("deepseek-v3").spec, method="mtp", num_speculative_tokens=None, draft=None,
                           draft_source=None)
    assert sp is not None and sp.num_speculative_tokens == 1
    assert speculative_setup(target, method=None, num_speculative_tokens=None, draft=None, draft_source=None) is None


# ----- CLI ---------------------------------------------------------------------------------


def test_estimate_json_carries_the_draft(cli):
    args = ["estimate", "llama-3.1-70b", "--gpus", "4", "--tp", "4", "--max-model-len", "8192", "--json"]
    base = json.loads(cli(*args).stdout)
    res = cli(*args, "--speculative-model", "llama-3.2-1b", "--num-speculative-tokens", "4")
    assert res.exit_code == 0, res.stderr
    rep = json.loads(res.stdout)
    rank = rep["memory"]["per_rank"][0]
    assert rank["detail_bytes"]["weights.draft"] == DRAFT_WEIGHTS_PER_RANK_BYTES
    assert rep["kv_cache"]["bytes_per_token_per_gpu"] == WITH_DRAFT_KV_PER_TOKEN_BYTES
    assert base["kv_cache"]["bytes_per_token_per_gpu"] == TARGET_KV_PER_TOKEN_BYTES
    assert rep["kv_cache"]["num_blocks"] < base["kv_cache"]["num_blocks"] * 10 / 11
    b = rank["per_gpu_bytes"]
    assert sum(b[p] for p in PARTS) == pytest.approx(b["total"], rel=1e-12)
    assert rep["workload"]["speculative"] == {"method": "draft_model", "num_speculative_tokens": 4,
                                              "draft_model": "llama-3.2-1b",
                                              "draft_source": rep["workload"]["speculative"]["draft_source"],
                                              "draft_hf_id": "meta-llama/Llama-3.2-1B"}
    assert any(a.startswith("speculative decoding: draft_model, K = 4") for a in rep["assumptions"])


def test_capacity_takes_the_speculative_options(cli):
    res = cli("capacity", "deepseek-v3", "-H", "h200-sxm-141gb", "--context", "4096", "--speculative-method", "mtp",
              "--json")
    assert res.exit_code in (0, 3), res.stderr
    assert json.loads(res.stdout)


@pytest.mark.parametrize("args,field", [
    (["--speculative-model", "llama-3.2-1b", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
    (["--speculative-method", "medusa-ish", "--num-speculative-tokens", "2"], "--speculative-method"),
    (["--speculative-model", "qwen2.5-7b", "--num-speculative-tokens", "2"], "--speculative-model"),
    (["--speculative-method", "mtp"], "--speculative-method"),
])
def test_bad_speculative_options_are_one_line_exit_2(cli, args, field):
    res = cli("estimate", "llama-3.1-70b", "--gpus", "4", "--tp", "4", *args)
    assert res.exit_code == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in res.stderr


def test_manifest_records_and_reads_back_the_speculative_setup(cli, tmp_path):
    from shardplan.plan.manifest import load_manifest
    from shardplan.plan.readback import plan_workload

    plan = tmp_path / "plan.yaml"
    res = cli("recommend", "llama-3.1-70b", "--gpus", "4", "--max-model-len", "8192", "--speculative-model",
              "llama-3.2-1b", "--num-speculative-tokens", "3", "-o", str(plan))
    assert res.exit_code == 0, res.stderr
    m = load_manifest(plan)
    assert m.workload.speculative is not None and m.workload.speculative.draft_source == "bundled:llama-3.2-1b"
    wl = plan_workload(m)
    assert wl.speculative is not None and wl.speculative.draft is not None
    assert wl.speculative.draft.name == "llama-3.2-1b" and wl.speculative.num_speculative_tokens == 3
    assert math.isfinite(m.predicted.memory.per_gpu_bytes["weights"])


def test_exports_carry_the_pinned_engines_speculative_flags(cli, tmp_path):
    from shardplan.exporters.base import argv

    plan = tmp_path / "ds.yaml"
    res = cli("recommend", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "8", "--quantization", "fp8",
              "--max-model-len", "8192", "--speculative-method", "mtp", "--num-speculative-tokens", "2", "-o", str(plan))
    assert res.exit_code == 0, res.stderr
    assert cli("export", str(plan), "--to", "vllm", "-o", str(tmp_path / "v")).exit_code == 0
    words = argv((tmp_path / "v" / "serve.sh").read_text().split("set -euo pipefail", 1)[1].strip())
    config = words[words.index("--speculative-config") + 1]
    assert json.loads(config) == {"method": "mtp", "num_speculative_tokens": 2}
    assert cli("export", str(plan), "--to", "sglang", "-o", str(tmp_path / "s")).exit_code == 0
    words = argv((tmp_path / "s" / "serve.sh").read_text().split("set -euo pipefail", 1)[1].strip())
    got = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--speculative")}
    assert got == {"--speculative-algorithm": "NEXTN", "--speculative-num-steps": "2",
                   "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "3"}


def test_vllm_export_runs_a_draft_model_from_0_22_and_refuses_it_before(cli, tmp_path):
    from shardplan.exporters.base import argv

    plan = tmp_path / "l.yaml"
    assert cli("recommend", "llama-3.1-70b", "--gpus", "4", "--max-model-len", "8192", "--speculative-model",
               "llama-3.2-1b", "--num-speculative-tokens", "4", "-o", str(plan)).exit_code == 0
    assert cli("export", str(plan), "--to", "vllm", "-o", str(tmp_path / "v")).exit_code == 0  # pinned 0.33.0
    words = argv((tmp_path / "v" / "serve.sh").read_text().split("set -euo pipefail", 1)[1].strip())
    assert json.loads(words[words.index("--speculative-config") + 1]) == {
        "method": "draft_model", "model": "meta-llama/Llama-3.2-1B", "num_speculative_tokens": 4}
    res = cli("export", str(plan), "--to", "vllm", "--engine-version", "0.11.0", "-o", str(tmp_path / "v11"))
    assert res.exit_code == 2 and "does not run a separate draft model" in res.stderr
    assert cli("export", str(plan), "--to", "sglang", "-o", str(tmp_path / "s")).exit_code == 0
    text = (tmp_path / "s" / "serve.sh").read_text()
    assert "--speculative-algorithm STANDALONE" in text and "--speculative-draft-model-path meta-llama/Llama-3.2-1B" in text
