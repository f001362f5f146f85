"""The optimizer's own copies in bf16 (--master-dtype, --moment-dtype): DeepSpeed's
bf16_master_weights_and_grads and bf16_optimizer_states, Megatron's precision-aware optimizer;
bytes a parameter against the sources, what each stack offers, the target rules and the CLI."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost.memory_training import state_bytes
from shardplan.cost.workload import Framework, TrainingWorkload
from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK
from shardplan.units import DType

BF16 = dict(master_dtype=DType.BF16, moment_dtype=DType.BF16)


def _per_param(wl: TrainingWorkload, zero_stage: int) -> float:
    sb = state_bytes(wl, zero_stage)
    return sb.weights + sb.gradients + sb.optimizer


def test_deepspeed_zero3_keeps_18_bytes_a_parameter_and_10_with_bf16_master_and_moments():
    """DeepSpeedExamples training/bf16_master_weight/README.md at 516082c6 (PR #994's first commit),
    'Memory Breakdown': 2 (bf16 params) + 4 master + 4 gradients + 4 + 4 Adam = 18N, and 10N with
    the master, gradients and moments in bf16. (The merged README, 6a3d817a, counts 20N/12N with
    the 16-bit gradients apart; under ZeRO-3 DeepSpeed reduce-scatters them straight into the
    partition, and the example's allocated memory after a step, 25.74 and 16.17 GiB for 6.86B
    parameters over 4 GPUs, is 16.1 and 10.1 bytes a parameter: the partition's 4 or 2 come and go
    with each step, the table's peak holds them.)"""
    wl = TrainingWorkload(framework=Framework.DEEPSPEED)
    assert _per_param(wl, 3) == 18
    assert _per_param(replace(wl, **BF16), 3) == 10
    # ZeRO-1/2 keep the 16-bit gradients apart as well: 2 more either way
    assert _per_param(wl, 2) - _per_param(replace(wl, **BF16), 2) == 8


def test_megatron_bf16_moments_keep_the_fp32_master_as_a_16_bit_remainder():
    """Megatron's precision-aware optimizer (Transformer Engine FusedAdam, store_param_remainders
    on by default): bf16 exp_avg and exp_avg_sq (2 + 2) and the fp32 master as the bf16 weight plus
    an int16 remainder (2), beside the bf16 weight and fp32 main gradient: 2 + 4 + 6 = 12 bytes
    where the default keeps 2 + 4 + 12 = 18 (megatron/core/optimizer/distrib_optimizer.py)."""
    wl = TrainingWorkload(framework=Framework.MEGATRON)
    assert _per_param(wl, 1) == 18
    assert _per_param(replace(wl, moment_dtype=DType.BF16), 1) == 12


def test_fp32_weights_are_their_own_master_whatever_the_master_dtype():
    wl = TrainingWorkload(param_dtype=DType.FP32, moment_dtype=DType.BF16)
    assert state_bytes(wl, 3).optimizer == 4  # the two moments in bf16, no master apart


def _optimizer_bytes(cli, *extra: str) -> tuple[int, dict]:
    res = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--zero-stage", "3",
              "--seq-len", "2048", "--global-batch-size", "64", "--json", *extra)
    return res.exit_code, (res.json() if res.exit_code == EXIT_OK else {"stderr": res.stderr})


def test_estimate_with_deepspeed_bf16_states_halves_the_optimizer_and_records_the_dtypes(cli):
    code, plain = _optimizer_bytes(cli, "--stack", "deepspeed")
    assert code == EXIT_OK
    code, low = _optimizer_bytes(cli, "--stack", "deepspeed", "--master-dtype", "bf16", "--moment-dtype", "bf16")
    assert code == EXIT_OK
    opt = lambda d: d["memory"]["per_gpu_bytes"]["optimizer_states"]  # noqa: E731
    # master + moments + the gradient partition: 4 + 8 + 4 = 16 -> 2 + 4 + 2 = 8 bytes a parameter
    assert opt(low) == pytest.approx(opt(plain) / 2, rel=1e-9)
    assert low["workload"]["master_dtype"] == "bf16" and low["workload"]["moment_dtype"] == "bf16"
    assert plain["workload"]["master_dtype"] == "fp32"


@pytest.mark.parametrize("stack,extra,field", [
    ("torchtitan", ("--master-dtype", "bf16"), "--master-dtype"),
    ("hf", ("--moment-dtype", "bf16"), "--moment-dtype"),
    ("megatron", ("--master-dtype", "bf16"), "--master-dtype"),
    ("deepspeed", ("--moment-dtype", "bf16", "--finetune", "lora"), "--moment-dtype"),
    ("deepspeed", ("--master-dtype", "fp16"), "--master-dtype"),
])
def test_a_dtype_the_stack_does_not_keep_is_refused_in_one_line(cli, stack, extra, field):
    res = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--stack", stack, *extra)
    assert res.exit_code == EXIT_BAD_INPUT
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and field in line and "Traceback" not in line


def test_megatron_takes_bf16_moments_and_exports_the_precision_aware_optimizer(cli, tmp_path):
    plan = tmp_path / "plan.yaml"
    res = cli("recommend", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--stack", "megatron",
              "--moment-dtype", "bf16", "--seq-len", "2048", "--global-batch-size", "64", "-o", str(plan), "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    out = tmp_path / "out"
    res = cli("export", str(plan), "--to", "megatron", "-o", str(out))
    assert res.exit_code == EXIT_OK, res.stderr
    text = " ".join(p.read_text() for p in out.rglob("*.sh"))
    for flag in ("--use-precision-aware-optimizer", "--exp-avg-dtype bf16", "--exp-avg-sq-dtype bf16"):
        assert flag in text


def test_deepspeed_bf16_master_search_keeps_to_zero_1_to_3(cli):
    """DeepSpeed accepts bf16_master_weights_and_grads under ZeRO 1-3 only (runtime/config.py)."""
    res = cli("recommend", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--stack", "deepspeed",
              "--master-dtype", "bf16", "--moment-dtype", "bf16", "--zero-stage", "0", "--seq-len", "2048",
              "--global-batch-size", "64", "--json")
    # pinned to ZeRO 0 nothing DeepSpeed runs is left
    assert res.exit_code != EXIT_OK
    res = cli("recommend", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--stack", "deepspeed",
              "--master-dtype", "bf16", "--moment-dtype", "bf16", "--seq-len", "2048", "--global-batch-size", "64",
              "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    top = res.json()["top"]
    assert top and all(e["plan"]["zero_stage"] >= 1 for e in top)
