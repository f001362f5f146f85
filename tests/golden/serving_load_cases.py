"""Published benchmark_serving runs (tests/data/serving_load/*.yaml) as inputs to the continuous-
batching model: each row's model, GPU, engine version, flags, layout and traffic, mapped to
shardplan's, and the figures it reports. Shared by tests/golden/test_serving_load_published.py
and benchmarks/serving_load_errors.py.

Traffic per row, from what the row states (docs/research/serving-load-sources.md):
- vLLM's client with its random dataset: every prompt has the stated length (range ratio 0);
  outputs end at EOS unless ignore_eos, so their mean is the run's own (total generated / requests).
- SGLang's bench_serving random dataset: lengths drawn from U[1, len] for prompts and outputs
  (sample_random_requests with range ratio 0), ignore_eos on.
- ShareGPT: the bundled histogram of vLLM's first-turn sampling (knowledge/datasets/sharegpt.yaml,
  right-skewed outputs) scaled to the run's mean prompt and output lengths (the tokenizer and chat
  template differ by model).
A run's token totals are properties of the workload the clients sent (not of the engine's
speed), so every sample is rescaled to the run's totals.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).resolve().parent.parent / "data" / "serving_load"
FILES = ("gpustack_performance_lab.yaml", "sglang_cookbook.yaml", "vllm_recipes_and_github_threads.yaml")

GPUS = {
    "NVIDIA H100 SXM (80GB)": "h100-sxm-80gb",
    "NVIDIA H200 SXM (141GB)": "h200-sxm-141gb",
    "NVIDIA B200": "b200-sxm-180gb",
    "NVIDIA A100 80GB": "a100-sxm-80gb",
    "NVIDIA A100 (memory size not stated)": "a100-sxm-80gb",
}
# Flags the model reads; any other flag makes a row "not modelled" (reported, never judged).
MODELLED_FLAGS = {"max_model_len", "max_num_batched_tokens", "max_num_seqs", "enforce_eager",
                  "gpu_memory_utilization", "enable_expert_parallel", "guided_decoding_backend"}
# Bundled model specs for rows whose config is not in tests/data/serving_load/models.
BUNDLED = {"meta-llama/Llama-3.1-70B": "llama-3.1-70b", "deepseek-ai/DeepSeek-R1-0528": "deepseek-v3",
           "Qwen/Qwen3-235B-A22B-Instruct-2507": "qwen3-235b-a22b"}


@dataclass(frozen=True)
class Case:
    id: str
    row: dict[str, Any]
    model: str  # a bundled name or a config.json path
    hardware: str
    engine: str
    engine_version: str
    quantization: str | None
    tp: int
    pp: int
    ep: int
    flags: dict[str, Any]
    requests: tuple[tuple[int, int], ...]
    max_concurrency: int | None
    request_rate: float
    why_not_modelled: str | None  # None: judged


def rows() -> list[dict[str, Any]]:
    out = []
    for name in FILES:
        out.extend(yaml.safe_load((DATA / name).read_text())["runs"])
    return out


def _version(text: str) -> str | None:
    token = str(text).split()[0].lstrip("v")
    parts = token.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:3] if p):
        return None
    return ".".join(p for p in parts[:3] if p.isdigit())


def _model_file(row: dict[str, Any]) -> str | None:
    hf = row["hf_id"]
    if hf in BUNDLED:
        return BUNDLED[hf]
    folder = DATA / "models"
    base = str(row.get("served_checkpoint") or hf).split("/")[-1].lower()
    for candidate in (base, hf.split("/")[-1].lower()):
        for f in folder.glob("*.json") if folder.is_dir() else ():
            if f.stem.lower() == candidate:
                return str(f)
    return None


def _quantization(row: dict[str, Any]) -> str | None:
    q = (row.get("quantization") or "").lower()
    if q.startswith("fp8"):
        return "fp8"
    if q.startswith("awq"):
        return "awq"
    return None


def _scaled(lengths: list[int], total: int) -> list[int]:
    s = sum(lengths)
    return [max(1, round(x * total / s)) for x in lengths] if s else lengths


def _sglang_client(row: dict[str, Any]) -> bool:
    """SGLang's bench_serving sent the requests (the cookbook's commands; GPUStack used vLLM's client)."""
    command = str(row.get("benchmark_command", ""))
    return "vllm bench" not in command and "benchmark_serving" not in command and "sglang" in command


def _requests(row: dict[str, Any], seed: int = 0) -> tuple[tuple[int, int], ...]:
    m = row["measured"]
    n = int(m["successful_requests"])
    total_in, total_out = int(m["total_input_tokens"]), int(m["total_generated_tokens"])
    rng = random.Random(seed)
    if row["dataset"] == "random" and _sglang_client(row):
        ins = [rng.randint(1, int(row["input_len"])) for _ in range(n)]
        outs = [rng.randint(1, int(row["output_len"])) for _ in range(n)]
    elif row["dataset"] == "sharegpt":
        from shardplan.specs.lengths import load_lengths

        pairs = load_lengths("sharegpt").sample(n, seed)
        ins, outs = [p for p, _ in pairs], [o for _, o in pairs]
    else:
        ins = [total_in // n] * n
        outs = [total_out // n] * n
    return tuple(zip(_scaled(ins, total_in), _scaled(outs, total_out)))


def cases() -> list[Case]:
    out = []
    for row in rows():
        if not row.get("golden_suitable"):
            continue
        flags = dict(row.get("engine_flags") or {})
        why = None
        extra = sorted(set(flags) - MODELLED_FLAGS)
        if extra:
            why = f"flags not modelled: {', '.join(extra)}"
        model = _model_file(row)
        if model is None:
            why = why or f"no config for {row['hf_id']} in tests/data/serving_load/models"
        hw = GPUS.get(row["gpu"])
        if hw is None:
            why = why or f"no profile for {row['gpu']}"
        version = _version(row["engine_version"])
        if version is None:
            why = why or "engine version not stated"
        if (row.get("dp") or 1) > 1:
            why = why or "data-parallel attention not modelled"
        ep = int(row.get("ep") or 1)
        if flags.get("enable_expert_parallel"):
            ep = int(row["tp"])
        rate = row.get("request_rate")
        out.append(Case(
            id=row["id"], row=row, model=model or "", hardware=hw or "", engine=row["engine"],
            engine_version=version or "", quantization=_quantization(row), tp=int(row["tp"]), pp=int(row.get("pp") or 1),
            ep=ep, flags=flags, requests=_requests(row) if why is None else (),
            max_concurrency=row.get("max_concurrency"),
            request_rate=math.inf if rate in (None, "inf") else float(rate), why_not_modelled=why,
        ))
    return out


class NotModelled(Exception):
    """The case's deployment does not start as shardplan sizes it: nothing to compare."""


def predict(case: Case) -> Any:
    """The model's LoadResult for a case (shardplan's own inputs path: engine rules, layout, memory);
    NotModelled when shardplan says the deployment does not start."""
    from shardplan.cost import inputs
    from shardplan.cost.layout import Layout
    from shardplan.cost.serving_load import Traffic, serve_traffic
    from shardplan.knowledge.load import engine_rules
    from shardplan.specs import loading

    spec = loading.load_model(case.model).spec
    hw = loading.load_hardware(case.hardware)
    f = case.flags
    wl = inputs.inference_workload(
        engine=engine_rules(case.engine, case.engine_version), hw=hw, model_max_len=spec.max_position_embeddings,
        max_model_len=int(f["max_model_len"]) if "max_model_len" in f else None,
        max_num_seqs=int(f["max_num_seqs"]) if "max_num_seqs" in f else None,
        max_num_batched_tokens=int(f["max_num_batched_tokens"]) if "max_num_batched_tokens" in f else None,
        gpu_memory_utilization=float(f["gpu_memory_utilization"]) if "gpu_memory_utilization" in f else None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=case.quantization,
        enforce_eager=bool(f.get("enforce_eager", False)), input_len=1024, output_len=128, batch_size=None,
        checkpoint_expert_format=spec.expert_dtype)
    layout = Layout(tp=case.tp, pp=case.pp, dp=1, ep=case.ep)
    traffic = Traffic(requests=case.requests, request_rate_per_second=case.request_rate,
                      max_concurrency=case.max_concurrency)
    from shardplan.cost.memory_serving import serving_memory

    sm = serving_memory(spec, hw, layout, wl)
    if not sm.fits:
        raise NotModelled(f"does not start as shardplan sizes it: {sm.reason}")
    return serve_traffic(spec, hw, layout, wl, traffic, kv=sm.kv_account)


def errors(case: Case, result: Any) -> dict[str, float]:
    """Relative errors (predicted / measured - 1) of the three judged figures."""
    m = case.row["measured"]
    return {
        "median_ttft": result.ttft_seconds.p50 * 1e3 / m["median_ttft_ms"] - 1,
        "median_tpot": result.tpot_seconds.p50 * 1e3 / m["median_tpot_ms"] - 1,
        "output_throughput": result.output_tokens_per_second / m["output_tokens_per_second"] - 1,
    }
