"""The optimizer step's own memory: torch's foreach AdamW allocates one list the size of the
parameters it steps (measured here on CPU), a fused one none; a stack that runs the foreach one
(the Hugging Face Trainer's adamw_torch) peaks at the step when that list outweighs the
activations the backward freed (fms-acceleration's Mistral-7B runs)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, Recompute
from shardplan.cost.memory_training import training_memory
from shardplan.cost.params import count_params
from shardplan.knowledge.load import stack_rules
from shardplan.search.space import topology
from shardplan.specs.loading import load_hardware, load_model


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("foreach,expected", [(True, 1.0), (False, 0.0)], ids=["foreach", "fused"])
def test_torch_adamw_step_allocates_one_list_of_the_stepped_parameters(dtype_name, foreach, expected):
    import torch

    from shardplan.verify.measure import StorageTracker

    dtype = getattr(torch, dtype_name)
    params = [torch.nn.Parameter(torch.randn(256, 512, dtype=dtype)) for _ in range(6)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach, fused=not foreach)
    opt.step()  # the states exist from here on
    tracker = StorageTracker()
    with tracker:
        opt.step()
    stepped = sum(p.numel() * p.element_size() for p in params)
    assert tracker.peak_total / stepped == pytest.approx(expected, abs=0.01)


def _mistral(gpus: int, master: str | None, micro_batch: int):
    spec = load_model("mistral-7b").spec
    hw = topology(load_hardware("a100-sxm-80gb"), gpus)
    wl = training_workload(seq_len=4096, global_batch_size=micro_batch * gpus, optimizer="adamw", framework=None,
                           flash_attention=None, dropout=False, stack=stack_rules("hf"), spec=spec,
                           master_dtype=master, moment_dtype=master)
    layout = Layout(dp=gpus, zero_stage=3 if gpus > 1 else 0, micro_batch_size=micro_batch, recompute=Recompute.FULL)
    return spec, training_memory(spec, hw, layout, wl)


def test_pure_bf16_on_one_gpu_peaks_at_the_step():
    """Mistral-7B, bf16-loaded, no AMP, one A100, micro-batch 4 x 4096 with checkpointing: the
    Trainer's memory tracker read 72,434,837,504 bytes at micro-batch 4 and 8 alike
    (fms-acceleration scripts/benchmarks/refs/a100_80gb.csv at 24bdadb2, lines 10 and 12): bf16
    weights, gradients and two moments (8 bytes a parameter) and the step's bf16 list (2)."""
    spec, tm = _mistral(1, "bf16", 4)
    rank = tm.ranks[0]
    n = count_params(spec).total
    b = rank.breakdown
    assert (b.weights, b.gradients, b.optimizer_states) == (2 * n, 2 * n, 4 * n)
    assert b.total - b.overhead == pytest.approx(10 * n, rel=1e-9)  # the step's list replaces the activations
    assert b.activations + b.temporary == pytest.approx(2 * n, rel=1e-9)  # the list: 2 bytes a parameter
    assert b.total - b.overhead == pytest.approx(72_434_837_504, rel=0.02)


def test_an_fp32_step_list_under_fsdp_is_the_rank_shard():
    """The same model under FSDP over 2 GPUs with AMP (fp32 sharded parameters): 16 bytes a
    parameter of states and a 4-byte list, per rank's half: 72,434,657,280 bytes measured
    (a100_80gb.csv at 4e81c644, line 11), the same as one GPU in pure bf16."""
    spec, tm = _mistral(2, None, 2)
    n = count_params(spec).total
    b = tm.ranks[0].breakdown
    step_phase = b.weights + b.gradients + b.optimizer_states + 4 * n / 2
    assert b.total - b.overhead >= step_phase * (1 - 1e-9)
    assert step_phase == pytest.approx(72_434_657_280, rel=0.02)


def test_optimizer_impl_fused_has_no_step_list_and_8bit_adamw_none_either(cli):
    """--optimizer-impl fused (the Trainer's adamw_torch_fused, its default from torch 2.8) keeps
    the backward's peak; bitsandbytes' 8-bit AdamW runs its own kernel, with no list either."""
    args = ("estimate", "mistral-7b", "-H", "a100-sxm-80gb", "--gpus", "1", "--workload", "training", "--stack", "hf",
            "--master-dtype", "bf16", "--moment-dtype", "bf16", "--seq-len", "4096", "--global-batch-size", "4",
            "--micro-batch-size", "4", "--recompute", "full", "--json")
    n = count_params(load_model("mistral-7b").spec).total
    per_gpu = {}
    for impl in ("foreach", "fused"):
        res = cli(*args, "--optimizer-impl", impl)
        assert res.exit_code == 0, res.stderr
        per_gpu[impl] = res.json()["memory"]["per_gpu_bytes"]
        assert res.json()["workload"]["optimizer_foreach"] is (impl == "foreach")
    fused, foreach = per_gpu["fused"], per_gpu["foreach"]
    assert foreach["activations"] + foreach["temporary"] == pytest.approx(2 * n, rel=1e-9)  # the list
    assert fused["total"] == pytest.approx(foreach["total"] - 2 * n + fused["activations"] + fused["temporary"], rel=1e-9)
    spec, tm = _mistral(1, "bf16", 4)
    wl8 = training_workload(seq_len=4096, global_batch_size=4, optimizer="adamw8bit", framework=None,
                            flash_attention=None, dropout=False, stack=stack_rules("hf"), spec=spec)
    assert wl8.optimizer_foreach
    hw = topology(load_hardware("a100-sxm-80gb"), 1)
    layout = Layout(micro_batch_size=4, recompute=Recompute.FULL)
    with_flag = training_memory(spec, hw, layout, wl8).ranks[0].breakdown
    without = training_memory(spec, hw, layout, replace(wl8, optimizer_foreach=False)).ranks[0].breakdown
    assert with_flag == without  # no list for the 8-bit optimizer, whatever the stack's AdamW does
