"""`shardplan verify` with expert parallelism (ep > 1) on Mixtral's proxy (8 experts, top-2):
training with Megatron-core's all-to-all dispatcher (tp = 1), serving with vLLM's expert
parallelism inside one server (ep = tp); and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardplan.plan import manifest as mf
from shardplan.cost.workload import TrainingWorkload
from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK
from shardplan.plan.readback import plan_spec
from shardplan.verify.runspec import plan_run
from test_verify import SERVE, TRAIN, _assert_matches, _plan, _verify

# SGD, not the plan's AdamW: Adam divides out a gradient's scale, so a wrong 1/dp on the
# expert gradients would pass the loss check (measured: a factor of 2 moves the loss by 2e-5
# under AdamW, by 1.1e-3 under SGD).
SGD_TRAIN = TrainingWorkload(seq_len=256, global_batch_size=64, optimizer="sgd")
ELEMENT_BYTES = 2  # the plans are bf16, and so are the runs' weights and RoPE cache


def _weight_bytes(plan: Path) -> tuple[float, float]:
    """(dense bytes, bytes of one expert of every MoE layer) of one rank of the plan's proxy:
    dense tensors divided by their tp split, experts whole."""
    import torch  # here, not at collection: only the real runs need it

    from shardplan.verify.model import Decoder
    from shardplan.verify.parallel import split_key

    m = mf.load_manifest(plan)
    run = plan_run(m, plan_spec(m), scale="proxy")
    with torch.device("meta"):
        model = Decoder(run.spec)
    dense = expert = 0.0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert += p.numel() / run.spec.moe.num_experts
        else:
            split = m.placement.tp_splits[split_key(name.removesuffix(".weight"))]
            dense += p.numel() / (1 if split == "replicated" else run.layout.tp)
    return dense * ELEMENT_BYTES, expert * ELEMENT_BYTES


@pytest.mark.dist
@pytest.mark.parametrize("gpus,layout", [
    (2, dict(dp=2, ep=2, zero_stage=0)),  # experts whole and unsharded: weights show E/ep experts
    (4, dict(dp=4, ep=2, zero_stage=3)),  # experts an FSDP2 unit over the edp=2 ranks, dense over dp=4
], ids=["zero0-world2", "zero3-world4"])
def test_expert_parallel_training(cli, tmp_path, gpus, layout):
    plan = _plan(tmp_path, gpus, SGD_TRAIN, model="mixtral-8x7b", **layout)
    res, report = _verify(cli, plan, tmp_path)
    assert res.exit_code == EXIT_OK, res.stderr
    _assert_matches(report, gpus, training=True)
    assert report["run"]["work"]["moe_routing"] == "round-robin"
    for rank in report["ranks"]:
        comps = {c["component"]: c for c in rank["components"]}
        assert abs(comps["activations"]["relative_error"]) <= 0.03, comps["activations"]
        for name in ("weights", "gradients", "optimizer_states"):
            assert abs(comps[name]["relative_error"]) <= 1e-3, comps[name]
        if layout["zero_stage"] == 0:
            dense, one_expert = _weight_bytes(plan)
            held = (comps["weights"]["measured_bytes"] - dense) / one_expert
            assert held == pytest.approx(8 / 2)  # E / ep whole experts on this rank


@pytest.mark.dist
def test_expert_parallel_serving(cli, tmp_path):
    plan = _plan(tmp_path, 2, SERVE, model="mixtral-8x7b", tp=2, ep=2)
    res, report = _verify(cli, plan, tmp_path)
    assert res.exit_code == EXIT_OK, res.stderr
    _assert_matches(report, 2, training=False)
    m = mf.load_manifest(plan)
    run = plan_run(m, plan_spec(m), scale="proxy")
    rope_bytes = run.spec.max_position_embeddings * run.spec.attention_head_dim * ELEMENT_BYTES
    dense, one_expert = _weight_bytes(plan)
    for rank in report["ranks"]:
        comps = {c["component"]: c for c in rank["components"]}
        assert abs(comps["activations"]["relative_error"]) <= 0.03, comps["activations"]
        held = (comps["weights"]["measured_bytes"] - rope_bytes - dense) / one_expert
        assert held == pytest.approx(8 / 2)  # whole experts, not tp-split ones


@pytest.mark.parametrize("gpus,workload,layout,words", [
    (2, TRAIN, dict(tp=2, ep=2), "sequence parallelism"),
    (4, SERVE, dict(tp=2, dp=2, ep=4), "ep = tp"),
], ids=["training-ep-with-tp", "serving-ep-across-replicas"])
def test_expert_parallel_layouts_verify_does_not_run_are_refused(cli, tmp_path, gpus, workload, layout, words):
    res = cli("verify", str(_plan(tmp_path, gpus, workload, model="mixtral-8x7b", **layout)))
    assert res.exit_code == EXIT_BAD_INPUT
    assert "layout.ep" in res.stderr and words in res.stderr and "plan.yaml" in res.stderr
