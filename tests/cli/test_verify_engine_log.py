"""`shardplan verify PLAN --engine-log FILE`: the comparison end to end, and hostile logs that
must exit 2 with one line, fast and in bounded memory."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from conftest import REPO, build_plan

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload
from shardplan.plan.manifest import write_manifest
from shardplan.specs.engine_log import MAX_LOG_BYTES

LOGS = REPO / "shardplan" / "validation" / "corpus" / "engine_logs"
# CPU seconds of this process, where the check runs (a wall clock also counts whatever else the machine
# runs: beside the suite's torchrun sessions a 1.8 s case measured 3.08 s): generous, each takes under 2 s
# with tracemalloc on; a log that sent the reader into a pathological path would take far longer.
HOSTILE_SECONDS = 3.0
HOSTILE_PEAK_BYTES = 100 * 2**20


@pytest.fixture
def plan_20k(tmp_path):
    # The RTX 3090 20k log's inputs: Llama-3.1-8B, tp 1, max_model_len 20000, utilization 0.9; V0
    # 0.6.4 without chunked prefill profiles one max_model_len prefill (max_num_batched_tokens 20000).
    m, _ = build_plan("llama-3.1-8b", 1, Layout(),
                      InferenceWorkload(max_model_len=20000, max_num_batched_tokens=20000, gpu_memory_utilization=0.9),
                      hardware="rtx-3090-24gb")
    path = tmp_path / "plan.yaml"
    write_manifest(m, path)
    return path


def test_rtx3090_20k_rows_and_exit_code_agree(cli, plan_20k):
    r = cli("verify", plan_20k, "--engine-log", LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log", "--json")
    out = r.json()
    terms = {t["term"]: t for t in out["terms"]}
    assert set(terms) == {"total_gpu_memory", "gpu_memory_utilization", "max_model_len", "budget", "weights",
                          "activations", "non_torch", "kv_cache", "num_gpu_blocks", "max_concurrency"}
    assert terms["num_gpu_blocks"]["measured"] == 1952 and terms["weights"]["log_line"] == 5
    all_ok = all(t["ok"] for t in out["terms"]) and out["verdict"]["ok"]
    assert out["status"] == ("ok" if all_ok else "mismatch")
    assert r.exit_code == (0 if all_ok else 4)
    table = cli("verify", plan_20k, "--engine-log", LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log")
    assert table.exit_code == r.exit_code and "num_gpu_blocks" in table.stdout


def _hostile(tmp_path):
    cases = {}
    p = tmp_path / "million_lines.log"
    p.write_bytes(b"INFO garbage line with no figures\n" * 1_000_000)
    cases["million_lines"] = (p, "no vLLM/SGLang/TGI start-up memory lines")
    p = tmp_path / "long_line.log"
    p.write_bytes(b"GPU KV cache size: " + b"9" * 10_000_000 + b"\n")
    cases["long_line"] = (p, "lines over")
    p = tmp_path / "nul.log"
    p.write_bytes(b"# GPU blocks: 5, # CPU blocks: 1\n\x00\x01\x02")
    cases["nul"] = (p, "binary")
    p = tmp_path / "latin1.log"
    p.write_bytes(b"GPU KV cache size: 5 tokens \xff\xfe\n")
    cases["invalid_utf8"] = (p, "not UTF-8")
    p = tmp_path / "empty.log"
    p.write_bytes(b"")
    cases["empty"] = (p, "no vLLM/SGLang/TGI start-up memory lines")
    p = tmp_path / "huge.log"
    with p.open("wb") as f:
        f.truncate(MAX_LOG_BYTES + 1)  # sparse: nothing is written
    cases["over_cap"] = (p, "byte limit")
    p = tmp_path / "many_keywords.log"
    p.write_bytes(b"# GPU blocks: x\n" * 60_000 + b"GPU blocks: 3, # CPU blocks: 1\n" * 60_000)
    cases["many_keyword_lines"] = (p, "not one engine's start-up log")
    p = tmp_path / "backtrack.log"
    p.write_bytes((b"Load weight end." + b" avail mem=1" * 5000 + b"\n") * 10)
    cases["backtracking_bait"] = (p, "no vLLM/SGLang/TGI start-up memory lines")
    cases["directory"] = (tmp_path, "is a directory")
    return cases


CASES = ("million_lines", "long_line", "nul", "invalid_utf8", "empty", "over_cap", "many_keyword_lines",
         "backtracking_bait", "directory")


@pytest.mark.parametrize("case", CASES)
def test_hostile_log_exits_2_with_one_line_fast(cli, tmp_path, plan_20k, case):
    path, needle = _hostile(tmp_path)[case]
    tracemalloc.start()
    t0 = time.process_time()
    r = cli("verify", plan_20k, "--engine-log", path)
    elapsed = time.process_time() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2, r.stderr
    assert len(lines) == 1 and needle in lines[0] and path.name in lines[0], lines
    assert elapsed < HOSTILE_SECONDS, elapsed
    assert peak < HOSTILE_PEAK_BYTES, peak
    print(f"{case}: {elapsed * 1000:.0f} ms, peak {peak / 2**20:.1f} MiB")


def test_ansi_coloured_copy_gives_the_same_comparison(cli, tmp_path, plan_20k):
    text = (LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log").read_text()
    coloured = tmp_path / "coloured.log"
    coloured.write_text("".join(f"\x1b[1;32m{line}\x1b[0m\n" for line in text.splitlines()))
    plain = cli("verify", plan_20k, "--engine-log", LOGS / "vllm_v0_rtx3090_llama31_8b_20k.log", "--json").json()
    colour = cli("verify", plan_20k, "--engine-log", coloured, "--json").json()
    assert plain["terms"] == colour["terms"] and plain["verdict"] == colour["verdict"]


def test_truncated_log_exits_2_naming_what_is_missing(cli, plan_20k):
    r = cli("verify", plan_20k, "--engine-log", LOGS / "vllm_v0_rtx3090_llama31_8b_35k.log")
    assert r.exit_code == 2 and "ends before the KV cache is sized" in r.stderr and "'# GPU blocks'" in r.stderr


def test_schema_lists_engine_log(cli):
    r = cli("schema", "--output", "engine-log")
    assert r.exit_code == 0 and "EngineLogCheck" in r.stdout
