"""--grad-reduce-dtype (Megatron-Core's grad_reduce_in_fp32, --grad-reduce-in-bf16): the main
gradients each parameter keeps and data parallelism reduces, in fp32 by default under --bf16 and
in bf16 where the recipe says so (NVIDIA's performance recipes; knowledge/stacks/megatron.yaml)."""

from __future__ import annotations

import pytest

from shardplan.cost.inputs import training_workload
from shardplan.cost.memory_training import state_bytes
from shardplan.cost.params import count_params
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import stack_rules
from shardplan.specs.loading import load_model

ARGS = ["llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "8", "--workload", "training", "--seq-len", "8192",
        "--global-batch-size", "128", "--stack", "megatron"]
PINS = ["--tp", "1", "--cp", "2", "--dp", "4", "--zero-stage", "1", "--micro-batch-size", "1", "--recompute", "none"]


def _workload(grads: str | None, stack: str = "megatron", finetune: str = "full"):
    return training_workload(seq_len=4096, global_batch_size=64, optimizer="adamw", framework=None,
                             flash_attention=None, dropout=False, stack=stack_rules(stack), finetune=finetune,
                             grad_reduce_dtype=grads)


def test_megatron_main_gradients_take_two_bytes_in_bf16_and_four_by_default():
    assert state_bytes(_workload(None), 1).gradients == 4.0
    assert state_bytes(_workload("fp32"), 1).gradients == 4.0
    assert state_bytes(_workload("bf16"), 1).gradients == 2.0
    # the optimizer's own states do not move
    assert state_bytes(_workload("bf16"), 1).optimizer == state_bytes(_workload(None), 1).optimizer


def test_estimate_holds_every_parameter_gradient_in_two_bytes_and_reduces_half_the_bytes(cli):
    got = {}
    for grads in ("fp32", "bf16"):
        res = cli("estimate", *ARGS, *PINS, "--grad-reduce-dtype", grads, "--json")
        assert res.exit_code == 0, res.stderr
        got[grads] = res.json()
    n = count_params(load_model("llama-3.1-8b").spec).total  # one stage, no tp: every parameter's gradient
    assert got["bf16"]["memory"]["per_gpu_bytes"]["gradients"] == pytest.approx(2 * n, rel=1e-9)
    assert got["fp32"]["memory"]["per_gpu_bytes"]["gradients"] == pytest.approx(4 * n, rel=1e-9)
    assert got["bf16"]["workload"]["grad_reduce_dtype"] == "bf16"
    dp = {g: got[g]["time"]["breakdown"]["data_parallel"] for g in got}
    assert 0.45 < dp["bf16"] / dp["fp32"] < 0.75  # half the bytes, the same latency terms


def test_bf16_gradients_make_nvidias_8b_recipe_fit_at_the_band_edge(cli):
    """Llama 3 8B on 8 H100s, tp 1 cp 2 (NeMo's H100 BF16 recipe): 78.9 GiB reserved with fp32 main
    gradients, tight at Megatron's +20% memory band; 15 GiB less with bf16 ones, which fits there."""
    verdicts = {}
    for grads in ("fp32", "bf16"):
        res = cli("estimate", *ARGS, *PINS, "--grad-reduce-dtype", grads, "--json")
        verdicts[grads] = res.json()["fit_at_band_edge"]["verdict"]
    assert verdicts == {"fp32": "tight", "bf16": "fits"}


@pytest.mark.parametrize("stack, finetune, words", [
    ("torchtitan", "full", "offers no bf16 main gradients"),
    ("megatron", "lora", "applies to full training"),
])
def test_a_stack_without_the_choice_refuses_it(stack, finetune, words):
    with pytest.raises(ShardplanError, match=words) as e:
        _workload("bf16", stack=stack, finetune=finetune)
    assert e.value.field == "--grad-reduce-dtype"


def test_bad_values_are_one_line_errors(cli):
    for args in (["--grad-reduce-dtype", "fp16", "--stack", "megatron"], ["--grad-reduce-dtype", "bf16", "--stack", "hf"]):
        res = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", *args)
        assert res.exit_code == 2
        assert "--grad-reduce-dtype" in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_megatrons_fp32_optimizer_copies_bf16_gradients_at_the_step():
    """Megatron-Core's fp32 optimizer copies the main gradients it steps to fp32 (optimizer.py
    _copy_model_grads_to_main_grads, core_v0.19.0): under ZeRO 0 with full recomputation the step is
    the peak and bf16 gradients cost more than fp32 ones (2 + 4 bytes a parameter against 4); the
    precision-aware optimizer (bf16 moments) reads them as they are."""
    from shardplan.cost.layout import Layout, Recompute
    from shardplan.cost.memory_training import training_memory
    from shardplan.specs.cluster import cluster
    from shardplan.specs.loading import load_hardware

    spec = load_model("llama-3.1-8b").spec
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=8, nodes=None, gpus_per_node=None)
    layout = Layout(tp=8, zero_stage=0, recompute=Recompute.FULL, micro_batch_size=1)

    def peak(grads: str, moments: str | None = None) -> tuple[float, dict]:
        wl = training_workload(seq_len=2048, global_batch_size=64, optimizer="adamw", framework=None,
                               flash_attention=None, dropout=False, stack=stack_rules("megatron"), spec=spec,
                               grad_reduce_dtype=grads, moment_dtype=moments)
        r = training_memory(spec, hw, layout, wl).ranks[0]
        return r.reserved_bytes, r.detail

    from shardplan.cost.memory_training import _common, optimizer_step_bytes

    fp32, _ = peak("fp32")
    bf16, detail = peak("bf16")
    wl = training_workload(seq_len=2048, global_batch_size=64, optimizer="adamw", framework=None, flash_attention=None,
                           dropout=False, stack=stack_rules("megatron"), spec=spec, grad_reduce_dtype="bf16")
    step = optimizer_step_bytes(spec, layout, wl, _common(hw, layout, wl), 0, list(range(spec.num_layers)))
    # every parameter of the rank's tp shard at ZeRO 0 (the vocabulary and the layers split 8 ways; the
    # norms whole), 4 bytes each
    assert step == pytest.approx(4 * count_params(spec).total / 8, rel=0.01)
    copy = detail["temporary.optimizer_step_fp32_gradients"]  # what the step adds beyond the freed activations
    assert 0 < copy <= step and bf16 > fp32
    aware, detail_aware = peak("bf16", "bf16")
    assert "temporary.optimizer_step_fp32_gradients" not in detail_aware and aware < bf16
