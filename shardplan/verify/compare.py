"""Predicted against measured: the cost model applied to exactly what ran (the proxy or full
model, the run's layout, batch and fp32 formats), compared per rank and memory component,
plus the numerics check against the unsharded reference. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from shardplan.cost.estimate import estimate
from shardplan.cost.report import CostReport, ServingTimeReport, TrainingTimeReport
from shardplan.cost.layout import layout_stage_ranges
from shardplan.cost.memory_serving import kv_bytes_per_token_per_layer_per_rank
from shardplan.cost.memory_training import FREED_BEFORE_GRADIENTS, RECOMPUTED_LAYER
from shardplan.specs.hardware import HardwareProfile
from shardplan.units import BYTES_PER_GIB, DType, bytes_per_element
from shardplan.verify.runspec import RunSpec

# Relative tolerances per memory component. Model states are exact tensor sizes; activations
# depend on which kernels keep what, so they get a wider band. `None`: reported, not checked.
TOLERANCES: dict[str, float | None] = {
    "weights": 0.02,
    "gradients": 0.02,
    "optimizer_states": 0.02,
    "kv_cache": 0.02,
    "offloaded_states": 0.02,
    "activations": 0.15,
    "temporary": None,
}
# Numerics: the loss of every step within LOSS_RTOL of the reference's (Adam amplifies
# reduction-order noise a little each step); serving: every generated token equal and every
# logit within LOGIT_ATOL. In fp32 the sharded and the unsharded run differ only in the order
# of their sums. In bf16 (8 significant bits, unit roundoff 2^-8 = 3.9e-3) every matmul,
# norm and residual output is rounded, and a sharded matmul rounds its partial sums before
# they are reduced, where the reference rounds once: the logits differ by a few roundoffs of
# their own size, and the loss (computed on fp32 upcasts of them) by much less, as the errors
# of its 64 x vocabulary terms average out.
# Measured on the layouts of tests/verify (tp, FSDP, pipelines, sequence, context and expert
# parallelism, offload; 2-3 AdamW steps): the bf16 loss within 1.3e-4 of the reference's, the
# logits within 2 roundoffs of the largest (0.016 on logits up to 1.9).
LOSS_RTOL = 1e-4
LOGIT_ATOL = 1e-4
BF16_UNIT_ROUNDOFF = 2.0**-8
LOSS_RTOL_BF16 = BF16_UNIT_ROUNDOFF / 4  # 9.8e-4
LOGIT_ROUNDOFFS_BF16 = 4  # bf16 logits: within 4 roundoffs of the largest reference logit (at least 1)


def _relative_error(measured: float, predicted: float) -> float:
    if predicted == 0:
        return 0.0 if measured == 0 else math.inf
    return (measured - predicted) / predicted


def _component(name: str, measured: float, predicted: float, note: str | None = None) -> dict[str, Any]:
    tol = TOLERANCES[name]
    err = _relative_error(measured, predicted)
    out = {"component": name, "measured_bytes": int(measured), "predicted_bytes": float(predicted),
           "relative_error": err if math.isfinite(err) else None, "tolerance": tol,
           "ok": tol is None or (math.isfinite(err) and abs(err) <= tol)}
    if note:
        out["note"] = note
    return out


def _training_components(run: RunSpec, predicted: dict[str, float], m: dict[str, int],
                         host_predicted: float = 0.0) -> list[dict[str, Any]]:
    """Each component whose measurement `m` holds (a run that ran out of memory has measured
    only some), in the order weights, gradients, optimizer states, activations, ..."""
    zero = run.layout.zero_stage if run.layout.dp * run.layout.cp > 1 else 0
    fp32 = run.dtype is DType.FP32
    out = []
    if zero == 2:
        if "gathered_params_peak_bytes" in m:
            out.append(_component("weights", m["gathered_params_peak_bytes"], predicted["weights"],
                                  "gathered (unsharded) parameters between forward and backward"))
        if "optimizer_states_bytes" in m and fp32:
            out.append(_component("optimizer_states", m["optimizer_states_bytes"] + m["weights_at_rest_bytes"],
                                  predicted["optimizer_states"], "moments plus the sharded fp32 parameter (the master)"))
        elif "optimizer_states_bytes" in m:
            out.append(_component("optimizer_states", m["optimizer_states_bytes"], predicted["optimizer_states"],
                                  "fp32 masters and moments; FSDP2's sharded 16-bit parameter kept beside the gathered "
                                  "one is not counted"))
    else:
        if "weights_at_rest_bytes" in m:
            out.append(_component("weights", m["weights_at_rest_bytes"], predicted["weights"]))
        if "optimizer_states_bytes" in m:
            out.append(_component("optimizer_states", m["optimizer_states_bytes"], predicted["optimizer_states"],
                                  None if fp32 else "fp32 masters and moments"))
    if "gradients_bytes" in m:
        out.insert(min(1, len(out)), _component("gradients", m["gradients_bytes"], predicted["gradients"]))
    if "activations_bytes" in m:
        later = predicted.get(RECOMPUTED_LAYER, 0.0)
        out.append(_component("activations", m["activations_bytes"], predicted["activations"],
                              f"at the end of the forward: the prediction without the layer full recomputation re-runs "
                              f"in backward ({later / BYTES_PER_GIB:.3f} GiB)" if later else None))
    if m.get("offloaded_states_bytes") or (host_predicted and "offloaded_states_bytes" in m):
        out.append(_component("offloaded_states", m.get("offloaded_states_bytes", 0), host_predicted,
                              "host memory: sharded parameters, gradients and optimizer states (CPU offload)"))
    if zero == 3 and "gathered_params_peak_bytes" in m:
        out.append(_component("temporary", m["gathered_params_peak_bytes"], predicted["temporary"],
                              "peak of gathered parameters at block boundaries"))
    return out


def serving_kv_bytes(run: RunSpec, stage: int) -> float:
    """The KV cache of the run's own tokens (batch x (prompt + decode)) on a rank of `stage`,
    not vLLM's pool, which fills whatever memory is left."""
    L = run.layout
    layers = sum(len(r) for r in layout_stage_ranges(run.spec.num_layers, L)[stage])
    tokens = run.batch_size * (run.prompt_len + run.decode_steps)
    return kv_bytes_per_token_per_layer_per_rank(run.spec, L.tp, bytes_per_element(run.dtype)) * layers * tokens


def _serving_components(run: RunSpec, stage: int, predicted: dict[str, float], m: dict[str, int]) -> list[dict[str, Any]]:
    tokens = run.batch_size * (run.prompt_len + run.decode_steps)
    kv = serving_kv_bytes(run, stage)
    out = []
    if "weights_bytes" in m:
        out.append(_component("weights", m["weights_bytes"], predicted["weights"]))
    if "kv_cache_bytes" in m:
        out.append(_component("kv_cache", m["kv_cache_bytes"], kv, f"{tokens} tokens (batch x (prompt + decode))"))
    if "activations_bytes" in m:
        out.append(_component("activations", m["activations_bytes"], predicted["activations"], "peak of the prefill forward"))
    return out


def memory_peak(run: RunSpec, rank: Any, m: dict[str, Any], device: str) -> dict[str, Any] | None:
    """The rank's peak memory against the prediction: allocated against the predicted total
    less the runtime's share (CUDA context, non-torch libraries, NCCL buffers, which torch
    does not allocate), reserved against the caching allocator's predicted reserve (the total
    plus a fresh block for the largest tensor, less the same). Serving: the run's own weights,
    KV cache and activations (not vLLM's pool). A CPU run holds offloaded states among its
    live tensors: their prediction is added. Reported, not checked: the cost model adds every
    component's own peak, which a step never holds all at once (gradients grow as backward
    frees the activations), and backward's temporaries are in no component. None when the rank
    measured no peak (`rank`: the cost model's RankMemoryReport)."""
    allocated = m.get("allocated_peak_bytes")
    if allocated is None:
        return None
    per = rank.per_gpu_bytes
    overhead = per.get("overhead", 0.0)
    if run.training:
        predicted_allocated = per["total"] - overhead
        predicted_reserved = rank.reserved_bytes - overhead
    else:
        predicted_allocated = predicted_reserved = per["weights"] + serving_kv_bytes(run, rank.stage) + per["activations"]
    if device == "cpu":
        predicted_allocated += rank.host_offload_bytes
        predicted_reserved += rank.host_offload_bytes
    reserved = m.get("reserved_peak_bytes")
    out = {
        "allocated_peak_bytes": int(allocated),
        "predicted_allocated_bytes": float(predicted_allocated),
        "allocated_relative_error": _finite(_relative_error(allocated, predicted_allocated)),
        "reserved_peak_bytes": None if reserved is None else int(reserved),
        "predicted_reserved_bytes": float(predicted_reserved),
        "reserved_relative_error": None if reserved is None else _finite(_relative_error(reserved, predicted_reserved)),
        "largest_allocation_bytes": float(rank.largest_allocation_bytes),
        **{k: m[k] for k in ("peak_component", "peak_op") if m.get(k) is not None},
        "note": ("torch.cuda.memory_stats: allocated_bytes.all.peak and reserved_bytes.all.peak over the steps"
                 if device == "cuda" else
                 "the peak of the live tensors the rank allocated over the steps (offloaded states included); a "
                 "CPU has no caching allocator, so reserved memory is not measured"),
    }
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def numerics(run: RunSpec, results: list[dict[str, Any]], reference: Any) -> dict[str, Any]:
    """The distributed run's loss (training) or logits and tokens (serving) against the reference
    (None: too large to run in one process here; reported as not checked)."""
    if reference is None:
        return {"check": "not run: the unsharded reference does not fit in this host's memory", "ok": True,
                "checked": False}
    bf16 = run.dtype is DType.BF16
    if run.training:
        (losses,) = [r["losses"] for r in results if r.get("losses") is not None]
        errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)]
        worst = max(errs) if errs else math.inf
        tol = LOSS_RTOL_BF16 if bf16 else LOSS_RTOL
        # NaN fails: every value must be finite, and a NaN error compares false with any bound.
        ok = (len(losses) == len(reference) and all(math.isfinite(v) for v in losses)
              and math.isfinite(worst) and worst <= tol)
        return {"check": "loss per step", "dtype": run.dtype.value, "measured": losses, "reference": list(reference),
                "max_relative_error": worst, "tolerance": tol, "ok": ok, "checked": True}
    tol = LOGIT_ATOL
    if bf16:  # rounding errors scale with the values rounded
        largest = max((abs(v) for ref_logits, _ in reference.values() for step in ref_logits for row in step
                       for v in row), default=1.0)
        tol = LOGIT_ROUNDOFFS_BF16 * BF16_UNIT_ROUNDOFF * max(1.0, largest)
    worst, tokens_equal, finite = 0.0, True, True
    near_ties: list[dict[str, Any]] = []
    for r in results:
        if r.get("logits") is None:
            continue
        ref_logits, ref_tokens = reference[r["replica"]]
        for row in range(len(ref_tokens[0]) if ref_tokens else 0):
            for step, (step_a, step_b) in enumerate(zip(r["logits"], ref_logits)):
                row_a, row_b = step_a[row], step_b[row]
                for a, b in zip(row_a, row_b):
                    finite &= math.isfinite(a)
                    worst = max(worst, abs(a - b))
                mine, theirs = r["tokens"][step][row], ref_tokens[step][row]
                if mine == theirs:
                    continue
                # Greedy picks of two logits within the tolerance of each other (in the reference
                # and in the run) are a tie that rounding decides; later steps follow other tokens.
                margin = abs(row_b[theirs] - row_b[mine])
                if margin <= tol and abs(row_a[theirs] - row_a[mine]) <= tol:
                    near_ties.append({"replica": r["replica"], "row": row, "step": step, "tokens": [mine, theirs],
                                      "reference_margin": margin})
                else:
                    tokens_equal = False
                break
    ok = finite and tokens_equal and worst <= tol
    out = {"check": "logits and greedy tokens of prefill and decode", "dtype": run.dtype.value, "max_abs_error": worst,
           "tolerance": tol, "tokens_equal": tokens_equal, "ok": ok, "checked": True}
    if near_ties:
        out["near_ties"] = near_ties
        out["note"] = ("a sequence whose greedy token differs at a near tie (two logits within the tolerance) is "
                       "compared up to that step only")
    return out


def _time(run: RunSpec, results: list[dict[str, Any]], report: CostReport, device: str) -> dict[str, Any]:
    t = report.time
    if run.training:
        steady = [s for r in results for s in (r["step_seconds"][1:] or r["step_seconds"])]
        measured = {"step_seconds": max(steady)}
        assert isinstance(t, TrainingTimeReport)
        predicted = {"step_seconds": t.step_seconds}
    else:
        measured = {"ttft_seconds": max(r["prefill_seconds"] for r in results),
                    "tpot_seconds": max(r["decode_seconds_per_token"] for r in results)}
        assert isinstance(t, ServingTimeReport)
        predicted = {"ttft_seconds": t.ttft_seconds, "tpot_seconds": t.tpot_seconds}
    out: dict[str, Any] = {"measured": measured, "predicted": predicted, "compared": device == "cuda"}
    if device == "cuda":
        out["ratio_measured_over_predicted"] = {k: measured[k] / predicted[k] for k in measured if predicted[k] > 0}
    else:
        out["reason"] = "CPU timings say nothing about GPU speed; time is compared on GPUs only"
    return out


def _measured_at(rank: Any, training: bool) -> dict[str, float]:
    """A stage's predicted components as verify measures them: a training rank's activations are
    read when a forward ends, before backward re-runs a layer under full recomputation, so that
    layer's share (`RECOMPUTED_LAYER`, kept under its own key) is taken out."""
    out = dict(rank.per_gpu_bytes)
    later = rank.detail_bytes.get(RECOMPUTED_LAYER, 0.0) if training else 0.0
    if later:
        out["activations"] -= later
        out[RECOMPUTED_LAYER] = later
    # the peak counts activations freed before their gradients once, under the gradients; at the
    # forward's end they are all there
    out["activations"] += rank.detail_bytes.get(FREED_BEFORE_GRADIENTS, 0.0) if training else 0.0
    return out


def compare(run: RunSpec, hw: HardwareProfile, results: list[dict[str, Any]], reference: Any, *,
            plan: str, backend: str, device: str) -> dict[str, Any]:
    """The verify report: per rank and component, numerics, time, and the verdict."""
    workload = run.training_workload() if run.training else run.inference_workload()
    report = estimate(run.spec, hw, run.layout, workload)
    per_stage = {r.stage: _measured_at(r, run.training) for r in report.memory.per_rank}
    rank_memory = {r.stage: r for r in report.memory.per_rank}
    host_per_stage = {r.stage: r.host_offload_bytes for r in report.memory.per_rank}
    ranks = []
    mismatches: list[str] = []
    for r in sorted(results, key=lambda r: r["rank"]):
        predicted = per_stage[r["stage"]]
        comps = (_training_components(run, predicted, r["measured"], host_per_stage[r["stage"]]) if run.training
                 else _serving_components(run, r["stage"], predicted, r["measured"]))
        for c in comps:
            if not c["ok"]:
                err = c["relative_error"]
                how = f"{err:+.1%}" if err is not None else "measured where none was predicted"
                mismatches.append(f"rank {r['rank']} {c['component']}: {how} (tolerance {c['tolerance']:.0%})")
        entry = {k: r[k] for k in ("rank", "pp", "dp", "tp", "stage")} | {"cp": r.get("cp", 0),
            "components": comps, "step_seconds": r["step_seconds"], "wall_seconds": r["wall_seconds"],
            "extra_measured_bytes": {k: v for k, v in r["measured"].items() if k == "cuda_max_allocated_bytes"},
        }
        peak = memory_peak(run, rank_memory[r["stage"]], r["measured"], device)
        if peak is not None:
            entry["memory_peak"] = peak
        ranks.append(entry)
    num = numerics(run, results, reference)
    if not num["ok"]:
        mismatches.append(f"numerics: {num['check']} disagree with the unsharded reference")
    return {
        "plan": plan,
        "status": "ok" if not mismatches else "mismatch",
        "backend": backend,
        "device": device,
        "world_size": run.world_size,
        "run": run.as_dict(),
        "layout": report.plan.model_dump(mode="json"),
        "tolerances": TOLERANCES,
        "ranks": ranks,
        "numerics": num,
        "time": _time(run, results, report, device),
        "hardware": {"profile": hw.name, "num_nodes": hw.num_nodes, "gpus_per_node": hw.gpus_per_node},
        "probes": [r["probes"] | {"rank": r["rank"]} for r in sorted(results, key=lambda r: r["rank"]) if "probes" in r],
        "mismatches": mismatches,
    }
