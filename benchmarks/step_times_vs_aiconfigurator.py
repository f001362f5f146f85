"""One engine step, two cost models: shardplan's step seconds (cost/step_model.py StepModel and the
pass_time breakdown under it) against NVIDIA aiconfigurator's per-op times, which are read from its
SILICON database (kernels measured on real GPUs; vLLM backend). For each step composition (a pure
decode step of B sequences at a context of C tokens, or one prefill chunk of P tokens) it prints
both totals and the split by op class, so a gap at large batch can be put on one op class.

Run from the repository root, in shardplan's environment, with aiconfigurator installed in its own
venv (it pins numpy/pandas/pyarrow; benchmark-only):

    python3.11 -m venv /work/aic-venv && /work/aic-venv/bin/pip install aiconfigurator==0.12.0
    python benchmarks/step_times_vs_aiconfigurator.py                      # all cases, Markdown
    python benchmarks/step_times_vs_aiconfigurator.py --cases qwen3-14b    # one case
    python benchmarks/step_times_vs_aiconfigurator.py --aic-python /path/to/python --json out.json

The aiconfigurator side runs as a subprocess of --aic-python (`--aic-worker` mode of this same file,
which imports only aiconfigurator_core and the standard library): its `EngineHandle.compile(model,
system, "vllm", tp_size=..)` builds the model's op list, `decode_step_per_op(B, isl=C, osl=2)` sums a
decode step at context C (osl=2: the step right after the prompt, C + 1 tokens attended), and
`mixed_step_breakdown_per_op(P, 0, isl=P, osl=2)` a prefill step of P tokens. Its figures are
NVIDIA's measured kernel times (Apache-2.0 data, aiconfigurator 0.12.0, systems/data/h100_sxm/*/vllm);
only numbers are taken.

Op classes (both tools): gemm (the dense projections: qkv, o, gate/up, down, MoE router), moe (routed
experts' grouped GEMMs), attention, logits (lm_head), comm (all-reduces, MoE dispatch/combine), elementwise
(norms, residuals, activation, embedding), fixed (shardplan only: per-kernel GPU overhead, host
issuing the GPU waits for, the engine's per-step scheduler time; aiconfigurator sums kernel times only).

Data to stdout; progress to stderr. Not product code: it reads shardplan.cost internals
(compute._linear_time) to split the GEMMs, which may move.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_AIC_PYTHON = "/work/aic-venv/bin/python"
SYSTEM = "h100_sxm"
PROFILE = "h100-sxm-80gb"
ENGINE, ENGINE_VERSION = "vllm", "0.11.0"
CLASSES = ("gemm", "moe", "attention", "logits", "comm", "elementwise", "fixed")

# (id, aiconfigurator model (HF id it bundles, or a config.json to copy into a folder), shardplan model,
#  tp, moe_tp, steps). A step: ("decode", batch, context_tokens) or ("prefill", prompt_tokens).
_QWEN14_DECODE = [("decode", b, c) for c in (400, 4000) for b in (1, 16, 64, 128, 256, 512, 1024)]
_70B = [("decode", b, c) for c in (400, 4000) for b in (1, 64, 256)] + [("prefill", 8192)]
_MOE = [("decode", b, c) for c in (400, 4000) for b in (1, 64, 256, 512)] + [("prefill", 8192)]
CASES = [
    ("qwen3-14b", "shardplan/validation/corpus/serving_load/models/qwen3-14b.json", "shardplan/validation/corpus/serving_load/models/qwen3-14b.json",
     1, None, _QWEN14_DECODE + [("prefill", 2048), ("prefill", 8192)]),
    ("llama-3.1-70b-tp4", "meta-llama/Meta-Llama-3.1-70B", "llama-3.1-70b", 4, None, _70B),
    ("llama-3.1-70b-tp8", "meta-llama/Meta-Llama-3.1-70B", "llama-3.1-70b", 8, None, _70B),
    ("qwen3-30b-a3b-tp1", "Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b", 1, 1, _MOE),
    ("qwen3-235b-a22b-tp8", "Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b", 8, 8, _MOE),
]


# ---- aiconfigurator side (runs under --aic-python; no shardplan import) ---------------------------

def _aic_class(name: str) -> str:
    n = name.split("_", 1)[1]  # drop context_/generation_
    if n == "moe":
        return "moe"
    if n == "attention":
        return "attention"
    if n == "logits_gemm":
        return "logits"
    if n.endswith("_gemm"):
        return "gemm"
    if "ar" in n.split("_") or "dispatch" in n or n == "p2p":
        return "comm"
    return "elementwise"  # embedding, add_norm_*, act_gate


def aic_worker() -> None:
    """Read the cases as JSON on stdin, write each step's per-op times (ms) as JSON to stdout."""
    import logging

    logging.disable(logging.WARNING)
    from aiconfigurator_core.sdk.engine import EngineHandle

    out = {}
    for case in json.load(sys.stdin):
        kw = {"tp_size": case["tp"]}
        if case["moe_tp"] is not None:
            kw.update(moe_tp_size=case["moe_tp"], moe_ep_size=1)
        h = EngineHandle.compile(case["aic_model"], SYSTEM, "vllm", **kw)
        steps = []
        for step in case["steps"]:
            if step[0] == "decode":
                _, b, c = step
                ops = h.decode_step_per_op(b, c, 2)
                total = h.decode_step_latency(b, c, 2)
            else:
                p = step[1]
                shared, ctx_attn, gen_attn = h.mixed_step_breakdown_per_op(p, 0, p, 2)
                ops = list(shared) + list(ctx_attn) + list(gen_attn)
                total = h.mixed_step_latency(p, 0, p, 2)
            steps.append({"step": step, "total_ms": total,
                          "ops": [(n, ms, src, _aic_class(n)) for n, ms, _, src in ops]})
        out[case["id"]] = steps
    json.dump(out, sys.stdout)


def run_aic(cases: list[tuple], aic_python: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        payload = []
        for cid, aic_model, _, tp, moe_tp, steps in cases:
            if aic_model.endswith(".json"):  # a config.json path: aiconfigurator wants a folder
                folder = Path(tmp) / cid
                folder.mkdir()
                shutil.copy(REPO / aic_model, folder / "config.json")
                aic_model = str(folder)
            payload.append({"id": cid, "aic_model": aic_model, "tp": tp, "moe_tp": moe_tp, "steps": steps})
        print(f"aiconfigurator: {aic_python} ({len(payload)} cases)", file=sys.stderr)
        r = subprocess.run([aic_python, str(Path(__file__).resolve()), "--aic-worker"], input=json.dumps(payload),
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            sys.exit(f"aiconfigurator worker failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout)


# ---- shardplan side -------------------------------------------------------------------------------

def shardplan_steps(case: tuple) -> list[dict]:
    """Per step: StepModel.seconds (what the serving simulation uses) and the pass_time breakdown
    of the same composition split into the op classes above (ms)."""
    from shardplan.cost import inputs
    from shardplan.cost.compute import Work, _linear_time, head_forward, layer_kind_groups
    from shardplan.cost.layout import Layout
    from shardplan.cost.params import block_weights
    from shardplan.cost.step_model import StepModel
    from shardplan.cost.time_serving import pass_time
    from shardplan.knowledge.load import engine_rules
    from shardplan.specs import loading

    cid, _, sp_model, tp, _, steps = case
    model = str(REPO / sp_model) if sp_model.endswith(".json") else sp_model
    spec = loading.load_model(model).spec
    hw = loading.load_hardware(PROFILE)
    wl = inputs.inference_workload(
        engine=engine_rules(ENGINE, ENGINE_VERSION), hw=hw, model_max_len=spec.max_position_embeddings,
        max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None)
    layout = Layout(tp=tp, pp=1, dp=1, ep=1)
    top_seqs = max(wl.max_num_seqs, max(s[1] for s in steps if s[0] == "decode"))
    sm = StepModel(spec, hw, layout, wl, max(wl.max_num_batched_tokens, 8192), top_seqs)
    groups = layer_kind_groups(spec, range(spec.num_layers))
    out = []
    for step in steps:
        if step[0] == "decode":
            _, b, c = step
            seconds = sm.seconds(tokens=b, sampled=b, decoding=b, kv_tokens=b * c, prompt_units=0, prompt_step=False)
            graphs = b <= sm.graph_max
            bd = pass_time(spec, hw, layout, wl, batch=b, q_len=1, kv_len=c, decode=True, logit_tokens=b, graphs=graphs)
            work = Work(tokens=b, num_seqs=b, q_len=1, kv_len=c, decode=True, act_dtype=wl.activation_dtype,
                        kv_dtype=wl.kv_cache_dtype or wl.activation_dtype, quantization=wl.quantization,
                        cuda_graphs=True)
            logit_tokens = b
        else:
            p = step[1]
            seconds = sm.seconds(tokens=p, sampled=1, decoding=0, kv_tokens=0, prompt_units=p * (p + 1) / 2,
                                 prompt_step=True)
            graphs = p <= sm.graph_max and sm.graphs_for_prompt_steps
            bd = pass_time(spec, hw, layout, wl, batch=1, q_len=p, kv_len=p, decode=False, logit_tokens=1, graphs=graphs)
            work = Work(tokens=p, num_seqs=1, q_len=p, kv_len=p, decode=False, act_dtype=wl.activation_dtype,
                        kv_dtype=wl.kv_cache_dtype or wl.activation_dtype, quantization=wl.quantization,
                        cuda_graphs=True)
            logit_tokens = 1
        gemm = moe = 0.0
        per_gemm: dict[str, float] = {}
        for (moe_layer, _sliding, linear), _first, n in groups:
            for w in block_weights(spec, moe_layer, linear):
                if len(w.shape) != 2:
                    continue
                t = _linear_time(spec, hw, layout, w, work)[0] * n
                key = w.name.split(".")[-2]
                per_gemm[key] = per_gemm.get(key, 0.0) + t * 1e3
                if w.routed_expert:
                    moe += t
                else:
                    gemm += t
        logits = head_forward(spec, hw, layout, work, logit_tokens).matmul_seconds
        classes = {
            "gemm": gemm, "moe": moe, "attention": bd.attention, "logits": logits,
            "comm": bd.tensor_parallel + bd.expert_parallel + bd.pipeline_p2p, "elementwise": bd.memory,
            "fixed": bd.kernel_overhead + bd.host + bd.scheduler,
        }
        # The GEMM split must account for the breakdown's matmul seconds (parts sum to the whole).
        if abs((gemm + moe + logits) - bd.matmul) > 1e-6 * max(1.0, bd.matmul) + 1e-9:
            print(f"warning: {cid} {step}: GEMM split {gemm + moe + logits:.6f} s != matmul {bd.matmul:.6f} s",
                  file=sys.stderr)
        out.append({"step": list(step), "step_model_ms": seconds * 1e3, "pass_time_ms": bd.total * 1e3,
                    "classes_ms": {k: v * 1e3 for k, v in classes.items()}, "per_gemm_ms": per_gemm,
                    "graphs": graphs, "fixed_parts_ms": {"kernel_overhead": bd.kernel_overhead * 1e3,
                                                         "host": bd.host * 1e3, "scheduler": bd.scheduler * 1e3}})
    return out


# ---- report ---------------------------------------------------------------------------------------

def _label(step: list) -> str:
    return f"decode B={step[1]} C={step[2]}" if step[0] == "decode" else f"prefill P={step[1]}"


def render(cases: list[tuple], aic: dict, sp: dict) -> str:
    lines = []
    for case in cases:
        cid = case[0]
        lines.append(f"\n### {cid} on {SYSTEM}, vLLM (shardplan {ENGINE} {ENGINE_VERSION} rules)\n")
        head = " | ".join(f"{k} sp/aic" for k in CLASSES)
        lines.append(f"| step | shardplan ms | aic ms | sp/aic | {head} |")
        lines.append("|---|---:|---:|---:|" + "---:|" * len(CLASSES))
        for a, s in zip(aic[cid], sp[cid]):
            ac = {k: 0.0 for k in CLASSES}
            for _, ms, _, cls in a["ops"]:
                ac[cls] += ms
            cells = " | ".join(f"{s['classes_ms'][k]:.2f}/{ac[k]:.2f}" for k in CLASSES)
            lines.append(f"| {_label(s['step'])} | {s['step_model_ms']:.2f} | {a['total_ms']:.2f} | "
                         f"{s['step_model_ms'] / a['total_ms']:.2f} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aic-python", default=DEFAULT_AIC_PYTHON, help="python of the venv with aiconfigurator 0.12")
    ap.add_argument("--cases", nargs="*", help="case ids (default: all): " + ", ".join(c[0] for c in CASES))
    ap.add_argument("--json", type=Path, help="also write every figure (per op, per GEMM) to this file")
    ap.add_argument("--aic-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.aic_worker:
        aic_worker()
        return
    cases = [c for c in CASES if not args.cases or c[0] in args.cases]
    aic = run_aic(cases, args.aic_python)
    sys.path.insert(0, str(REPO))
    sp = {}
    for c in cases:
        print(f"shardplan: {c[0]}", file=sys.stderr)
        sp[c[0]] = shardplan_steps(c)
    print(render(cases, aic, sp))
    if args.json:
        args.json.write_text(json.dumps({"aiconfigurator": aic, "shardplan": sp}, indent=1))


if __name__ == "__main__":
    main()
