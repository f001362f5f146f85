"""Context parallelism (cp > 1, training): each cp rank holds two load-balanced chunks of every
sequence of the micro-batch, and attention gathers the keys and values of the whole sequence.

The sequence is cut into 2 x cp chunks and rank r holds chunks r and 2 cp - 1 - r (head and
tail), so that under the causal mask every rank does the same work: torch's
`_HeadTailLoadBalancer` (torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py),
Megatron's `get_batch_on_this_cp_rank`, TransformerEngine's `local_seq_chunk_ids`. The rank's
tokens, targets and RoPE rows are those chunks (torchtitan shards the inputs, the labels and
`freqs_cis` as context-parallel buffers).

Attention is the all-gather scheme of Llama 3 (Dubey et al. 2024, Sec. 3.3.2) as
TransformerEngine implements it (`AttnFuncWithCPAndKVAllGather`, Megatron's
`cp_comm_type="all_gather"`): the rank's K and V are all-gathered over the cp group, each of
its two query chunks attends to the keys up to its own end, and backward all-gathers K and V
again and reduce-scatters their gradients. Backward keeps the rank's own q, k, v, the output
and the log-sum-exp, all s / cp long, not the gathered keys (as torch's ring attention, which
rotates K and V again in backward). A gathered K/V kept for backward (an autograd all-gather
before SDPA) would add 2 kv d b s (1 - 1/cp) per layer.

Why not torch's `context_parallel`: it routes SDPA through DTensor and intercepts only the
CUDA kernels (`_scaled_dot_product_flash_attention`, `_efficient_attention`,
`_cudnn_attention` and their backwards: `_sdpa_handler` and `register_cp_sharding_rules` in
_context_parallel/_attention.py and _sharding_rules.py). On CPU SDPA runs
`_scaled_dot_product_flash_attention_for_cpu`, which has neither a handler nor a DTensor
sharding rule ("does not have a sharding strategy registered", torch 2.13), and the math
backend mixes the DTensor scores with a plain causal mask. So the attention below calls the
same flash kernels directly, as the ring attention does, merging partial results by their
log-sum-exp (torch's `_SDPAMerger`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardplan.cost.layout import Layout
from shardplan.verify.runspec import CP_CHUNKS_PER_RANK as CHUNKS_PER_RANK  # head and tail

aten = torch.ops.aten


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The sequence chunks (of 2 cp) rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp - 1 - cp_rank


def token_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Positions of the rank's tokens in the sequence (int64, seq_len / cp of them)."""
    if seq_len % (CHUNKS_PER_RANK * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into {CHUNKS_PER_RANK * cp} equal chunks")
    c = seq_len // (CHUNKS_PER_RANK * cp)
    return torch.cat([torch.arange(g * c, (g + 1) * c) for g in chunk_ids(cp_rank, cp)])


def batch_group(mesh: DeviceMesh, layout: Layout) -> dist.ProcessGroup | None:
    """The ranks holding different tokens of the same model replica (dp x cp): ZeRO-0 averages
    gradients over them and the reported loss is their mean (None: only this rank)."""
    if layout.dp * layout.cp == 1:
        return None
    return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp").get_group()


def apply_cp(chunk: nn.Module, cp_mesh: DeviceMesh, positions: torch.Tensor) -> None:
    """After materialising: every attention gathers K/V over `cp_mesh`, and the RoPE cache
    holds the rows of this rank's positions (the Decoder reads rows 0 .. s_local)."""
    group = cp_mesh.get_group()
    for mod in chunk.modules():
        if hasattr(mod, "context_parallel"):
            mod.context_parallel = partial(attention, group=group)
    chunk.cos_sin = chunk.cos_sin[positions.to(chunk.cos_sin.device)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal GQA attention of this rank's queries over the whole sequence. q: (b, heads, s/cp,
    d), k and v: (b, kv_heads, s/cp, d), this rank's head and tail chunks; returns (b, heads,
    s/cp, d), a view of a (b, s/cp, heads, d) tensor as the CPU flash kernel returns."""
    return _AllGatherKVAttention.apply(q, k, v, group)


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's (b, kv, s/cp, d) share -> (b, kv, s, d) in sequence order (TE's
    `get_seq_chunk_ids_for_reordering_before_attn`)."""
    cp = dist.get_world_size(group)
    local = x.transpose(1, 2).contiguous()  # (b, s/cp, kv, d): gathered along the batch dim, sliced along seq
    buf = local.new_empty((cp * local.shape[0], *local.shape[1:]))
    dist.all_gather_single(buf, local, group=group)
    buf = buf.view(cp, *local.shape)
    c = local.shape[1] // CHUNKS_PER_RANK
    owner = {g: (r, i) for r in range(cp) for i, g in enumerate(chunk_ids(r, cp))}
    parts = [buf[r, :, i * c:(i + 1) * c] for r, i in (owner[g] for g in range(CHUNKS_PER_RANK * cp))]
    return torch.cat(parts, dim=1).transpose(1, 2)


def _reduce_scatter_sequence(full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, kv, s, d) partial gradients -> this rank's chunks of their sum over the cp group."""
    cp = dist.get_world_size(group)
    c = full.shape[2] // (CHUNKS_PER_RANK * cp)
    by_rank = [full[:, :, g * c:(g + 1) * c] for r in range(cp) for g in chunk_ids(r, cp)]
    stacked = torch.cat(by_rank, dim=2).permute(2, 0, 1, 3).contiguous()  # (s, b, kv, d), rank-major
    out = stacked.new_empty((stacked.shape[0] // cp, *stacked.shape[1:]))
    dist.reduce_scatter_single(out, stacked, group=group)
    return out.permute(1, 2, 0, 3)


class _AllGatherKVAttention(torch.autograd.Function):
    """TE's AttnFuncWithCPAndKVAllGather for (b, heads, s, d) tensors: query chunk g attends to
    keys [0, (g + 1) c), as a causal block [g c, (g + 1) c) and, for g > 0, a full block
    [0, g c), merged by log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, group):  # type: ignore[override]
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, s_local, d = q.shape
        c = s_local // CHUNKS_PER_RANK
        k_all, v_all = _gather_sequence(k, group), _gather_sequence(v, group)
        out = q.new_empty(b, s_local, h, d).transpose(1, 2)
        lse = q.new_empty(b, h, s_local, dtype=torch.float32)
        for i, g in enumerate(chunk_ids(rank, cp)):
            rows, diag = slice(i * c, (i + 1) * c), slice(g * c, (g + 1) * c)
            o, m = _flash_forward(q[:, :, rows], k_all[:, :, diag], v_all[:, :, diag], causal=True)
            if g > 0:
                o_past, m_past = _flash_forward(q[:, :, rows], k_all[:, :, :g * c], v_all[:, :, :g * c], causal=False)
                o = o - torch.sigmoid(m_past - m).unsqueeze(-1) * (o - o_past)  # torch's _SDPAMerger
                m = m - F.logsigmoid(m - m_past)
            out[:, :, rows] = o
            lse[:, :, rows] = m
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = q.shape[2] // CHUNKS_PER_RANK
        k_all, v_all = _gather_sequence(k, group), _gather_sequence(v, group)
        dq = torch.empty_like(q)
        dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
        for i, g in enumerate(chunk_ids(rank, cp)):
            rows = slice(i * c, (i + 1) * c)
            blocks = [(slice(g * c, (g + 1) * c), True)] + ([(slice(0, g * c), False)] if g > 0 else [])
            # Each block's backward with the merged output and log-sum-exp (the ring attention's backward).
            common = (dout[:, :, rows], q[:, :, rows])
            saved = (out[:, :, rows], lse[:, :, rows].contiguous())
            dq_rows = None
            for keys, causal in blocks:
                gq, gk, gv = _flash_backward(*common, k_all[:, :, keys], v_all[:, :, keys], *saved, causal=causal)
                dq_rows = gq if dq_rows is None else dq_rows + gq
                dk_all[:, :, keys] += gk
                dv_all[:, :, keys] += gv
            dq[:, :, rows] = dq_rows
        return dq, _reduce_scatter_sequence(dk_all, group), _reduce_scatter_sequence(dv_all, group), None


def _flash_forward(q, k, v, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, fp32 log-sum-exp) of one block, GQA by head groups; is_causal is top-left."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse
    return _math_forward(q, k, v, causal)


def _flash_backward(dout, q, k, v, out, lse, *, causal: bool):
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    return _math_backward(dout, q, k, v, out, lse, causal)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, h, s, d) -> (b, kv, h / kv, s, d): query head i uses KV head i // (h / kv) (SDPA's enable_gqa)."""
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)


def _scores(q, k, causal: bool) -> torch.Tensor:
    s = torch.einsum("bkgqd,bksd->bkgqs", _grouped(q, k.shape[1]), k) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash kernel's results by plain tensor ops (devices without a directly callable
    fp32 flash kernel; checked against the CPU kernel by the tests)."""
    s = _scores(q, k, causal)
    lse = s.logsumexp(-1)
    out = torch.einsum("bkgqs,bksd->bkgqd", torch.exp(s - lse.unsqueeze(-1)), v)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _math_backward(dout, q, k, v, out, lse, causal: bool):
    kv = k.shape[1]
    p = torch.exp(_scores(q, k, causal) - _grouped(lse.unsqueeze(-1), kv))
    dout_g, out_g = _grouped(dout, kv), _grouped(out, kv)
    dv = torch.einsum("bkgqs,bkgqd->bksd", p, dout_g)
    dp = torch.einsum("bkgqd,bksd->bkgqs", dout_g, v)
    ds = p * (dp - (dout_g * out_g).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    dq = torch.einsum("bkgqs,bksd->bkgqd", ds, k).reshape(q.shape)
    dk = torch.einsum("bkgqs,bkgqd->bksd", ds, _grouped(q, kv))
    return dq, dk, dv
