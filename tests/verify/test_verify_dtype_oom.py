"""`shardplan verify` in the plan's format (bf16 on a CPU with gloo, or --dtype fp32) against the
cost model applied to the format that ran; a rank that runs out of (simulated) device memory
ends in a report that names the allocation, its component's prediction and what would fit;
the memory tracker's limit, resize accounting and component labels on their own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_verify import TRAIN, _plan, _verify

from shardplan.cost.estimate import estimate
from shardplan.cost.params import count_params
from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_VERIFY_FAILED
from shardplan.plan import manifest as mf
from shardplan.plan.readback import plan_spec
from shardplan.units import BYTES_PER_GIB, BYTES_PER_MIB
from shardplan.verify.outofmemory import at_capacity, hardware_for, runtime_bytes
from shardplan.verify.runspec import plan_run

BYTES = {"fp32": 4, "bf16": 2}
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "int64": 8, "uint8": 1}


def _run_of(plan: Path, **kw):
    m = mf.load_manifest(plan)
    run = plan_run(m, plan_spec(m), scale="proxy", **kw)
    return m, run


# ----- the plan's format ------------------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["plan", "fp32"])
def test_a_bf16_plan_runs_bf16_and_its_memory_matches_the_cost_model_applied_to_bf16(cli, tmp_path, dtype):
    """FSDP2 ZeRO-3 over dp=2: bf16 weights and gradients, fp32 masters and Adam moments in the
    optimizer (2 + 2 + 12 bytes a parameter, halved); under --dtype fp32 the weights are their
    own master (4 + 4 + 8)."""
    plan = _plan(tmp_path, 2, TRAIN, dp=2, zero_stage=3)
    res, report = _verify(cli, plan, tmp_path, "--dtype", dtype, "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    assert res.json()["status"] == "ok" == report["status"], report["mismatches"]
    ran = "bf16" if dtype == "plan" else "fp32"
    assert report["run"]["dtype"] == ran and report["run"]["plan_dtype"] == "bf16"
    assert report["numerics"]["dtype"] == ran
    # a bf16 run on a CPU without bf16 GEMM instructions says its matmuls ran as fp32 GEMMs of bf16 values
    from shardplan.verify import cpu_matmul

    assert (cpu_matmul.NOTE in report["run"]["notes"]) == (ran == "bf16" and cpu_matmul.needed())
    _, run = _run_of(plan, dtype=dtype)
    params = count_params(run.spec).total
    per_param = {"weights": BYTES[ran], "gradients": BYTES[ran], "optimizer_states": 12 if ran == "bf16" else 8}
    for rank in report["ranks"]:
        comps = {c["component"]: c for c in rank["components"]}
        for name, nbytes in per_param.items():
            assert comps[name]["predicted_bytes"] == pytest.approx(nbytes * params / 2, rel=0.01), name
            assert comps[name]["measured_bytes"] == pytest.approx(nbytes * params / 2, rel=0.02), name
        assert abs(comps["activations"]["relative_error"]) <= 0.15, comps["activations"]
        peak = rank["memory_peak"]
        # the weights and the optimizer states are alive through every step's forward
        assert peak["allocated_peak_bytes"] > comps["weights"]["measured_bytes"] + comps["optimizer_states"]["measured_bytes"]
        assert peak["reserved_peak_bytes"] is None and peak["reserved_relative_error"] is None  # no allocator on a CPU
        assert peak["predicted_reserved_bytes"] > peak["predicted_allocated_bytes"]  # + the fp32 logits' block
        assert peak["allocated_relative_error"] == pytest.approx(
            peak["allocated_peak_bytes"] / peak["predicted_allocated_bytes"] - 1)
    num = report["numerics"]
    assert num["ok"] and num["checked"] and all(math.isfinite(v) for v in num["measured"])
    assert num["max_relative_error"] <= (5e-4 if ran == "bf16" else 1e-4)
    assert num["measured"][-1] < num["measured"][0]
    notes = " ".join(report["run"]["notes"])
    assert ("--dtype fp32: the plan is bf16" in notes) == (dtype == "fp32")


@pytest.mark.dist
def test_bf16_master_weights_and_moments_are_what_the_optimizer_keeps(cli, tmp_path):
    """--master-dtype bf16 --moment-dtype bf16 in verify's own (torch) optimizer: pure bf16, the
    bf16 weights are their own master and Adam's moments are bf16, 4 bytes a parameter of
    optimizer states where an fp32 master and moments take 12; measured against the cost model
    over dp=2 ZeRO-3."""
    from dataclasses import replace

    from shardplan.units import DType

    wl = replace(TRAIN, master_dtype=DType.BF16, moment_dtype=DType.BF16)
    plan = _plan(tmp_path, 2, wl, dp=2, zero_stage=3)
    res, report = _verify(cli, plan, tmp_path, "--json")
    assert res.exit_code == EXIT_OK, (res.stderr, report and report["mismatches"])
    assert report["run"]["dtype"] == "bf16" and report["run"]["work"]["optimizer_dtype"] == "bf16"
    _, run = _run_of(plan)
    params = count_params(run.spec).total
    for rank in report["ranks"]:
        comps = {c["component"]: c for c in rank["components"]}
        for name, nbytes in {"weights": 2, "gradients": 2, "optimizer_states": 4}.items():
            assert comps[name]["predicted_bytes"] == pytest.approx(nbytes * params / 2, rel=0.01), name
            assert comps[name]["measured_bytes"] == pytest.approx(nbytes * params / 2, rel=0.02), name
    num = report["numerics"]
    assert num["ok"] and num["checked"] and num["measured"][-1] < num["measured"][0]


def test_the_run_takes_the_plan_format_and_says_what_it_does_not_run(tmp_path):
    """bf16 plans run bf16; fp16 and fp8 plans run bf16 with a note; --dtype fp32 runs fp32 and
    its prediction is the fp32 one (twice the weight bytes)."""
    from shardplan.cost.workload import (
        InferenceWorkload,
        Quantization,
        TrainingWorkload,
    )
    from shardplan.units import DType

    bf16 = _plan(tmp_path, 2, TRAIN, tp=2)
    _, run = _run_of(bf16)
    assert run.dtype is DType.BF16 and run.spec.dtype == "bfloat16" and not run.notes
    assert run.training_workload().param_dtype is DType.BF16
    _, fp32 = _run_of(bf16, dtype="fp32")
    assert fp32.dtype is DType.FP32 and fp32.spec.dtype == "float32"
    m = mf.load_manifest(bf16)
    hw, _ = hardware_for(m, run)
    w16 = estimate(run.spec, hw, run.layout, run.training_workload()).memory.per_gpu_bytes["weights"]
    w32 = estimate(fp32.spec, hw, fp32.layout, fp32.training_workload()).memory.per_gpu_bytes["weights"]
    assert w32 == 2 * w16
    fp16 = _plan(tmp_path, 2, TrainingWorkload(seq_len=256, global_batch_size=64, param_dtype=DType.FP16,
                                               activation_dtype=DType.FP16), name="fp16.yaml", tp=2)
    _, run16 = _run_of(fp16)
    assert run16.dtype is DType.BF16 and run16.plan_dtype is DType.FP16 and "verify runs it in bf16" in run16.notes[0]
    fp8 = _plan(tmp_path, 2, InferenceWorkload(max_model_len=512, input_len=64, output_len=8,
                                               quantization=Quantization.FP8, kv_cache_dtype=DType.FP8),
                name="fp8.yaml", tp=2)
    _, run8 = _run_of(fp8)
    assert run8.dtype is DType.BF16 and run8.inference_workload().kv_cache_dtype is DType.BF16
    assert any("fp8 weight quantization is not run" in n for n in run8.notes)
    assert any("fp8 KV cache runs bf16" in n for n in run8.notes)


# ----- out of memory ------------------------------------------------------------------------------

@pytest.mark.dist
def test_a_plan_too_large_for_the_device_ends_in_a_report_naming_the_allocation(cli, tmp_path):
    """A tp=2 plan on a simulated device that holds the weights, gradients and half the
    optimizer states: the first step's optimizer runs out of memory. The report names the op,
    the tensor and its bytes, says it was the optimizer states and what the cost model
    predicted for them, keeps the weights measured before, and names the first change the cost
    model says fits; exit 5; calibrate refuses it (a CPU measured nothing a GPU needs)."""
    plan = _plan(tmp_path, 2, TRAIN, tp=2)
    m, run = _run_of(plan)
    hw, _ = hardware_for(m, run)
    pred = estimate(run.spec, hw, run.layout, run.training_workload()).memory.per_gpu_bytes
    usable = pred["weights"] + pred["gradients"] + pred["optimizer_states"] / 2
    device_gib = (runtime_bytes(hw, run.world_size) + usable) / BYTES_PER_GIB
    res, report = _verify(cli, plan, tmp_path, "--device-memory-gib", f"{device_gib:.9f}", "--json")
    assert res.exit_code == EXIT_VERIFY_FAILED, res.stderr
    assert res.json() == report  # --json prints the report --report wrote
    assert report["status"] == "oom" and report["run"]["dtype"] == "bf16"
    oom = report["oom"]
    assert oom["simulated"] and oom["step"] == 0 and oom["steps_completed"] == 0
    assert oom["component"] == "optimizer_states"
    assert oom["predicted_component_bytes"] == pytest.approx(pred["optimizer_states"])
    assert oom["op"].startswith("aten.") and oom["shape"] and oom["dtype"] == "float32"  # masters and moments
    assert oom["allocation_bytes"] == math.prod(oom["shape"]) * ELEMENT_BYTES[oom["dtype"]]
    limit = oom["limit_bytes"]
    assert limit == oom["capacity_bytes"] - runtime_bytes(hw, 2) and abs(limit - usable) <= 1
    assert oom["live_bytes"] <= limit < oom["live_bytes"] + oom["allocation_bytes"]
    assert not oom["predicted_fits"]
    assert oom["measured_components"] == ["weights"]
    assert oom["unmeasured_components"] == ["gradients", "optimizer_states", "activations"]
    assert sorted(oom["out_of_memory_ranks"]) == oom["out_of_memory_ranks"] and oom["rank"] in oom["out_of_memory_ranks"]
    for rank in report["ranks"]:  # the weights were measured before the failure, and match
        (weights,) = rank["components"]
        assert weights["component"] == "weights" and abs(weights["relative_error"]) <= 0.02
    # The suggestion is the first change tried that fits; the cost model, asked again, agrees.
    tried = oom["tried"]
    assert oom["suggestion"] == next(c for c in tried if c["fits"])
    assert oom["suggestion"]["change"] == "tp 2 -> 4 (4 GPUs)"
    assert not any(c["fits"] for c in tried[:tried.index(oom["suggestion"])])
    assert "recompute none -> full" in [c["change"] for c in tried]
    from dataclasses import replace

    from shardplan.specs.cluster import cluster

    wide = replace(run, layout=replace(run.layout, tp=4))
    cap = at_capacity(cluster(hw, gpus=4, nodes=None, gpus_per_node=None), oom["capacity_bytes"])
    assert estimate(wide.spec, cap, wide.layout, wide.training_workload()).fits
    assert not estimate(run.spec, at_capacity(hw, oom["capacity_bytes"]), run.layout, run.training_workload()).fits
    assert report["mismatches"][0].startswith(f"rank {oom['rank']} ran out of memory in step 0 (optimizer_states")
    assert report["numerics"]["checked"] is False and report["numerics"]["ok"] is False
    # calibrate reads GPU reports: this one is refused for its device, with the field
    out = tmp_path / "x.yaml"
    cal = cli("calibrate", str(tmp_path / "report.json"), "-o", str(out))
    assert cal.exit_code == EXIT_BAD_INPUT and "'device'" in cal.stderr and not out.exists()


def test_a_device_memory_below_the_runtime_is_refused_before_anything_starts(cli, tmp_path):
    res = cli("verify", str(_plan(tmp_path, 2, TRAIN, tp=2)), "--device-memory-gib", "0.5")
    assert res.exit_code == EXIT_BAD_INPUT
    line = res.stderr.strip()
    assert "\n" not in line and "--device-memory-gib" in line and "0.82 GiB" in line and "Traceback" not in line


# ----- the tracker on its own -------------------------------------------------------------------

def test_the_tracker_raises_where_live_tensors_would_exceed_the_limit():
    import torch

    from shardplan.verify import measure

    tracker = measure.StorageTracker(limit_bytes=3.5 * BYTES_PER_MIB)
    with tracker:
        keep = torch.empty(2 * BYTES_PER_MIB, dtype=torch.uint8)  # 2 MiB live
        tracker.arm()
        tracker.phase = measure.FORWARD
        x = torch.ones(256, 256)  # 256 KiB: fits
        with pytest.raises(measure.SimulatedOutOfMemory):
            torch.mm(x, torch.ones(256, 1024))  # 1 MiB more: over
    f = tracker.failure
    assert f["op"] == "aten.mm.default" and f["shape"] == [256, 256 * 4] and f["dtype"] == "float32"
    assert f["allocation_bytes"] == BYTES_PER_MIB and f["component"] == "activations" and f["simulated"]
    assert f["live_bytes"] == 2 * BYTES_PER_MIB + 256 * 256 * 4 + 256 * 1024 * 4  # keep, x and the ones
    assert f["live_bytes"] + f["allocation_bytes"] > f["limit_bytes"] == 3.5 * BYTES_PER_MIB
    del keep


def test_the_tracker_follows_resized_storages_and_labels_gradients():
    """FSDP2 frees and re-allocates gathered parameters by resizing their storages; backward's
    tensors of a parameter's shape are gradients, the rest temporaries."""
    import torch

    from shardplan.verify import measure

    tracker = measure.StorageTracker(limit_bytes=BYTES_PER_MIB)
    with tracker:
        t = torch.empty(BYTES_PER_MIB // 2, dtype=torch.uint8)
        tracker.arm()
        assert tracker.live_total == BYTES_PER_MIB // 2
        t.untyped_storage().resize_(0)
        assert tracker.live_total == 0 and tracker.peak_total == BYTES_PER_MIB // 2
        t.untyped_storage().resize_(BYTES_PER_MIB // 2)
        assert tracker.live_total == BYTES_PER_MIB // 2
        with pytest.raises(measure.SimulatedOutOfMemory):
            t.untyped_storage().resize_(2 * BYTES_PER_MIB)
    assert tracker.failure["op"].startswith("storage.resize_") and tracker.failure["component"] == "temporary"
    assert torch.UntypedStorage.resize_ is measure._ORIGINAL_RESIZE  # put back when the tracker exits

    lin = torch.nn.Linear(64, 32, bias=False)
    seen: list[str] = []
    tracker = measure.StorageTracker()
    tracker.param_shapes = {tuple(lin.weight.shape)}
    original = tracker._add

    def spy(st, func=None, t=None):
        if t is not None and torch._C._current_graph_task_id() != -1:
            seen.append(tracker.component_of(t))
        original(st, func, t)

    tracker._add = spy
    with tracker:
        tracker.phase = measure.FORWARD
        y = lin(torch.randn(8, 64)).relu()
        tracker.phase = measure.OTHER
        y.sum().backward()
    assert "gradients" in seen and "temporary" in seen
    assert lin.weight.grad is not None


# ----- numerics in bf16 ---------------------------------------------------------------------------

def _serving_run(tmp_path):
    from shardplan.cost.workload import InferenceWorkload

    _, run = _run_of(_plan(tmp_path, 2, InferenceWorkload(max_model_len=512, input_len=64, output_len=8), tp=2))
    return run


def test_bf16_serving_numerics_allow_a_greedy_flip_at_a_near_tie_only(tmp_path):
    """bf16 logits (up to 2.0: tolerance 4 roundoffs of 2.0 = 0.031). Step 1 of the row flips
    between two tokens whose logits are 0.01 apart in both runs: a tie rounding decides, and the
    row is compared up to there. A flip between logits 0.5 apart fails, and so does a NaN."""
    from shardplan.verify.compare import numerics

    run = _serving_run(tmp_path)
    ref = [[[2.0, 1.0, 0.0, 0.0]], [[0.0, 1.50, 1.49, 0.0]], [[0.0, 0.0, 0.0, 1.0]]]
    ref_tokens = [[0], [1], [3]]

    def served(logits, tokens):
        return [{"logits": logits, "tokens": tokens, "replica": 0}]

    tie = [[[2.0, 1.0, 0.0, 0.0]], [[0.0, 1.49, 1.495, 0.0]], [[9.0, 0.0, 0.0, 0.0]]]  # then another path
    out = numerics(run, served(tie, [[0], [2], [0]]), {0: (ref, ref_tokens)})
    assert out["ok"] and out["tokens_equal"] and out["tolerance"] == pytest.approx(4 * 2**-8 * 2.0)
    assert out["near_ties"] == [{"replica": 0, "row": 0, "step": 1, "tokens": [2, 1], "reference_margin": pytest.approx(0.01)}]
    assert out["max_abs_error"] == pytest.approx(0.01)  # step 2, after the flip, is not compared

    far = [[[2.0, 1.0, 0.0, 0.0]], [[0.0, 1.0, 1.5, 0.0]], [[0.0, 0.0, 0.0, 1.0]]]
    out = numerics(run, served(far, [[0], [2], [3]]), {0: (ref, ref_tokens)})
    assert not out["ok"] and not out["tokens_equal"]

    nan = [[[2.0, float("nan"), 0.0, 0.0]], *ref[1:]]
    assert not numerics(run, served(nan, ref_tokens), {0: (ref, ref_tokens)})["ok"]


def test_bf16_training_numerics_fail_on_nan_and_beyond_a_quarter_roundoff(tmp_path):
    from shardplan.verify.compare import numerics

    _, run = _run_of(_plan(tmp_path, 2, TRAIN, tp=2))
    ref = [6.93, 6.90]

    def loss(values):
        return numerics(run, [{"losses": values}], ref)

    assert loss([6.93 * (1 + 5e-4), 6.90])["ok"]  # within 2^-10 = 9.8e-4
    assert not loss([6.93 * (1 + 2e-3), 6.90])["ok"]
    assert not loss([6.93, float("nan")])["ok"]
    assert not loss([6.93])["ok"]  # a step missing
