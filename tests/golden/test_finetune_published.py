"""LoRA and QLoRA peak memory against published measurements (shardplan/validation/corpus/finetune/lora_memory.yaml):
every row with a case is costed as `benchmarks/finetune_memory.py` does and must come within 10%
of what the source printed, except the misses listed with the mechanism they lack. A listed
miss that comes within 10% fails too, so the list stays true.

A `capacity` row is one-sided: the run filled the device and fit, so the predicted reserved peak
at that length must be at most the device's memory, and above 90% of it (the source's length is
the longest that fit). Capacity rows predicted over the device are listed with their cause and
the most they may be over, so they cannot silently get worse."""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from conftest import REPO

_spec = importlib.util.spec_from_file_location("finetune_benchmark", REPO / "benchmarks" / "finetune_memory.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

TOLERANCE = 0.10
KNOWN_MISSES = {
    "peft_llama2_70b_lora_fsdp_8xh100": "an nvidia-smi screenshot at 90-98% of the device: FSDP1's caching-allocator "
                                        "reserve (fragmentation across its all-gather stream) is not modelled; 49 GiB "
                                        "allocated plus the largest block is what the model predicts",
}
CAPACITY_FLOOR = 0.90  # a capacity row's predicted peak is at least this share of the device
_LOSS_HEAD = ("the HF stack's loss head: 14 bytes a logit (knowledge/stacks/hf.yaml) and a fresh block for the "
              "fp32 logits. A ForCausalLMLoss that copies the shifted fp32 logits (logits[..., :-1, :].contiguous(), "
              "older transformers) peaks near 14 in forward; one that pads the labels instead (transformers 5 "
              "loss/loss_utils.py), with the Trainer dropping the model's bf16 logits before backward, at 12 "
              "(saved log_softmax output, its gradient, the input gradient). The source gives no transformers version")
KNOWN_OVER_CAPACITY = {  # row -> (the most the predicted reserved peak may exceed the device, cause)
    # 28,454 tokens x 128,256 vocabulary: the loss head is 61 of the 84.7 GiB; 2 bytes a logit is 6.8 GiB
    "unsloth_hf_fa2_llama31_8b_qlora_maxctx_80g": (0.08, _LOSS_HEAD),
    # 6,916 tokens: 2 bytes a logit is 1.7 GiB, 79.9 GiB predicted against 79.15 GiB
    "unsloth_hf_fa2_llama33_70b_qlora_maxctx_a100_80g": (0.02, _LOSS_HEAD),
}
ROWS, _ = bench.evaluate(yaml.safe_load(bench.DATA.read_text())["rows"])


def _holds(counter: str, measured: float, predicted: float) -> bool:
    if counter == "capacity":
        return CAPACITY_FLOOR * measured <= predicted <= measured
    return abs(predicted / measured - 1) <= TOLERANCE


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_finetune_peak_memory_within_ten_percent(row):
    rid, _method, counter, measured, predicted = row
    error = predicted / measured - 1
    if rid in KNOWN_OVER_CAPACITY:
        most, _cause = KNOWN_OVER_CAPACITY[rid]
        assert counter == "capacity"
        assert error > 0, f"{rid} now fits its device ({error:+.1%}): remove it from KNOWN_OVER_CAPACITY"
        assert error <= most, f"{rid} is {error:+.1%} over its device, more than the {most:.0%} listed"
    elif rid in KNOWN_MISSES:
        assert not _holds(counter, measured, predicted), f"{rid} now holds ({error:+.1%}): remove it from KNOWN_MISSES"
    elif counter == "capacity":
        assert CAPACITY_FLOOR <= predicted / measured <= 1.0, f"{rid}: {error:+.1%} of the device it filled"
    else:
        assert abs(error) <= TOLERANCE, f"{rid}: {error:+.1%}"


def test_enough_lora_and_qlora_rows_hold():
    within: dict[str, int] = {}
    for _rid, method, counter, measured, predicted in ROWS:
        if _holds(counter, measured, predicted):
            within[method] = within.get(method, 0) + 1
    # qlora: the four allocated / reserved rows; both capacity rows are listed over their device
    assert within.get("lora", 0) >= 3 and within.get("qlora", 0) >= 4, within
    assert set(KNOWN_MISSES) | set(KNOWN_OVER_CAPACITY) <= {r[0] for r in ROWS}
