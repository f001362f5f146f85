"""Training per stack against published measurements (issue: training per stack): for every row
of tests/data/training_stacks/<stack>.yaml with a complete `case:`, the predicted peak memory
(the caching allocator's reserved peak where the source printed reserved or nvidia-smi memory,
the allocated total where it printed torch.cuda.max_memory_allocated) and tokens/s against what
was measured. Prints a Markdown table per stack and the mean and max |error|. Run from the
repository root:

    python benchmarks/training_stacks.py

A row is skipped (and listed) when its case lacks the model, the GPU profile, the batch or the
sequence length; its measured figures stay in the data file with their sources. Not modelled
yet, so rows that use them say so in their error: fp8 training GEMMs, torch.compile, and
torchtitan's unsharded parameters under pipeline parallelism.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import yaml

from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, PipelineSchedule, Recompute
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import stack_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "training_stacks"
GIB = 2**30


def _memory_gib(measured: dict) -> tuple[float | None, str]:
    for key, scale in (("peak_memory_gib", 1.0), ("peak_memory_mib", 1 / 1024), ("memory_gib", 1.0)):
        if isinstance(measured.get(key), (int, float)):
            counter = str(measured.get("memory_counter", ""))
            return measured[key] * scale, "allocated" if "allocated" in counter else "reserved"
    return None, ""


def _tokens_per_gpu(measured: dict, gpus: int) -> float | None:
    if isinstance(measured.get("tokens_per_s_per_gpu"), (int, float)):
        return float(measured["tokens_per_s_per_gpu"])
    if isinstance(measured.get("tokens_per_s_all_gpus"), (int, float)):
        return float(measured["tokens_per_s_all_gpus"]) / gpus
    return None


def evaluate(stack: str, rows: list[dict]) -> tuple[list[tuple], list[str]]:
    out, skipped = [], []
    for r in rows:
        c = r.get("case") or {}
        model, hardware = c.get("model"), c.get("hardware") or c.get("closest_hardware_profile") or r.get(
            "closest_hardware_profile")
        if not (isinstance(model, str) and hardware and c.get("gpus") and c.get("micro_batch") and c.get("seq_len")):
            skipped.append(r["id"])
            continue
        try:
            spec = load_model(model).spec
            hw = cluster(load_hardware(hardware), gpus=c["gpus"], nodes=None, gpus_per_node=None)
            tp, pp, cp = c.get("tp") or 1, c.get("pp") or 1, c.get("cp") or 1
            dp = c.get("dp") or c["gpus"] // (tp * pp * cp)
            vp = c.get("vp") or 1
            layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=c.get("ep") or 1, zero_stage=c.get("zero_stage") or 0,
                            micro_batch_size=c["micro_batch"], recompute=Recompute(c.get("recompute") or "none"),
                            sequence_parallel=tp > 1 and stack in ("torchtitan", "megatron"), virtual_stages=vp,
                            pp_schedule=PipelineSchedule.INTERLEAVED if vp > 1 else PipelineSchedule.ONE_F_ONE_B)
            wl = training_workload(seq_len=c["seq_len"], global_batch_size=c.get("global_batch") or dp * c["micro_batch"],
                                   optimizer="adamw", framework=None, flash_attention=c.get("flash_attention"),
                                   dropout=bool(c.get("dropout")), stack=stack_rules(stack))
            rep = estimate(spec, hw, layout, wl)
        except (ShardplanError, ValueError) as e:
            skipped.append(f"{r['id']} ({e})")
            continue
        m = r.get("measured") or {}
        mem, counter = _memory_gib(m)
        rank = max(rep.memory.per_rank, key=lambda x: x.reserved_bytes)
        predicted_mem = (rank.reserved_bytes if counter == "reserved" else rank.per_gpu_bytes["total"]) / GIB
        tps = _tokens_per_gpu(m, c["gpus"])
        out.append((r["id"], mem, predicted_mem, counter, tps, rep.time.tokens_per_second_per_gpu))
    return out, skipped


def main() -> int:
    for path in sorted(DATA.glob("*.yaml")):
        stack = path.stem
        rows, skipped = evaluate(stack, yaml.safe_load(path.read_text())["rows"])
        print(f"\n### {stack}\n\n| row | memory measured | predicted | error | tokens/s/GPU measured | predicted | error |")
        print("|---|---|---|---|---|---|---|")
        mem_err, tps_err = [], []
        for rid, mem, pmem, counter, tps, ptps in rows:
            me = f"{pmem / mem - 1:+.0%}" if mem else ""
            te = f"{ptps / tps - 1:+.0%}" if tps else ""
            if mem:
                mem_err.append(abs(pmem / mem - 1))
            if tps:
                tps_err.append(abs(ptps / tps - 1))
            print(f"| {rid} | {f'{mem:.1f} GiB ({counter})' if mem else ''} | {pmem:.1f} GiB | {me} | "
                  f"{f'{tps:,.0f}' if tps else ''} | {ptps:,.0f} | {te} |")
        for what, errs in (("memory", mem_err), ("tokens/s", tps_err)):
            if errs:
                print(f"\n{what}: {len(errs)} rows, mean |error| {statistics.mean(errs):.0%}, max {max(errs):.0%}, "
                      f"within 10%: {sum(e <= 0.10 for e in errs)}")
        if skipped:
            print(f"\nskipped ({len(skipped)}): " + ", ".join(skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
