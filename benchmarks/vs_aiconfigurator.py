"""Ask shardplan and NVIDIA aiconfigurator the same serving question (issue 23): on 8 GPUs, with
TTFT <= 1000 ms and TPOT <= 50 ms, which layout gives the most output tokens/s per GPU, and what
TTFT and TPOT does each tool predict for its pick. Run from the repository root:

    python benchmarks/vs_aiconfigurator.py                       # aiconfigurator on PATH: fresh answers,
                                                                 # else the recorded ones
    python benchmarks/vs_aiconfigurator.py --aic-bin /work/aic-venv/bin/aiconfigurator --save
                                                                 # fresh answers, rewritten under
                                                                 # benchmarks/data/aiconfigurator/
    python benchmarks/vs_aiconfigurator.py --recorded            # recorded answers only (no aiconfigurator)
    python benchmarks/vs_aiconfigurator.py --cases llama --backends vllm
    cd CHECKOUT && python /path/to/benchmarks/vs_aiconfigurator.py --recorded --shardplan-legacy
                                                                 # that checkout's shardplan, without the
                                                                 # continuous-batching options (a "before")

aiconfigurator is an optional, benchmark-only install, kept out of shardplan's environment (it
pins numpy/pandas/pyarrow and ships ~100 MB of perf data):

    python3.11 -m venv /work/aic-venv && /work/aic-venv/bin/pip install aiconfigurator==0.12.0

Its answers come from `aiconfigurator cli default --total-gpus 8 ...` (the agg vs disagg search,
SILICON database mode: only measured kernels, reproducible); the figures are read from the
`best_config_topn.csv` files it writes under --save-dir (rank 1 of agg and of disagg), which hold
the same numbers as its printed tables. Its TTFT and TPOT are its steady-state estimates for the
pick (one number each, not percentiles); shardplan's are read at --slo-percentile.

shardplan runs as a subprocess of this interpreter (`python -m shardplan recommend ... --json`).
Its JSON field names are looked up through SHARDPLAN_FIELDS below (several candidate names per
figure, the first found wins); when the primary name is missing, the keys actually found are
printed on stderr, so a renamed field is one edit here. A failing command is recorded in the
table, not raised.

Data to stdout (a Markdown table for BENCHMARKS.md); progress and warnings to stderr.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO / "benchmarks" / "data" / "aiconfigurator"
ANSWERS = DATA_DIR / "answers-0.12.yaml"

# ---- the question (issue 23), the same for every case and both tools --------------------------
NUM_GPUS = 8
MAX_TTFT_MS = 1000.0
MAX_TPOT_MS = 50.0
SLO_PERCENTILE = 90
INPUT_LEN_TOKENS = 4000   # aiconfigurator's default --isl, passed explicitly
OUTPUT_LEN_TOKENS = 1000  # aiconfigurator's default --osl, passed explicitly
AIC_DATABASE_MODE = "SILICON"  # `cli default`'s default: measured kernels only, reproducible
AIC_TOP_N = 5

# aiconfigurator system -> shardplan hardware profile
PROFILE_FOR_SYSTEM = {"h100_sxm": "h100-sxm-80gb", "h200_sxm": "h200-sxm-141gb", "b200_sxm": "b200-sxm-180gb"}
# aiconfigurator backend -> shardplan --engine (None: leave shardplan's default engine)
ENGINE_FOR_BACKEND = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}
DEFAULT_BACKENDS = ("vllm", "sglang")
# aiconfigurator warnings kept with an answer (others: per-candidate skips, template and version notices)
NOTE_WARNINGS = ("returned no results", "falling back to")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # dense | moe
    aic_model: str  # a Hugging Face id whose config.json aiconfigurator ships (model_configs/)
    shardplan_model: str  # a model_specs/ name or a config.json path relative to the repository
    systems: tuple[str, ...] = ("h100_sxm",)


CASES: tuple[Case, ...] = (
    Case("llama-3.1-8b", "dense", "meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b"),
    Case("llama-3.1-70b", "dense", "meta-llama/Meta-Llama-3.1-70B", "llama-3.1-70b"),
    # no bundled spec: the Hugging Face config.json, as aiconfigurator 0.12 ships it
    Case("qwen3-32b", "dense", "Qwen/Qwen3-32B", "benchmarks/data/aiconfigurator/qwen3-32b.config.json"),
    Case("qwen3-30b-a3b", "moe", "Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
    Case("qwen3-235b-a22b", "moe", "Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b"),
    # FP8 checkpoint, 671 B parameters: does not fit 8 x 80 GB (aiconfigurator says so), so H200 too
    Case("deepseek-v3", "moe", "deepseek-ai/DeepSeek-V3", "deepseek-v3", ("h100_sxm", "h200_sxm")),
)

# ---- shardplan's JSON: candidate names, first found wins (edit here when the schema moves) -----
SHARDPLAN_FIELDS: dict[str, tuple[str, ...]] = {
    "plans": ("plans", "top"),  # the ranked list; [0] is the pick
    "layout": ("layout", "plan"),  # inside a plan: the degrees
    "figures": ("figures", "load", "time"),  # inside a plan: the predicted figures
    "goodput_per_gpu": (  # output tokens/s per GPU, inside figures
        "output_tokens_per_second_per_gpu",
        "goodput_tokens_per_second_per_gpu",
        "throughput_tokens_per_second_per_gpu",
    ),
    "ttft": ("ttft_p90_seconds", "ttft_seconds"),  # seconds; a {p50, p90, ...} dict is read at the percentile
    "tpot": ("tpot_p90_seconds", "tpot_seconds", "itl_seconds"),
    "concurrency": ("concurrency", "batch_size"),
}
DEGREES = ("tp", "pp", "dp", "ep", "etp")
# how shardplan is run (--shardplan-cmd replaces it); the current directory is inherited, so
# `cd CHECKOUT && python .../vs_aiconfigurator.py` runs that checkout's package
SHARDPLAN_EXE: list[str] = [sys.executable, "-m", "shardplan"]
# options the continuous-batching `recommend` adds; --shardplan-legacy leaves them out
NEW_SHARDPLAN_OPTIONS = ("--slo-percentile", "--concurrency")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- aiconfigurator ----------------------------------------------------------------------------


def find_aic_bin(given: str | None) -> str | None:
    """The aiconfigurator executable: --aic-bin, else on PATH, else None."""
    if given:
        return given if Path(given).is_file() or shutil.which(given) else None
    return shutil.which("aiconfigurator")


def aic_version(aic_bin: str) -> str:
    out = subprocess.run([aic_bin, "version"], capture_output=True, text=True, timeout=120)
    m = re.search(r"aiconfigurator\s+(\S+)", out.stdout + out.stderr)
    return m.group(1) if m else "unknown"


def aic_command(case: Case, system: str, backend: str, save_dir: str) -> list[str]:
    return [
        "aiconfigurator", "cli", "default",
        "--model-path", case.aic_model,
        "--total-gpus", str(NUM_GPUS),
        "--system", system,
        "--backend", backend,
        "--database-mode", AIC_DATABASE_MODE,
        "--isl", str(INPUT_LEN_TOKENS),
        "--osl", str(OUTPUT_LEN_TOKENS),
        "--ttft", f"{MAX_TTFT_MS:g}",
        "--tpot", f"{MAX_TPOT_MS:g}",
        "--top-n", str(AIC_TOP_N),
        "--no-color",
        "--save-dir", save_dir,
    ]


def _num(row: dict[str, str], key: str) -> float | None:
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return None


def _int(row: dict[str, str], key: str) -> int | None:
    v = _num(row, key)
    return None if v is None else int(v)


def _read_top(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def parse_agg(row: dict[str, str]) -> dict[str, Any]:
    """Rank 1 of agg/best_config_topn.csv. Its rows are per replica (num_total_gpus = GPUs per
    replica, concurrency and request_rate per replica); replicas = floor(NUM_GPUS / that), as in
    aiconfigurator's printed table. For MoE, dp is attention data parallelism and moe_tp/moe_ep
    split the experts (gpus/worker = tp*pp*dp = moe_tp*moe_ep*pp); bs is per attention-DP rank."""
    gpus_per_replica = _int(row, "num_total_gpus") or 0
    replicas = NUM_GPUS // gpus_per_replica if gpus_per_replica else 0
    return {
        "tp": _int(row, "tp"), "pp": _int(row, "pp"), "dp": _int(row, "dp"),
        "moe_tp": _int(row, "moe_tp"), "moe_ep": _int(row, "moe_ep"),
        "parallel": row.get("parallel"),
        "batch_size_per_rank": _int(row, "bs"), "global_batch_size_per_replica": _int(row, "global_bs"),
        **_replica_totals(row, gpus_per_replica, replicas),
        "memory_gib_per_gpu": _num(row, "memory"),
        "gemm": row.get("gemm"), "kvcache": row.get("kvcache"), "moe": row.get("moe"),
        "perf_db_version": row.get("version"),
    }


def parse_disagg(row: dict[str, str]) -> dict[str, Any]:
    """Rank 1 of disagg/best_config_topn.csv. Its rows, too, are per replica (one xPyD unit:
    num_total_gpus = its GPUs); replicas and totals as for agg."""
    def pool(p: str) -> dict[str, Any]:
        return {
            "workers": _int(row, f"({p})workers"), "tp": _int(row, f"({p})tp"), "pp": _int(row, f"({p})pp"),
            "dp": _int(row, f"({p})dp"), "moe_tp": _int(row, f"({p})moe_tp"), "moe_ep": _int(row, f"({p})moe_ep"),
            "parallel": row.get(f"({p})parallel"), "batch_size_per_rank": _int(row, f"({p})bs"),
        }
    gpus_per_replica = _int(row, "num_total_gpus") or 0
    replicas = NUM_GPUS // gpus_per_replica if gpus_per_replica else 0
    return {"prefill": pool("p"), "decode": pool("d"), **_replica_totals(row, gpus_per_replica, replicas)}


def _replica_totals(row: dict[str, str], gpus_per_replica: int, replicas: int) -> dict[str, Any]:
    """The figures agg and disagg rows share: per replica as printed, totals over the replicas."""
    conc = _num(row, "concurrency")
    rate = _num(row, "request_rate")
    return {
        "gpus_per_replica": gpus_per_replica, "replicas": replicas,
        "concurrency_per_replica": None if conc is None else int(conc),
        "concurrency_total": None if conc is None else int(conc) * replicas,
        "request_rate_per_second_total": None if rate is None else round(rate * replicas, 3),
        "output_tokens_per_second_per_gpu": _num(row, "tokens/s/gpu"),
        "output_tokens_per_second_per_gpu_cluster": _num(row, "tokens/s/gpu_cluster"),
        "tokens_per_second_per_user": _num(row, "tokens/s/user"),
        "ttft_ms": _num(row, "ttft"), "tpot_ms": _num(row, "tpot"),
        "request_latency_ms": _num(row, "request_latency"),
    }


def _children_cpu_seconds() -> float:
    """User + system CPU time of finished child processes (steadier than wall time on a shared machine)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_aic(aic_bin: str, case: Case, system: str, backend: str, raw_dir: Path | None) -> dict[str, Any]:
    """One `aiconfigurator cli default` call; the answer as a dict (status ok | no_answer)."""
    stem = f"{case.name}-{system}-{backend}"
    with tempfile.TemporaryDirectory(prefix="aic-") as save_dir:
        cmd = aic_command(case, system, backend, save_dir)
        env = dict(os.environ, HF_HUB_OFFLINE="1")  # its bundled config.json files, no Hub look-up
        log(f"aiconfigurator: {stem} ...")
        cpu0 = _children_cpu_seconds()
        start = time.perf_counter()
        out = subprocess.run([aic_bin, *cmd[1:]], capture_output=True, text=True, env=env, timeout=1800)
        wall = time.perf_counter() - start
        cpu = _children_cpu_seconds() - cpu0
        text = out.stdout + out.stderr
        answer: dict[str, Any] = {
            "case": case.name, "kind": case.kind, "model": case.aic_model, "system": system, "backend": backend,
            "command": " ".join(c if " " not in c else repr(c) for c in cmd).replace(save_dir, "DIR"),
            "exit_code": out.returncode, "wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
        }
        m = re.search(r"Best Experiment Chosen:\s*(\w+) at ([\d.,]+) tokens/s/gpu(?: \(([^)]*)\))?", text)
        if m:
            answer["best_mode"] = m.group(1)
            answer["best_mode_note"] = m.group(3)
        tops = {mode: sorted(Path(save_dir).glob(f"**/{mode}/best_config_topn.csv")) for mode in ("agg", "disagg")}
        for mode, parse in (("agg", parse_agg), ("disagg", parse_disagg)):
            rows = _read_top(tops[mode][0]) if tops[mode] else []
            answer[mode] = parse(rows[0]) if rows else None
            if raw_dir is not None and tops[mode]:
                shutil.copyfile(tops[mode][0], raw_dir / f"{stem}-{mode}-top{AIC_TOP_N}.csv")
        errors = [ln.split("] ", 3)[-1] for ln in text.splitlines() if "[E]" in ln]
        # warnings that qualify the answer: a mode with no result, kernels read in another format
        notes = [ln.split("] ", 3)[-1] for ln in text.splitlines()
                 if "[W]" in ln and any(w in ln for w in NOTE_WARNINGS)]
        answer["status"] = "ok" if answer["agg"] or answer["disagg"] else "no_answer"
        if errors:
            answer["errors"] = list(dict.fromkeys(errors))
        if notes:
            answer["notes"] = list(dict.fromkeys(notes))
        if answer["agg"]:
            answer["perf_db_version"] = answer["agg"]["perf_db_version"]
        if raw_dir is not None:
            header = (f"# {answer['command']}\n"
                      f"# exit {out.returncode}, wall {wall:.2f} s, cpu {cpu:.2f} s, {datetime.date.today()}\n")
            (raw_dir / f"{stem}.txt").write_text(header + text.replace(save_dir, "DIR"))
    log(f"  {answer['status']} in {wall:.1f} s (cpu {cpu:.1f} s)")
    return answer


# ---- shardplan ---------------------------------------------------------------------------------


def _first(d: Any, names: tuple[str, ...], what: str, warn: bool = True) -> tuple[str | None, Any]:
    """The first of `names` present in dict `d`; warns (once per call) with the keys found when the
    primary name is missing."""
    if not isinstance(d, dict):
        return None, None
    for n in names:
        if n in d:
            if warn and n != names[0]:
                log(f"  shardplan JSON: {what}: no {names[0]!r}, used {n!r} (keys: {sorted(d)})")
            return n, d[n]
    if warn:
        log(f"  shardplan JSON: {what}: none of {list(names)} (keys: {sorted(d)})")
    return None, None


def _at_percentile(v: Any, percentile: int) -> float | None:
    if isinstance(v, dict):
        for k in (f"p{percentile}", str(percentile), "mean"):
            if k in v:
                return v[k]
        return None
    return v if isinstance(v, (int, float)) else None


def shardplan_command(case: Case, system: str, backend: str, concurrency: int | None, legacy: bool) -> list[str]:
    model = case.shardplan_model
    if model.endswith(".json"):
        model = str(REPO / model)
    cmd = [
        "shardplan", "recommend", model, "-H", PROFILE_FOR_SYSTEM[system], "--gpus", str(NUM_GPUS),
        "--max-ttft-ms", f"{MAX_TTFT_MS:g}", "--max-tpot-ms", f"{MAX_TPOT_MS:g}",
    ]
    if not legacy:
        cmd += ["--slo-percentile", str(SLO_PERCENTILE)]
        if concurrency is not None:
            cmd += ["--concurrency", str(concurrency)]
    cmd += ["--input-len", str(INPUT_LEN_TOKENS), "--output-len", str(OUTPUT_LEN_TOKENS)]
    if ENGINE_FOR_BACKEND.get(backend):
        cmd += ["--engine", ENGINE_FOR_BACKEND[backend]]
    return cmd + ["--json"]


def run_shardplan(case: Case, system: str, backend: str, concurrency: int | None, legacy: bool) -> dict[str, Any]:
    cmd = shardplan_command(case, system, backend, concurrency, legacy)
    log(f"shardplan: {' '.join(cmd)}")
    start = time.perf_counter()
    out = subprocess.run([*SHARDPLAN_EXE, *cmd[1:]], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    res: dict[str, Any] = {"command": " ".join(cmd), "exit_code": out.returncode, "wall_seconds": round(wall, 2)}
    try:
        doc = json.loads(out.stdout)
    except json.JSONDecodeError:
        lines = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()
        res.update(status="error", error=re.sub(r"^(error:\s*)+", "", lines[-1])[:300])
        return res
    _, plans = _first(doc, SHARDPLAN_FIELDS["plans"], "result")
    if not plans:
        why = doc.get("why") or doc.get("binding_constraint") or f"exit {out.returncode}, no plans"
        rejected = doc.get("rejected")
        if rejected:
            why = f"{why}; rejected: {json.dumps(rejected, sort_keys=True)}"
        res.update(status="nothing_fits", error=str(why)[:300])
        return res
    plan = plans[0]
    _, layout = _first(plan, SHARDPLAN_FIELDS["layout"], "plans[0]")
    _, figures = _first(plan, SHARDPLAN_FIELDS["figures"], "plans[0]")
    layout = layout or {}
    res["layout"] = {k: layout[k] for k in DEGREES if k in layout} or layout
    for extra in ("replicas", "quantization", "kv_cache_dtype", "batch_size", "prefill", "decode", "mode"):
        if extra in layout:
            res["layout"][extra] = layout[extra]
    _, goodput = _first(figures, SHARDPLAN_FIELDS["goodput_per_gpu"], "figures")
    _, ttft = _first(figures, SHARDPLAN_FIELDS["ttft"], "figures")
    _, tpot = _first(figures, SHARDPLAN_FIELDS["tpot"], "figures")
    _, conc = _first(figures, SHARDPLAN_FIELDS["concurrency"], "figures", warn=False)
    ttft_s, tpot_s = _at_percentile(ttft, SLO_PERCENTILE), _at_percentile(tpot, SLO_PERCENTILE)
    res.update(
        status="ok",
        output_tokens_per_second_per_gpu=goodput,
        ttft_ms=None if ttft_s is None else ttft_s * 1e3,
        tpot_ms=None if tpot_s is None else tpot_s * 1e3,
        concurrency=conc,
    )
    return res


# ---- recorded answers ----------------------------------------------------------------------------

YAML_HEADER = """\
# aiconfigurator {version}'s answers to issue 23's question, written by benchmarks/vs_aiconfigurator.py --save
# (the raw output of each call is beside this file: <case>-<system>-<backend>.txt, and its rank-1..{top_n}
# tables as <case>-<system>-<backend>-{{agg,disagg}}-top{top_n}.csv).
#
# The question: {num_gpus} GPUs, TTFT <= {ttft:g} ms, TPOT <= {tpot:g} ms, input {isl} tokens, output {osl} tokens
# per request, no prefix cache, no speculative decoding, weights and KV in the checkpoint's format.
# How each figure was produced:
#   command          the exact call (DIR: a temporary --save-dir); HF_HUB_OFFLINE=1, so aiconfigurator reads
#                    the config.json it ships (aiconfigurator_core/model_configs); database mode {dbmode}
#                    (measured kernels only; `cli default`'s default).
#   wall_seconds     wall time of that call on the 2-core development machine (Python start-up included;
#                    it grows when the machine is busy), cpu_seconds its user + system CPU time.
#   best_mode        the "Best Experiment Chosen" line of its report (agg or disagg, by tokens/s/gpu).
#   agg / disagg     rank 1 of agg/best_config_topn.csv and disagg/best_config_topn.csv under --save-dir
#                    (ranked by tokens/s/gpu among the configurations that meet both SLAs); the same numbers
#                    as its printed tables. CSV rows are per replica; replicas = floor({num_gpus} / gpus_per_replica)
#                    and the *_total fields multiply by it (as its printed table does, e.g. "768 (=192x4)").
#   output_tokens_per_second_per_gpu          its "tokens/s/gpu": output tokens/s per GPU in use.
#   output_tokens_per_second_per_gpu_cluster  its "tokens/s/gpu_cluster": per GPU of all {num_gpus} (the goodput
#                    per GPU compared with shardplan's).
#   ttft_ms, tpot_ms its steady-state estimates for that configuration (one number each: not a percentile);
#                    tpot = 1000 / tokens_per_second_per_user.
#   tp/pp/dp/moe_tp/moe_ep  its parallel string tpXppYdpZetpUepV; for MoE, dp is attention data parallelism,
#                    moe_tp x moe_ep split the experts; batch_size_per_rank is per attention-DP rank.
#   perf_db_version  the backend version whose measured kernels it simulated with.
#   status           ok, or no_answer with its error lines (e.g. the model does not fit).
"""


def save_answers(version: str, answers: list[dict[str, Any]]) -> None:
    doc = {
        "aiconfigurator_version": version,
        "recorded_on": str(datetime.date.today()),
        "python": platform.python_version(),
        "question": {
            "num_gpus": NUM_GPUS, "max_ttft_ms": MAX_TTFT_MS, "max_tpot_ms": MAX_TPOT_MS,
            "input_len_tokens": INPUT_LEN_TOKENS, "output_len_tokens": OUTPUT_LEN_TOKENS,
            "database_mode": AIC_DATABASE_MODE,
        },
        "answers": answers,
    }
    header = YAML_HEADER.format(version=version, top_n=AIC_TOP_N, num_gpus=NUM_GPUS, ttft=MAX_TTFT_MS,
                                tpot=MAX_TPOT_MS, isl=INPUT_LEN_TOKENS, osl=OUTPUT_LEN_TOKENS,
                                dbmode=AIC_DATABASE_MODE)
    ANSWERS.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=110, allow_unicode=True))
    log(f"wrote {ANSWERS.relative_to(REPO)}")


def load_answers() -> tuple[str, list[dict[str, Any]]]:
    doc = yaml.safe_load(ANSWERS.read_text())
    return doc.get("aiconfigurator_version", "?"), doc.get("answers", [])


# ---- the table -----------------------------------------------------------------------------------


def _fmt(v: Any, nd: int = 0) -> str:
    return "" if v is None else f"{v:,.{nd}f}"


def aic_pick(a: dict[str, Any] | None) -> str:
    if not a:
        return "-"
    s = a.get("parallel") or f"tp{a['tp']}pp{a['pp']}"
    return f"{s} x{a['replicas']}, bs {a['batch_size_per_rank']}, conc {a['concurrency_total']}"


def disagg_pick(d: dict[str, Any] | None) -> str:
    if not d:
        return "-"
    p, q = d["prefill"], d["decode"]
    reps = f" x{d['replicas']}" if d.get("replicas", 1) != 1 else ""
    return (f"({p['workers']}P {p['parallel']} bs {p['batch_size_per_rank']} + "
            f"{q['workers']}D {q['parallel']} bs {q['batch_size_per_rank']}){reps}: "
            f"{_fmt(d['output_tokens_per_second_per_gpu_cluster'])}/GPU, "
            f"{_fmt(d['ttft_ms'])}/{_fmt(d['tpot_ms'], 1)} ms")


def sp_pick(s: dict[str, Any]) -> str:
    if s.get("status") != "ok":
        return f"{s.get('status')}: {s.get('error', '')}".replace("|", "/")
    lay = s.get("layout", {})
    deg = ",".join(f"{k}{lay[k]}" for k in DEGREES if k in lay and not (k == "etp" and lay[k] == lay.get("tp")))
    conc = f", conc {s['concurrency']}" if s.get("concurrency") is not None else ""
    return (deg or json.dumps(lay)[:80]) + conc


def print_table(rows: list[tuple[dict[str, Any], dict[str, Any] | None]], version: str, legacy: bool) -> None:
    sp_at = "static batch (--shardplan-legacy)" if legacy else f"p{SLO_PERCENTILE}"
    q = "" if legacy else f"p{SLO_PERCENTILE} "
    print(f"Question: {NUM_GPUS} GPUs, TTFT <= {MAX_TTFT_MS:g} ms, TPOT <= {MAX_TPOT_MS:g} ms, "
          f"input/output {INPUT_LEN_TOKENS}/{OUTPUT_LEN_TOKENS} tokens; aiconfigurator {version} "
          f"(`cli default`, {AIC_DATABASE_MODE}), shardplan {sp_at}. Goodput = output tokens/s per GPU "
          f"of the {NUM_GPUS}.\n")
    print(f"| case | system | backend | aiconfigurator agg pick | aic tok/s/GPU | aic TTFT ms | aic TPOT ms "
          f"| aic disagg pick | aic best | aic wall s | shardplan pick | sp tok/s/GPU | sp TTFT {q}ms "
          f"| sp TPOT {q}ms | sp wall s | sp/aic agg |")
    print("|---|---|---|---|---:|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|")
    for a, s in rows:
        agg = a.get("agg")
        if a.get("status") != "ok":
            err = "; ".join(a.get("errors", []))[:160].replace("|", "/")
            aic_cols = [f"no answer: {err}", "", "", "", "-", "-", _fmt(a.get("wall_seconds"), 1)]
        else:
            aic_cols = [aic_pick(agg), _fmt(agg and agg["output_tokens_per_second_per_gpu_cluster"]),
                        _fmt(agg and agg["ttft_ms"]), _fmt(agg and agg["tpot_ms"], 1), disagg_pick(a.get("disagg")),
                        a.get("best_mode", ""), _fmt(a.get("wall_seconds"), 1)]
        if s is None:
            sp_cols = ["not run", "", "", "", "", ""]
        else:
            g = s.get("output_tokens_per_second_per_gpu")
            base = agg and agg["output_tokens_per_second_per_gpu_cluster"]
            ratio = f"{g / base:.2f}" if g is not None and base else ""
            sp_cols = [sp_pick(s), _fmt(g), _fmt(s.get("ttft_ms")), _fmt(s.get("tpot_ms"), 1),
                       _fmt(s.get("wall_seconds"), 2), ratio]
        print("| " + " | ".join([a["case"], a["system"], a["backend"], *aic_cols, *sp_cols]) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aic-bin", help="the aiconfigurator executable (default: `aiconfigurator` on PATH)")
    parser.add_argument("--recorded", action="store_true",
                        help=f"use {ANSWERS.relative_to(REPO)}, never run aiconfigurator")
    parser.add_argument("--save", action="store_true",
                        help=f"with fresh answers: rewrite {ANSWERS.relative_to(REPO)} and the raw outputs beside it")
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    parser.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                        help="aiconfigurator backends (vllm,sglang,trtllm)")
    parser.add_argument("--systems", default="", help="only these aiconfigurator systems (e.g. h100_sxm)")
    parser.add_argument("--concurrency", default="auto",
                        help="shardplan --concurrency: auto (aiconfigurator's agg pick's total), none, or a number")
    parser.add_argument("--shardplan-legacy", action="store_true",
                        help=f"leave out {', '.join(NEW_SHARDPLAN_OPTIONS)} (a shardplan without continuous batching)")
    parser.add_argument("--slo-percentile", type=int, choices=(50, 90, 99), default=SLO_PERCENTILE,
                        help="the percentile shardplan holds TTFT and TPOT to (default: its own default, 90); "
                             "aiconfigurator's figures are single steady-state estimates, nearer a median")
    parser.add_argument("--shardplan-cmd", help=f"how to run shardplan (default: {' '.join(SHARDPLAN_EXE)!r})")
    parser.add_argument("--no-shardplan", action="store_true", help="only aiconfigurator's answers")
    opts = parser.parse_args()
    globals()["SLO_PERCENTILE"] = opts.slo_percentile  # the module constant every figure reads

    if opts.shardplan_cmd:
        SHARDPLAN_EXE[:] = shlex.split(opts.shardplan_cmd)
    want_cases = [c for c in opts.cases.split(",") if c]
    backends = [b for b in opts.backends.split(",") if b]
    systems = {s for s in opts.systems.split(",") if s}
    selected = [(c, s, b) for c in CASES if not want_cases or any(w in c.name for w in want_cases)
                for s in c.systems if not systems or s in systems for b in backends]

    aic_bin = None if opts.recorded else find_aic_bin(opts.aic_bin)
    if opts.aic_bin and not aic_bin and not opts.recorded:
        log(f"--aic-bin {opts.aic_bin}: not found; using the recorded answers")
    if aic_bin:
        version = aic_version(aic_bin)
        log(f"aiconfigurator {version} at {aic_bin}: fresh answers")
        raw_dir = DATA_DIR if opts.save else None
        if raw_dir:
            raw_dir.mkdir(parents=True, exist_ok=True)
        answers = [run_aic(aic_bin, c, s, b, raw_dir) for c, s, b in selected]
        if opts.save:
            save_answers(version, answers)
    else:
        if not ANSWERS.is_file():
            log(f"no aiconfigurator and no {ANSWERS}: install it (see the docstring) or pass --aic-bin")
            return 2
        version, recorded = load_answers()
        log(f"aiconfigurator not run: recorded answers of {version} from {ANSWERS.relative_to(REPO)}")
        keyed = {(a["case"], a["system"], a["backend"]): a for a in recorded}
        answers = [keyed[(c.name, s, b)] for c, s, b in selected if (c.name, s, b) in keyed]

    rows: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for a in answers:
        sp = None
        if not opts.no_shardplan:
            case = next(c for c in CASES if c.name == a["case"])
            if opts.concurrency == "auto":
                conc = (a.get("agg") or {}).get("concurrency_total")
            elif opts.concurrency == "none":
                conc = None
            else:
                conc = int(opts.concurrency)
            sp = run_shardplan(case, a["system"], a["backend"], conc, opts.shardplan_legacy)
        rows.append((a, sp))
    print_table(rows, version, opts.shardplan_legacy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
