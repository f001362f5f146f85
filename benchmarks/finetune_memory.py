"""Published LoRA / QLoRA peak memory (shardplan/validation/corpus/finetune/lora_memory.yaml)
against shardplan.

Every row with a `case:` block is costed as the row ran (model, GPU, GPU count, ZeRO-3/FSDP
sharding, micro-batch, sequence, recompute, stack, adapter rank and targets, NF4 with or without
double quantization) and compared by the counter the source printed:

  allocated  torch.cuda.max_memory_allocated: the predicted total less the CUDA context, the
             non-torch memory and NCCL's buffers, which PyTorch's allocator never sees;
  reserved   nvidia-smi: the predicted reserved peak (allocated + the block for the largest tensor)
             with the context;
  capacity   the longest sequence that fits on the device: the predicted reserved peak at that
             sequence against the device's memory.

The rows are read and predicted by `shardplan.validation` (the code behind `shardplan validate`).
Rows without a case (other stacks: torchtune, LitGPT; families shardplan does not read) are listed.

    python benchmarks/finetune_memory.py
"""

from __future__ import annotations

from shardplan.specs.loading import read_structured
from shardplan.validation.predict import compare
from shardplan.validation.shipped import CORPUS_DIR, finetune_cases

DATA = CORPUS_DIR / "finetune" / "lora_memory.yaml"


def evaluate(rows: list[dict] | None = None) -> tuple[list[tuple[str, str, str, float, float]], list[str]]:
    """(id, method, counter, measured bytes, predicted bytes) per row with a case, and the ids of
    the rows without one. `rows`: ignored, the shipped file is read (kept for callers)."""
    cases, skipped = finetune_cases(CORPUS_DIR)
    out = []
    for case in cases:
        (c,) = compare(case, CORPUS_DIR)
        out.append((case.id, case.finetune, case.counter, c.measured, c.predicted))
    return out, [s.id for s in skipped]


def main() -> int:
    rows, skipped = evaluate(read_structured(DATA)["rows"])
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
