"""Published LoRA / QLoRA peak memory (tests/data/finetune/lora_memory.yaml) against shardplan.

Every row with a `case:` block is costed with `estimate` as the row ran (model, GPU, GPU count,
ZeRO-3/FSDP sharding, micro-batch, sequence, recompute, stack, adapter rank and targets, NF4 with
or without double quantization) and compared by the counter the source printed:

  allocated  torch.cuda.max_memory_allocated: the predicted total less the CUDA context, the
             non-torch memory and NCCL's buffers, which PyTorch's allocator never sees;
  reserved   nvidia-smi: the predicted reserved peak (allocated + the block for the largest tensor)
             with the context;
  capacity   the longest sequence that fits on the device: the predicted reserved peak at that
             sequence against the device's memory.

Rows without a case (other stacks: torchtune, LitGPT; families shardplan does not read) are listed.

    python benchmarks/finetune_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardplan.cost.estimate import estimate  # noqa: E402
from shardplan.cost.inputs import training_workload  # noqa: E402
from shardplan.cost.layout import Layout, Recompute  # noqa: E402
from shardplan.knowledge.load import stack_rules  # noqa: E402
from shardplan.specs.cluster import cluster  # noqa: E402
from shardplan.specs.loading import load_hardware, load_model  # noqa: E402

DATA = ROOT / "tests" / "data" / "finetune" / "lora_memory.yaml"
OVERHEAD = ("overhead.cuda_context", "overhead.non_torch", "overhead.nccl_buffers")


def predict(case: dict) -> tuple[float, float]:
    """(predicted bytes by the row's counter, measured bytes)."""
    model = case["model"]
    loaded = load_model(str(ROOT / model) if model.startswith("tests/") else model)
    hw = cluster(load_hardware(case["hardware"]), gpus=case["gpus"], nodes=None, gpus_per_node=None)
    layout = Layout(dp=case["gpus"], zero_stage=case["zero_stage"], micro_batch_size=case["micro_batch"],
                    recompute=Recompute(case["recompute"]))
    wl = training_workload(
        seq_len=case["seq_len"], global_batch_size=case["global_batch"], optimizer=case["optimizer"], framework=None,
        flash_attention=None, dropout=False, stack=stack_rules(case["stack"]), finetune=case["finetune"],
        lora_rank=case["lora_rank"], lora_targets=case["lora_targets"], lora_dropout=case["lora_dropout"],
        qlora_double_quant=case["double_quant"], spec=loaded.spec)
    report = estimate(loaded.spec, hw, layout, wl)
    rank = max(report.memory.per_rank, key=lambda r: r.reserved_bytes)
    counter = case["counter"]
    if counter == "allocated":
        return rank.per_gpu_bytes["total"] - sum(rank.detail_bytes.get(k, 0.0) for k in OVERHEAD), case["measured_bytes"]
    if counter == "reserved":
        return rank.reserved_bytes, float(case["measured_bytes"])
    if counter == "capacity":
        return rank.reserved_bytes, float(hw.memory_capacity_bytes)
    raise ValueError(f"unknown counter {counter!r}")


def evaluate(rows: list[dict]) -> tuple[list[tuple[str, str, str, float, float]], list[str]]:
    out, skipped = [], []
    for r in rows:
        case = r.get("case")
        if not case:
            skipped.append(r["id"])
            continue
        predicted, measured = predict(case)
        out.append((r["id"], case["finetune"], case["counter"], measured, predicted))
    return out, skipped


def main() -> int:
    rows, skipped = evaluate(yaml.safe_load(DATA.read_text())["rows"])
    print("| row | method | counter | measured | predicted | error |\n|---|---|---|---|---|---|")
    errors = []
    for rid, method, counter, measured, predicted in rows:
        e = predicted / measured - 1
        errors.append(abs(e))
        print(f"| {rid} | {method} | {counter} | {measured / 2**30:.1f} GiB | {predicted / 2**30:.1f} GiB | {e:+.0%} |")
    within = sum(e <= 0.10 for e in errors)
    print(f"\n{len(rows)} rows: mean |error| {sum(errors) / len(errors):.0%}, max {max(errors):.0%}, within 10%: {within}")
    print(f"\nno case ({len(skipped)}): " + ", ".join(skipped))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
