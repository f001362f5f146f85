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
    "fms_mistral7b_lora_r16_bs2x2_fsdp_a100_80g": "-10.3%: 1.4 GiB of rank 0's allocated peak under FSDP1 with LoRA adapters "
                                                  "is not identified (the same model and LoRA on one GPU, the bs4 and bs8 "
                                                  "rows, are -5% and -7%); it was -7% while the loss head was "
                                                  "over-counted at 14 bytes a logit",
    "peft_llama2_70b_lora_fsdp_8xh100": "an nvidia-smi screenshot at 90-98% of the device: FSDP1's caching-allocator "
                                        "reserve (fragmentation across its all-gather stream) is not modelled; 49 GiB "
                                        "allocated plus the largest block is what the model predicts",
}
CAPACITY_FLOOR = 0.90  # a capacity row's predicted peak is at least this share of the device
# No capacity row is predicted over its device since the loss head is counted as torch holds it
# (12 bytes a logit for the Trainer, tests/cost/test_loss_head_bytes.py; it was 14).
KNOWN_OVER_CAPACITY: dict[str, tuple[float, str]] = {}  # row -> (the most the predicted peak may exceed the device, cause)
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
    # lora: the two single-GPU rows (the FSDP row and the 70B screenshot are listed misses);
    # qlora: the four allocated / reserved rows and both capacity rows
    assert within.get("lora", 0) >= 2 and within.get("qlora", 0) >= 6, within
    assert set(KNOWN_MISSES) | set(KNOWN_OVER_CAPACITY) <= {r[0] for r in ROWS}
