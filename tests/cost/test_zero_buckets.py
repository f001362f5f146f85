"""DeepSpeed ZeRO's contiguous gradient bucket: every rank keeps reduce_bucket_size elements of
the 16-bit gradients whole, whatever the model's size (deepspeed/runtime/zero/stage_1_and_2.py
setup_buckets: one buffer, a second with overlap_comm; stage3.py: one at initialisation), and
none at stage 0. Counted as `temporary.zero_reduce_buckets` under --stack deepspeed only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout
from shardplan.cost.memory_training import zero_reduce_bucket_bytes
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import stack_rules
from shardplan.specs.loading import load_model
from shardplan.units import DType

SPEC = load_model("llama-3.1-8b").spec


def _wl(stack: str = "deepspeed", **kw):  # type: ignore[no-untyped-def]
    return training_workload(seq_len=4096, global_batch_size=64, optimizer="adamw", framework=None,
                             flash_attention=None, dropout=False, stack=stack_rules(stack), spec=SPEC, **kw)


def test_deepspeeds_default_bucket_by_stage_and_overlap():
    wl = _wl()
    assert wl.zero_reduce_bucket_elements == 500_000_000  # DeepSpeed's reduce_bucket_size default
    bf16 = 2
    assert zero_reduce_bucket_bytes(Layout(dp=8, zero_stage=0), wl) == 0.0
    for stage in (1, 2):
        assert zero_reduce_bucket_bytes(Layout(dp=8, zero_stage=stage), wl) == 2 * 500_000_000 * bf16
        no_overlap = replace(wl, overlap_grad_reduce=False)
        assert zero_reduce_bucket_bytes(Layout(dp=8, zero_stage=stage), no_overlap) == 500_000_000 * bf16
    assert zero_reduce_bucket_bytes(Layout(dp=8, zero_stage=3), wl) == 500_000_000 * bf16
    fp16 = replace(wl, param_dtype=DType.FP16)
    assert zero_reduce_bucket_bytes(Layout(dp=8, zero_stage=3), fp16) == 500_000_000 * 2


def test_auto_is_hidden_squared_and_other_stacks_keep_none():
    assert _wl(reduce_bucket_size="auto").zero_reduce_bucket_elements == 4096 * 4096
    assert _wl(reduce_bucket_size="2e8").zero_reduce_bucket_elements == 200_000_000
    titan = _wl("torchtitan")
    assert titan.zero_reduce_bucket_elements == 0
    assert zero_reduce_bucket_bytes(Layout(dp=8, zero_stage=3), titan) == 0.0
    with pytest.raises(ShardplanError, match="DeepSpeed"):
        _wl("torchtitan", reduce_bucket_size="2e8")
    for bad in ("0", "-5", "1.5", "nan", "1e12", "lots"):
        with pytest.raises(ShardplanError, match="whole number"):
            _wl(reduce_bucket_size=bad)


def test_the_estimate_names_the_bucket_and_the_cli_refuses_a_bad_size(cli):
    args = ("estimate", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "8", "--workload", "training",
            "--stack", "deepspeed", "--zero-stage", "2", "--recompute", "full", "--seq-len", "4096", "--global-batch-size", "64",
            "--json")
    base = cli(*args)
    assert base.exit_code == 0
    rank = base.json()["memory"]["per_rank"][0]
    assert rank["detail_bytes"]["temporary.zero_reduce_buckets"] == 2 * 500_000_000 * 2
    smaller = cli(*args, "--reduce-bucket-size", "auto")
    assert smaller.json()["memory"]["per_gpu_bytes"]["total"] == pytest.approx(
        base.json()["memory"]["per_gpu_bytes"]["total"] - 2 * (500_000_000 - 4096 * 4096) * 2)
    bad = cli(*args, "--reduce-bucket-size", "2x")
    assert bad.exit_code == 2 and "--reduce-bucket-size" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
