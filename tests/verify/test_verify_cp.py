"""`shardplan verify` with context parallelism: the load-balanced sequence split, the all-gather
K/V attention against torch's kernels in one process, and real runs (gloo, torchrun) of cp
alone, with tensor parallelism and with ZeRO-3 over dp x cp."""

from __future__ import annotations

import pytest

from shardplan.cost.workload import TrainingWorkload
from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK
from test_verify import TRAIN, _assert_matches, _plan, _verify

# An all-gather attention that kept the gathered K/V for backward measured +50% activations on
# the cp=2 debug proxy; the one that re-gathers in backward (TransformerEngine's) measured +0.1%.
CP_ACTIVATION_TOLERANCE = 0.05


@pytest.mark.parametrize("seq_len,cp", [(8, 2), (64, 2), (48, 3), (64, 4)])
def test_head_tail_split_is_torchs_load_balancer(seq_len, cp):
    import torch
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from shardplan.verify.context import token_positions

    ours = torch.cat([token_positions(seq_len, r, cp) for r in range(cp)])
    theirs = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0].long()
    assert torch.equal(ours, theirs)
    assert sorted(ours.tolist()) == list(range(seq_len))


@pytest.mark.parametrize("causal,q_len,k_len", [(True, 8, 8), (False, 8, 24)])
def test_math_blocks_match_the_cpu_flash_kernel(causal, q_len, k_len):
    """The plain-op fallback (devices without a callable fp32 flash kernel) gives the CPU flash
    kernel's output, log-sum-exp and gradients, GQA included."""
    import torch

    from shardplan.verify import context

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, q_len, 8, 16, generator=g).transpose(1, 2)  # (b, heads, s, d) views, as the model passes them
    k, v = (torch.randn(2, k_len, 2, 16, generator=g).transpose(1, 2) for _ in range(2))
    dout = torch.randn(2, 8, q_len, 16, generator=g)
    out, lse = context._flash_forward(q, k, v, causal=causal)
    m_out, m_lse = context._math_forward(q, k, v, causal)
    torch.testing.assert_close(m_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m_lse, lse, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(context._math_backward(dout, q, k, v, out, lse, causal),
                            context._flash_backward(dout, q, k, v, out, lse, causal=causal)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_all_gather_attention_on_one_rank_is_causal_sdpa(tmp_path):
    """cp=1 still splits the sequence into a head and a tail chunk: the tail's queries attend to
    the head (a full block) and to themselves (a causal block), merged by log-sum-exp."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardplan.verify import context

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(1)
        q = torch.randn(2, 32, 8, 16, generator=g).requires_grad_()
        k, v = (torch.randn(2, 32, 4, 16, generator=g).requires_grad_() for _ in range(2))
        dout = torch.randn(2, 32, 8, 16, generator=g)
        ours = context.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dist.group.WORLD)
        grads = torch.autograd.grad(ours.transpose(1, 2), (q, k, v), dout)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        ref_grads = torch.autograd.grad(ref.transpose(1, 2), (q, k, v), dout)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        dist.destroy_process_group()


# ----- real runs (gloo, several processes) ---------------------------------------------------

def _activation_errors(report: dict) -> list[float]:
    return [c["relative_error"] for r in report["ranks"] for c in r["components"] if c["component"] == "activations"]


@pytest.mark.dist
def test_context_parallel_training_two_ranks(cli, tmp_path):
    res, report = _verify(cli, _plan(tmp_path, 2, TRAIN, cp=2), tmp_path)
    assert res.exit_code == EXIT_OK, res.stderr
    _assert_matches(report, 2, training=True)
    assert {(r["cp"], r["tp"], r["dp"]) for r in report["ranks"]} == {(0, 0, 0), (1, 0, 0)}
    assert all(abs(e) <= CP_ACTIVATION_TOLERANCE for e in _activation_errors(report)), _activation_errors(report)
    assert report["run"]["work"]["seq_len"] % 4 == 0


@pytest.mark.dist
@pytest.mark.parametrize("layout", [dict(cp=2, tp=2), dict(cp=2, dp=2, zero_stage=3)], ids=["cp2xtp2", "cp2xdp2-zero3"])
def test_context_parallel_combined_four_ranks(cli, tmp_path, layout):
    """tp fastest, then cp: ranks (tp, cp) = (0,0), (1,0), (0,1), (1,1). ZeRO-3 shards over dp x cp
    (torchtitan's dp_shard_cp): each rank holds a quarter of the model."""
    res, report = _verify(cli, _plan(tmp_path, 4, TRAIN, **layout), tmp_path)
    assert res.exit_code == EXIT_OK, res.stderr
    _assert_matches(report, 4, training=True)
    assert all(abs(e) <= CP_ACTIVATION_TOLERANCE for e in _activation_errors(report)), _activation_errors(report)
    if "tp" in layout:
        assert [(r["tp"], r["cp"]) for r in sorted(report["ranks"], key=lambda r: r["rank"])] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    else:
        from shardplan.plan import manifest as mf
        from shardplan.cost.params import count_params
        from shardplan.plan.readback import plan_spec
        from shardplan.verify.runspec import plan_run

        m = mf.load_manifest(tmp_path / "plan.yaml")
        run = plan_run(m, plan_spec(m), scale="proxy")
        for r in report["ranks"]:
            weights = next(c for c in r["components"] if c["component"] == "weights")["measured_bytes"]
            assert weights == pytest.approx(count_params(run.spec).total * 2 / 4, rel=0.02)  # bf16, a quarter


def test_a_sequence_too_short_for_head_and_tail_chunks_is_refused(cli, tmp_path):
    res = cli("verify", str(_plan(tmp_path, 2, TrainingWorkload(seq_len=2, global_batch_size=8), cp=2)))
    assert res.exit_code == EXIT_BAD_INPUT
    assert "layout.cp" in res.stderr and "4 equal chunks" in res.stderr and "Traceback" not in res.stderr
