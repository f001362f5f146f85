"""llama.cpp's --n-cpu-moe against published decode speeds (tests/data/offload/llamacpp_partial_offload.yaml,
rows with `role: moe_expert_offload`; every row has its URL and quoted line).

All collected rows come from one machine (`llmfit-akciali-rtx2080-i9-10900x`: an RTX 2080 8 GB and an
i9-10900X with quad-channel DDR4 the author measured at ~102 GB/s), modelled by
tests/data/offload/profiles/rtx-2080-i9-10900x.yaml. Its host efficiency is fitted to one -ngl row
of the same machine (Qwen2.5-Coder-14B Q4_K_M at -ngl 42, another mechanism and another model;
`test_the_host_anchor_row`), never to these rows. Tolerance: the issue's 25% on tokens/s.

Errors at the time of writing (predicted vs measured tok/s):
- llmfit-2080-qwen3-30b-a3b-ncpumoe36 (Qwen3-30B-A3B Q4_K_M, -ngl 99 --n-cpu-moe 36): 38.70 vs 36.7,
  +5.4% (the row is the server's own generation speed).
- llmfit-2080-dscoder-v2-lite-ncpumoe16 (DeepSeek-Coder-V2-Lite Q4_K_M, --n-cpu-moe 16): 54.93 vs
  49.6, +10.7% (llmfit's bench average, which includes prompt processing: it sits a few % below
  the generation speed, PR #755).
- anchor, llmfit-2080-qwen25coder-14b-ngl42: 20.36 vs 20.7, -1.6%.
Listed miss: llmfit-2080-gptoss20b-ncpumoe12 (gpt-oss-20B, 36.4 tok/s): its experts are MXFP4, not a
GGUF type shardplan models (cost/gguf.py has no MXFP4 block format), so it cannot be predicted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardplan.cli import app

DATA = Path(__file__).parent.parent / "data" / "offload"
PROFILE = DATA / "profiles" / "rtx-2080-i9-10900x.yaml"
MACHINE = "llmfit-akciali-rtx2080-i9-10900x"
TOKENS_PER_SECOND_TOLERANCE = 0.25  # the bound for offload golden tests
MODELS = {
    "llmfit-2080-qwen3-30b-a3b-ncpumoe36": "qwen3-30b-a3b",
    "llmfit-2080-dscoder-v2-lite-ncpumoe16": str(DATA / "models" / "deepseek-coder-v2-lite.json"),
}
MISSES = {
    "llmfit-2080-gptoss20b-ncpumoe12": "MXFP4 expert weights: not a GGUF type shardplan models (cost/gguf.py)",
}


def _rows(role: str) -> list[dict]:
    return [r for r in yaml.safe_load((DATA / "llamacpp_partial_offload.yaml").read_text())["cases"]
            if r.get("role") == role]


def _tokens_per_second(model: str, *flags: str) -> float:
    result = CliRunner().invoke(app, [
        "estimate", model, "-H", str(PROFILE), "--gpus", "1", "--engine", "llamacpp", "--quantization", "q4_k_m",
        "--max-model-len", "4096", "--batch-size", "1", *flags, "--json"])
    assert result.exit_code in (0, 3), result.output  # 3: the plan's memory verdict; the speed is still reported
    return 1.0 / json.loads(result.stdout)["time"]["tpot_seconds"]


def _flags(row: dict) -> list[str]:
    off = row["offload"]
    flags = ["--n-cpu-moe", str(off["n_cpu_moe"])]
    if off.get("ngl_flag") is not None:
        flags += ["--n-gpu-layers", str(off["ngl_flag"])]
    return flags


def test_every_collected_row_is_predicted_or_a_listed_miss() -> None:
    ids = {r["id"] for r in _rows("moe_expert_offload")}
    assert ids == set(MODELS) | set(MISSES)
    assert all(r["machine"] == MACHINE for r in _rows("moe_expert_offload"))


@pytest.mark.parametrize("row", [r for r in _rows("moe_expert_offload") if r["id"] in MODELS], ids=lambda r: r["id"])
def test_moe_expert_offload_decode_speed(row: dict) -> None:
    measured = float(row["measured"]["tokens_per_second"])
    predicted = _tokens_per_second(MODELS[row["id"]], *_flags(row))
    assert predicted == pytest.approx(measured, rel=TOKENS_PER_SECOND_TOLERANCE), (row["source"], row["quote"])


def test_the_host_anchor_row() -> None:
    """The -ngl row the profile's efficiency.host_memory was fitted to reproduces (a check that the
    profile and the fit agree, not an independent test)."""
    [row] = [r for r in _rows("partial") if r["id"] == "llmfit-2080-qwen25coder-14b-ngl42"]
    predicted = _tokens_per_second(str(DATA / "models" / "qwen2.5-coder-14b.json"), "--n-gpu-layers",
                                   str(row["offload"]["layers_on_gpu"]))
    assert predicted == pytest.approx(row["measured"]["tokens_per_second"], rel=0.05)


def test_more_experts_on_the_host_is_slower_and_none_is_fastest() -> None:
    speeds = [_tokens_per_second("qwen3-30b-a3b", "--n-gpu-layers", "99", "--n-cpu-moe", str(n)) for n in (12, 24, 36, 48)]
    assert speeds == sorted(speeds, reverse=True)
