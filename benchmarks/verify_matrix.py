"""`shardplan verify` on the `debug` model with gloo: every required layout at world sizes 2, 4
and 8, training and serving (sequence and context parallelism and CPU offload included), then
Mixtral's MoE proxy (experts split by tp, or whole experts over ep ranks). Prints one Markdown row per run: status, wall seconds of the whole
command (torchrun start-up included), the largest |relative error| of the model states and of
the activations over all ranks, and the numerics error.

    python benchmarks/verify_matrix.py            # from the repository root
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import build_plan  # noqa: E402
from shardplan.plan import manifest as mf  # noqa: E402
from shardplan.cost.layout import Layout  # noqa: E402
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload  # noqa: E402

TRAIN = TrainingWorkload(seq_len=256, global_batch_size=64)
SERVE = InferenceWorkload(max_model_len=512, input_len=64, output_len=8)
CASES = [
    ("TP", 2, dict(tp=2)), ("TP", 4, dict(tp=4)),
    ("PP", 2, dict(pp=2)), ("PP", 4, dict(pp=4)),
    ("FSDP", 2, dict(dp=2, zero_stage=3)), ("FSDP", 4, dict(dp=4, zero_stage=3)), ("FSDP", 8, dict(dp=8, zero_stage=3)),
    ("FSDP x TP", 4, dict(tp=2, dp=2, zero_stage=3)), ("FSDP x TP", 8, dict(tp=2, dp=4, zero_stage=3)),
    ("TP x PP x DP interleaved", 8, dict(tp=2, pp=2, dp=2, zero_stage=3, pp_schedule="interleaved", virtual_stages=2)),
    ("TP + SP", 2, dict(tp=2, sequence_parallel=True)), ("TP x PP + SP", 4, dict(tp=2, pp=2, sequence_parallel=True)),
    ("FSDP x TP + SP", 4, dict(tp=2, dp=2, zero_stage=3, sequence_parallel=True)),
    ("TP x PP x DP interleaved + SP", 8, dict(tp=2, pp=2, dp=2, zero_stage=3, pp_schedule="interleaved",
                                              virtual_stages=2, sequence_parallel=True)),
    ("CP", 2, dict(cp=2)), ("CP x TP", 4, dict(cp=2, tp=2)), ("CP x FSDP", 4, dict(cp=2, dp=2, zero_stage=3)),
    ("CP x TP + SP", 4, dict(cp=2, tp=2, sequence_parallel=True)),
    ("FSDP + CPU offload", 2, dict(dp=2, zero_stage=3, offload_params="cpu", offload_optimizer="cpu")),
    ("FSDP x TP + CPU offload", 4, dict(tp=2, dp=2, zero_stage=3, offload_params="cpu", offload_optimizer="cpu")),
]
SERVE_CASES = [("TP", 2, dict(tp=2)), ("PP", 2, dict(pp=2)), ("TP x PP", 4, dict(tp=2, pp=2)),
               ("DP x PP", 4, dict(dp=2, pp=2)), ("TP x PP x DP", 8, dict(tp=2, pp=2, dp=2))]
MOE = "mixtral-8x7b"  # its proxy: 8 experts, top-2, tensor-parallel experts
MOE_CASES = [("MoE TP", 2, dict(tp=2)), ("MoE FSDP x TP", 4, dict(tp=2, dp=2, zero_stage=3)),
             ("MoE DP x EP", 2, dict(dp=2, ep=2)), ("MoE FSDP x EP", 4, dict(dp=4, ep=2, zero_stage=3)),
             ("MoE PP x DP x EP", 4, dict(pp=2, dp=2, ep=2))]
MOE_SERVE_CASES = [("MoE TP", 2, dict(tp=2)), ("MoE TP x PP", 4, dict(tp=2, pp=2)), ("MoE TP x EP", 2, dict(tp=2, ep=2))]


def run(kind: str, name: str, gpus: int, layout: dict, folder: Path, model: str = "debug") -> str:
    wl = TRAIN if kind == "training" else SERVE
    m, _ = build_plan(model, gpus, Layout(**layout), wl)
    plan = folder / f"{kind}-{gpus}.yaml"
    mf.write_manifest(m, plan)
    report = folder / "report.json"
    report.unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shardplan", "verify", str(plan), "--report", str(report)],
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    if not report.is_file():
        return f"| {kind} | {name} | {gpus} | exit {proc.returncode} | {wall:.1f} | - | - | - |"
    r = json.loads(report.read_text())
    if r["status"] == "failed":
        return f"| {kind} | {name} | {gpus} | failed: {r['cause'][0][:60]} | {wall:.1f} | - | - | - |"
    states = [abs(c["relative_error"]) for k in r["ranks"] for c in k["components"]
              if c["component"] not in ("activations", "temporary")]
    acts = [abs(c["relative_error"]) for k in r["ranks"] for c in k["components"] if c["component"] == "activations"]
    n = r["numerics"]
    err = n.get("max_relative_error", n.get("max_abs_error"))
    return (f"| {kind} | {name} | {gpus} | {r['status']} | {wall:.1f} | {max(states):.2%} | {max(acts):.1%} "
            f"| {err:.1e} |")


def main() -> None:
    print("| work | layout | ranks | status | wall s | max state error | max activation error | numerics error |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, gpus, layout in CASES:
            print(run("training", name, gpus, layout, Path(tmp)), flush=True)
        for name, gpus, layout in SERVE_CASES:
            print(run("serving", name, gpus, layout, Path(tmp)), flush=True)
        for name, gpus, layout in MOE_CASES:
            print(run("training", name, gpus, layout, Path(tmp), MOE), flush=True)
        for name, gpus, layout in MOE_SERVE_CASES:
            print(run("serving", name, gpus, layout, Path(tmp), MOE), flush=True)


if __name__ == "__main__":
    main()
