"""LoRA and QLoRA peak memory against published measurements (shardplan/validation/corpus/finetune/lora_memory.yaml):
every row with a case is costed as `benchmarks/finetune_memory.py` does and must come within 10%
of what the source printed, except the misses listed with the mechanism they lack. A listed
miss that comes within 10% fails too, so the list stays true."""

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
ROWS, _ = bench.evaluate(yaml.safe_load(bench.DATA.read_text())["rows"])


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_finetune_peak_memory_within_ten_percent(row):
    rid, _method, _counter, measured, predicted = row
    error = predicted / measured - 1
    if rid in KNOWN_MISSES:
        assert abs(error) > TOLERANCE, f"{rid} is now within 10% ({error:+.1%}): remove it from KNOWN_MISSES"
    else:
        assert abs(error) <= TOLERANCE, f"{rid}: {error:+.1%}"


def test_enough_lora_and_qlora_rows_hold():
    within: dict[str, int] = {}
    for _rid, method, _counter, measured, predicted in ROWS:
        if abs(predicted / measured - 1) <= TOLERANCE:
            within[method] = within.get(method, 0) + 1
    assert within.get("lora", 0) >= 3 and within.get("qlora", 0) >= 6, within
    assert set(KNOWN_MISSES) <= {r[0] for r in ROWS}
