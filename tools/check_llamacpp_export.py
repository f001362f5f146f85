"""Run the exported `llama-server` command lines through a real llama-server's own parser.

    python tools/check_llamacpp_export.py --binary /path/to/build/bin/llama-server

llama-server has no dry-run, but it parses every argument before it loads the model
(common_params_parse, common/arg.cpp): an argument it does not know, a value it cannot take or a
missing value ends it at once with "error: invalid argument: X", "error while handling argument"
or "expected value for argument"; a command that parses goes on to load the model, and a model
path that does not exist fails there ("failed to open GGUF file"). So each exported server is
started with its own arguments except three: --model points at a file that does not exist,
--host is 127.0.0.1 and --port a free local port (it listens before it loads). A server that
reaches the model load passed the parser. Not in the test suite: CI has no llama-server binary.

The plans are made with the shardplan CLI (`recommend` with pinned layouts, in a temporary
folder) and edited where the CLI cannot yet plan GGUF formats or serving offload, as
tests/exporters/test_export_llamacpp.py does. Prints one line per server; exits 1 if any was
refused by the parser or did not reach the model load, or if the control (an exported command
with a vLLM flag added) was not refused.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from shardplan.exporters import export
from shardplan.exporters.base import argv
from shardplan.plan.manifest import load_manifest, write_manifest
from shardplan.plan.schema import DeploymentManifest

PARSER_REFUSED = ("error: invalid argument", "error while handling argument", "expected value for argument",
                  "unknown value for")
REACHED_LOAD = "failed to open GGUF file"
PLANS = {  # name -> recommend arguments (pinned layouts), then edits
    "1gpu-bf16": (["llama-3.1-8b", "--hardware", "rtx-3090-24gb", "--gpus", "1", "--max-model-len", "8192"], {}),
    "1gpu-q4_k_m-offload-8": (["llama-3.1-8b", "--hardware", "rtx-3090-24gb", "--gpus", "1", "--max-model-len", "8192"],
                              {"layout": {"weight_quantization": "q4_k_m", "offload_layers": 8, "offload_params": "cpu"},
                               "workload": {"quantization": "q4_k_m"}}),
    "1gpu-fp16-kv": (["llama-3.1-8b", "--gpus", "1", "--max-model-len", "4096", "--max-num-seqs", "4"],
                     {"layout": {"kv_cache_dtype": "fp16"}}),
    "pp2-layer-split": (["llama-3.1-8b", "--gpus", "2", "--pp", "2", "--max-model-len", "8192"], {}),
    "tp4-dp2-row-split": (["llama-3.1-70b", "--gpus", "8", "--tp", "4", "--dp", "2", "--max-model-len", "32768"], {}),
    "2node-tp4-dp4": (["llama-3.1-70b", "--gpus", "16", "--gpus-per-node", "8", "--tp", "4", "--dp", "4",
                       "--max-model-len", "32768"], {}),
}


def make_plan(folder: Path, name: str, args: list[str], edits: dict) -> DeploymentManifest:
    path = folder / f"{name}.yaml"
    subprocess.run(["shardplan", "recommend", *args, "-o", str(path), "--json"], check=True, capture_output=True)
    m = load_manifest(path)
    if edits:
        m = m.model_copy(update={"layout": m.layout.model_copy(update=edits.get("layout", {})),
                                 "workload": m.workload.model_copy(update=edits.get("workload", {}))})
        m = DeploymentManifest.model_validate(m.model_dump())
        write_manifest(m, path)
    return m


def server_argvs(m: DeploymentManifest) -> list[list[str]]:
    """argv after `llama-server` of each server in the exported serve.sh."""
    text = export(m, "llamacpp")[0].text
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        if not line.lstrip().startswith("#") and "llama-server" in line:
            words = argv(line.rstrip(" &"))
            out.append(words[words.index("llama-server") + 1:])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local(words: list[str], missing_model: str) -> list[str]:
    out = list(words)
    for flag, value in (("--model", missing_model), ("--host", "127.0.0.1"), ("--port", str(free_port()))):
        out[out.index(flag) + 1] = value
    return out


def run_one(binary: Path, words: list[str], timeout_seconds: float) -> tuple[str, str]:
    """('parsed' | 'refused' | 'unknown', the line that says so)."""
    res = subprocess.run([str(binary), *words], capture_output=True, text=True, timeout=timeout_seconds)
    out = res.stdout + res.stderr
    for line in out.splitlines():
        if any(p in line for p in PARSER_REFUSED):
            return "refused", line.strip()
    hit = next((line.strip() for line in out.splitlines() if REACHED_LOAD in line), None)
    if hit is not None:
        return "parsed", hit
    return "unknown", (out.strip().splitlines() or ["(no output)"])[-1]


def main(argv_: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--binary", type=Path, required=True, help="llama-server of the pinned release")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per server run")
    args = p.parse_args(argv_)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        missing = str(folder / "does-not-exist.gguf")
        for name, (rec, edits) in PLANS.items():
            m = make_plan(folder, name, rec, edits)
            for i, words in enumerate(server_argvs(m)):
                verdict, line = run_one(args.binary, local(words, missing), args.timeout)
                failures += verdict != "parsed"
                print(f"{verdict:8} {name}[{i}]: llama-server {' '.join(words)}\n         -> {line}")
        # the control: the first server's arguments plus one llama.cpp does not have must be refused
        words = local(server_argvs(make_plan(folder, "control", *PLANS["1gpu-bf16"]))[0], missing)
        verdict, line = run_one(args.binary, [*words, "--gpu-memory-utilization", "0.9"], args.timeout)
        failures += verdict != "refused"
        print(f"{verdict:8} control (+ --gpu-memory-utilization 0.9, must be refused)\n         -> {line}")
    print(f"{'all parsed, the control refused' if not failures else f'{failures} unexpected'}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
