"""estimate: breakdowns that sum (every bundled model x a grid of layouts), sharding
mechanisms, and the CLI's JSON and exit codes."""

from __future__ import annotations

import itertools

import pytest

from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout, Offload, Recompute
from shardplan.cost.params import count_params
from shardplan.cost.workload import InferenceWorkload, Quantization, TrainingWorkload
from shardplan.errors import LayoutError
from shardplan.specs.loading import bundled_names, load_hardware, load_model, model_specs_dir

PARTS = ("weights", "kv_cache", "activations", "gradients", "optimizer_states", "temporary", "overhead")


def _check_sums(rep):
    for rank in rep["memory"]["per_rank"]:
        b = rank["per_gpu_bytes"]
        assert sum(b[p] for p in PARTS) == pytest.approx(b["total"], rel=1e-12)
        assert all(b[p] >= 0 for p in PARTS)
    worst = rep["memory"]["per_gpu_bytes"]
    assert sum(worst[p] for p in PARTS) == pytest.approx(worst["total"], rel=1e-12)


@pytest.mark.parametrize("name", bundled_names(model_specs_dir()))
def test_breakdowns_sum_over_a_grid_of_layouts(name):
    spec = load_model(name).spec
    hw = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=2)
    evaluated = 0
    for tp, pp, ep in itertools.product((1, 2, 8), (1, 2, 4), (1, 8)):
        dp = 16 // (tp * pp)
        for training, zero in ((False, 0), (True, 1), (True, 3)):
            layout = Layout(
                tp=tp, pp=pp, dp=dp, ep=ep, zero_stage=zero, sequence_parallel=training and tp > 1,
                recompute=Recompute.SELECTIVE if training else Recompute.NONE,
            )
            wl = TrainingWorkload(seq_len=2048, global_batch_size=64) if training else InferenceWorkload(max_model_len=4096)
            try:
                rep = estimate(spec, hw, layout, wl).model_dump(mode="json")
            except LayoutError:
                continue
            _check_sums(rep)
            evaluated += 1
    assert evaluated >= 6


def test_weights_shard_exactly_over_tp_and_pp():
    spec = load_model("llama-3.1-70b").spec
    hw = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=1)
    rep = estimate(spec, hw, Layout(tp=4, pp=2), InferenceWorkload(max_model_len=8192)).model_dump(mode="json")
    w = sum(r["detail_bytes"][k] for r in rep["memory"]["per_rank"] for k in r["detail_bytes"] if k.startswith("weights.") and "rotary" not in k)
    # TP 4 divides every tensor except norms (replicated, 80 x 2 + 1 of 8192 each): KV heads 8 >= 4.
    norms = (80 * 2 + 1) * 8192
    assert w * 4 == pytest.approx((count_params(spec).total - norms) * 2 + 4 * norms * 2, rel=1e-12)


def test_kv_heads_replicated_when_tp_exceeds_them():
    spec = load_model("llama-3.1-70b").spec  # 8 KV heads
    hw = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=2)
    r8 = estimate(spec, hw.with_topology(gpus_per_node=8, num_nodes=1), Layout(tp=8), InferenceWorkload(max_model_len=8192)).model_dump(mode="json")
    r16 = estimate(spec, hw, Layout(tp=16), InferenceWorkload(max_model_len=8192)).model_dump(mode="json")
    # One KV head of 128 per rank either way: 2 x 128 x 2 bytes x 80 layers.
    assert r8["kv_cache"]["bytes_per_token_per_gpu"] == r16["kv_cache"]["bytes_per_token_per_gpu"] == 2 * 128 * 2 * 80


def test_mla_latent_is_replicated_on_every_tp_rank():
    spec = load_model("deepseek-v3").spec
    hw = load_hardware("h200-sxm-141gb").with_topology(gpus_per_node=8, num_nodes=2)
    rep = estimate(spec, hw, Layout(tp=8, pp=2, ep=8), InferenceWorkload(max_model_len=8192, quantization=Quantization.FP8)).model_dump(mode="json")
    per_rank = [r["layers"][1] - r["layers"][0] + 1 for r in rep["memory"]["per_rank"]]
    assert rep["kv_cache"]["bytes_per_token_per_gpu"] == (512 + 64) * 2 * max(per_rank)


def test_experts_divide_by_expert_parallelism():
    spec = load_model("mixtral-8x7b").spec
    hw = load_hardware("h100-sxm-80gb")
    one = estimate(spec, hw, Layout(tp=8), InferenceWorkload(max_model_len=4096)).model_dump(mode="json")
    ep8 = estimate(spec, hw, Layout(tp=8, ep=8), InferenceWorkload(max_model_len=4096)).model_dump(mode="json")
    e1 = one["memory"]["per_rank"][0]["detail_bytes"]["weights.experts"]
    e8 = ep8["memory"]["per_rank"][0]["detail_bytes"]["weights.experts"]
    assert e1 == pytest.approx(e8, rel=1e-12)  # tp 8 slices each expert; ep 8 gives each rank one whole expert
    assert e8 == pytest.approx(32 * 3 * 4096 * 14336 * 2, rel=1e-12)


def test_int4_weights_are_about_a_quarter_of_bf16():
    spec = load_model("llama-3.1-70b").spec
    hw = load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=1)
    bf16 = estimate(spec, hw, Layout(), InferenceWorkload(max_model_len=4096)).model_dump(mode="json")["memory"]["per_gpu_bytes"]["weights"]
    int4 = estimate(spec, hw, Layout(), InferenceWorkload(max_model_len=4096, quantization=Quantization.INT4)).model_dump(mode="json")
    w4 = int4["memory"]["per_gpu_bytes"]["weights"]
    # Linear layers at 4.156 bits (scales + zeros per 128), embeddings and lm_head stay 16-bit.
    emb = 2 * 128256 * 8192 * 2
    assert (w4 - emb) == pytest.approx((bf16 - emb) * (0.5 + 2.5 / 128) / 2, rel=0.002)
    assert int4["fits"]


def test_zero3_offload_moves_states_to_host():
    spec = load_model("llama-3.1-8b").spec
    hw = load_hardware("a100-sxm-80gb")
    base = Layout(dp=8, zero_stage=3)
    wl = TrainingWorkload(seq_len=4096, global_batch_size=64)
    on_gpu = estimate(spec, hw, base, wl).model_dump(mode="json")
    off = estimate(spec, hw, Layout(dp=8, zero_stage=3, offload_optimizer=Offload.CPU, offload_params=Offload.CPU), wl).model_dump(mode="json")
    b = off["memory"]["per_gpu_bytes"]
    assert b["optimizer_states"] == b["gradients"] == b["weights"] == 0
    moved = sum(on_gpu["memory"]["per_gpu_bytes"][k] for k in ("weights", "gradients", "optimizer_states"))
    assert off["memory"]["host_offload_bytes_per_node"] == pytest.approx(8 * moved, rel=1e-9)


def test_cli_estimate_json_and_exit_codes(cli):
    res = cli("estimate", "llama-3.1-70b", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--tp", "8", "--json")
    assert res.exit_code == 0, res.stderr
    out = res.json()
    assert out["fits"] is True
    for key in ("model", "hardware", "plan", "memory", "kv_cache"):
        assert key in out
    assert set(PARTS + ("total",)) <= set(out["memory"]["per_gpu_bytes"])
    assert out["hardware"]["num_gpus"] == 8 and out["plan"]["tp"] == 8 and out["plan"]["dp"] == 1
    assert out["kv_cache"]["capacity_tokens"] > 131072
    # bf16 70B on one H100 cannot fit: exit 3 with the JSON still printed.
    res = cli("estimate", "llama-3.1-70b", "--gpus", "1", "--json")
    assert res.exit_code == 3 and res.json()["fits"] is False
    assert "no room for a KV cache" in res.json()["reason"]


def test_cli_predicts_vllm_max_model_len_error(cli):
    res = cli("estimate", "llama-3.1-8b", "--gpus", "1", "--hardware", "l4-24gb", "--json")
    out = res.json()
    assert res.exit_code == 3
    assert "estimated maximum model length is" in out["reason"]
    assert out["kv_cache"]["capacity_tokens"] < 131072


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--tp", "3"), "does not divide"),
        (("--tp", "6", "--gpus", "6"), "attention heads"),
        (("--tp", "2", "--dp", "2"), "does not equal the GPU count"),
        (("--ep", "3", "--gpus", "3"), "needs a mixture-of-experts"),
    ],
)
def test_cli_impossible_layouts_exit_2(cli, args, needle):
    res = cli("estimate", "llama-3.2-1b", *args)
    assert res.exit_code == 2 and needle in res.stderr and "Traceback" not in res.stderr


def test_cli_ep_must_divide_experts(cli):
    res = cli("estimate", "mixtral-8x7b", "--gpus", "8", "--tp", "2", "--ep", "3")
    assert res.exit_code == 2 and "ep=3 does not divide the 8 experts" in res.stderr


def test_training_json_has_states_by_zero_stage(cli):
    outs = {}
    for z in (0, 1, 2, 3):
        res = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--zero-stage", str(z),
                  "--seq-len", "2048", "--global-batch-size", "64", "--json")
        outs[z] = res.json()["memory"]["per_gpu_bytes"]
    P = 8030261248
    assert outs[0]["optimizer_states"] == pytest.approx(12 * P, rel=1e-9)
    assert outs[1]["optimizer_states"] == pytest.approx(12 * P / 8, rel=1e-9)
    assert outs[2]["gradients"] == pytest.approx(2 * P / 8, rel=1e-9)
    assert outs[3]["weights"] == pytest.approx(2 * P / 8, rel=1e-9)
    assert outs[3]["temporary"] > 0


@pytest.mark.parametrize(
    "args,field",
    [
        (("--kv-cache-dtype", "xyz"), "--kv-cache-dtype"),
        (("--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization"),
        (("--gpus", "12"), "--gpus"),
        (("--weight-dtype", "int4", "--quantization", "fp8"), "--weight-dtype"),
    ],
)
def test_cli_bad_option_values_are_one_line_exit_2(cli, args, field):
    res = cli("estimate", "llama-3.1-8b", *args)
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and f"field '{field}'" in lines[0]


def test_fp8_kv_cache_doubles_capacity(cli):
    base = cli("estimate", "llama-3.1-8b", "--gpus", "1", "--max-model-len", "8192", "--json").json()
    fp8 = cli("estimate", "llama-3.1-8b", "--gpus", "1", "--max-model-len", "8192", "--kv-cache-dtype", "fp8", "--json").json()
    assert fp8["kv_cache"]["bytes_per_token_per_gpu"] * 2 == base["kv_cache"]["bytes_per_token_per_gpu"]
    assert fp8["kv_cache"]["num_blocks"] == pytest.approx(2 * base["kv_cache"]["num_blocks"], abs=1)


def test_cli_global_batch_must_divide(cli):
    res = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--global-batch-size", "12", "--micro-batch-size", "1")
    assert res.exit_code == 2 and "not a multiple of dp x micro-batch = 8" in res.stderr
    res = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--pp", "4", "--virtual-stages", "2",
              "--global-batch-size", "6")
    assert res.exit_code == 2 and "multiple of pp=4" in res.stderr


def test_usage_error_hint_names_the_subcommand_however_shardplan_was_started():
    """Started as `python -m shardplan`, click's command path is "python -m shardplan estimate";
    the hint still reads `shardplan estimate --help`, a command the user can type."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "shardplan", "estimate", "llama-3.1-8b", "--concurrency", "0"],
                         capture_output=True, text=True, timeout=120)
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert res.returncode == 2 and len(lines) == 1
    assert lines[0].endswith("(fix: see 'shardplan estimate --help')"), lines[0]
