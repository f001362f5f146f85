"""Predicted against measured: the cost model applied to exactly what ran (the proxy or full
model, the run's layout, batch and fp32 formats), compared per rank and memory component,
plus the numerics check against the unsharded reference. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from shardplan.cost.estimate import estimate
from shardplan.cost.report import CostReport, ServingTimeReport, TrainingTimeReport
from shardplan.cost.layout import stage_layer_ranges
from shardplan.cost.memory_serving import kv_bytes_per_token_per_layer_per_rank
from shardplan.specs.hardware import HardwareProfile
from shardplan.units import DType, bytes_per_element
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
# Numerics in fp32: the loss of every step within LOSS_RTOL of the reference's (Adam
# amplifies reduction-order noise a little each step); serving: every generated token equal
# and every logit within LOGIT_ATOL.
LOSS_RTOL = 1e-4
LOGIT_ATOL = 1e-4


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
    zero = run.layout.zero_stage if run.layout.dp * run.layout.cp > 1 else 0
    out = []
    if zero == 2:
        out.append(_component("weights", m["gathered_params_peak_bytes"], predicted["weights"],
                              "gathered (unsharded) parameters between forward and backward"))
        out.append(_component("optimizer_states", m["optimizer_states_bytes"] + m["weights_at_rest_bytes"],
                              predicted["optimizer_states"], "moments plus the sharded fp32 parameter (the master)"))
    else:
        out.append(_component("weights", m["weights_at_rest_bytes"], predicted["weights"]))
        out.append(_component("optimizer_states", m["optimizer_states_bytes"], predicted["optimizer_states"]))
    out.insert(1, _component("gradients", m["gradients_bytes"], predicted["gradients"]))
    out.append(_component("activations", m["activations_bytes"], predicted["activations"]))
    if m.get("offloaded_states_bytes") or host_predicted:
        out.append(_component("offloaded_states", m.get("offloaded_states_bytes", 0), host_predicted,
                              "host memory: sharded parameters, gradients and optimizer states (CPU offload)"))
    if zero == 3:
        out.append(_component("temporary", m["gathered_params_peak_bytes"], predicted["temporary"],
                              "peak of gathered parameters at block boundaries"))
    return out


def _serving_components(run: RunSpec, stage: int, predicted: dict[str, float], m: dict[str, int]) -> list[dict[str, Any]]:
    L = run.layout
    layers = sum(len(r) for r in stage_layer_ranges(run.spec.num_layers, L.pp, L.virtual_stages)[stage])
    tokens = run.batch_size * (run.prompt_len + run.decode_steps)
    kv = kv_bytes_per_token_per_layer_per_rank(run.spec, L.tp, bytes_per_element(DType.FP32)) * layers * tokens
    return [
        _component("weights", m["weights_bytes"], predicted["weights"]),
        _component("kv_cache", m["kv_cache_bytes"], kv, f"{tokens} tokens (batch x (prompt + decode))"),
        _component("activations", m["activations_bytes"], predicted["activations"], "peak of the prefill forward"),
    ]


def numerics(run: RunSpec, results: list[dict[str, Any]], reference: Any) -> dict[str, Any]:
    """The distributed run's loss (training) or logits and tokens (serving) against the reference
    (None: too large to run in one process here; reported as not checked)."""
    if reference is None:
        return {"check": "not run: the unsharded reference does not fit in this host's memory", "ok": True,
                "checked": False}
    if run.training:
        (losses,) = [r["losses"] for r in results if r.get("losses") is not None]
        errs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)]
        worst = max(errs) if errs else math.inf
        ok = len(losses) == len(reference) and all(math.isfinite(v) for v in losses) and worst <= LOSS_RTOL
        return {"check": "loss per step", "measured": losses, "reference": list(reference), "max_relative_error": worst,
                "tolerance": LOSS_RTOL, "ok": ok, "checked": True}
    worst, tokens_equal, finite = 0.0, True, True
    for r in results:
        if r.get("logits") is None:
            continue
        ref_logits, ref_tokens = reference[r["replica"]]
        tokens_equal &= r["tokens"] == ref_tokens
        for step_a, step_b in zip(r["logits"], ref_logits):
            for row_a, row_b in zip(step_a, step_b):
                for a, b in zip(row_a, row_b):
                    finite &= math.isfinite(a)
                    worst = max(worst, abs(a - b))
    ok = finite and tokens_equal and worst <= LOGIT_ATOL
    return {"check": "logits and greedy tokens of prefill and decode", "max_abs_error": worst,
            "tolerance": LOGIT_ATOL, "tokens_equal": tokens_equal, "ok": ok, "checked": True}


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


def compare(run: RunSpec, hw: HardwareProfile, results: list[dict[str, Any]], reference: Any, *,
            plan: str, backend: str, device: str) -> dict[str, Any]:
    """The verify report: per rank and component, numerics, time, and the verdict."""
    workload = run.training_workload() if run.training else run.inference_workload()
    report = estimate(run.spec, hw, run.layout, workload)
    per_stage = {r.stage: dict(r.per_gpu_bytes) for r in report.memory.per_rank}
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
        ranks.append({k: r[k] for k in ("rank", "pp", "dp", "tp", "stage")} | {"cp": r.get("cp", 0),
            "components": comps, "step_seconds": r["step_seconds"], "wall_seconds": r["wall_seconds"],
            "extra_measured_bytes": {k: v for k, v in r["measured"].items() if k == "cuda_max_allocated_bytes"},
        })
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
