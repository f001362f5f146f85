"""Expert parallelism (ep > 1): each rank builds and runs only its E/ep routed experts.

Ranks. ep folds over the dp x cp x tp ranks of a pipeline stage in Megatron-core's expert
order (megatron/core/parallel_state.py, `initialize_model_parallel`, expert ranks ordered
"tp-ep-dp-pp"): expert tensor parallelism fastest, then ep, then expert data parallelism
(edp = dp x cp x tp / (ep x etp)). Expert-parallel rank r holds the experts
[r E/ep, (r + 1) E/ep), as the manifest's `placement.experts.expert_ranges` say. Each keeps
its global index in its parameter name, so `parallel.full_init` gives it the reference's
value and `parallel.split_key` still resolves the manifest's `tp_splits`.

Training is Megatron-core's all-to-all token dispatcher (megatron/core/transformer/moe/
token_dispatcher.py, `MoEAlltoAllTokenDispatcher`): route on this rank, permute the (token,
slot) rows into expert order, exchange the split sizes, all-to-all the rows to the experts'
owners, sort what arrived by local expert (moe_utils.py, `sort_chunks_by_idxs`), run every
local expert on its segment, unsort, all-to-all back, weight by the router probabilities,
un-permute and sum the k copies (moe_utils.py, `unpermute`). The all-to-alls are torch's
functional collectives with autograd (backward is the reverse all-to-all).

Gradients. Dense parameters reduce over the dp ranks as without experts. An expert's
gradient already sums the tokens of its ep group, so it reduces over the edp group and is
scaled by 1/dp, not 1/edp (megatron/core/distributed/distributed_data_parallel.py:
`expert_gradient_scaling_factor = 1 / data_parallel_world_size`). Under ZeRO >= 2 the experts
are an FSDP2 unit of their own over the edp mesh, with the gradient divide factor dp
(torchtitan models/llama4/infra/parallelize.py, `apply_fsdp`: `fully_shard(moe.experts,
mesh=<dp mod ep>)` and `set_gradient_divide_factor`); the dense rest shards over dp.

Serving is vLLM's `--enable-expert-parallel` inside one server (ep = tp, whole experts;
vllm/model_executor/layers/fused_moe/layer.py, `FusedMoE` with an `expert_map`): attention
stays tensor-parallel, the MoE input is replicated over the tp ranks, each rank runs
fused_moe over every (token, slot) row with its own experts' weights (`model.fused_moe`),
and the partial sums are all-reduced in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardplan.cost.layout import Layout
from shardplan.specs.model import ModelSpec
from shardplan.verify import parallel
from shardplan.verify.model import MLP, MoE, fused_moe, model_dtype, route, unpermute

EXPERT_SPLITS = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight", "mlp.experts.down_proj.weight")


class LocalExperts(nn.ModuleDict):
    """This rank's experts, keyed by their global index (`experts.5.up_proj.weight` as in the
    unsharded model). A module with a forward, so that FSDP2 can shard it as one unit."""

    def __init__(self, spec: ModelSpec, ids: range) -> None:
        assert spec.moe is not None
        super().__init__({str(e): MLP(spec.hidden_size, spec.moe.expert_intermediate_size) for e in ids})

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: rows sorted by local expert, `counts[i]` for the i-th. Every expert runs, on an
        empty segment too (zero gradients, as a grouped GEMM gives; see `model.MoE`)."""
        return torch.cat([expert(seg) for expert, seg in zip(self.values(), x.split(counts))])


def _sort_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Megatron-core moe_utils.sort_chunks_by_idxs: split into chunks, concatenate in `order`
    (the backward splits the gradient back; nothing is saved)."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order])


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all with autograd, waited for at once. Left as an AsyncCollectiveTensor, a split
    of it waits on views only, and torch 2.13 then keeps the whole received buffer alive
    beside its sorted copy (one more T k x hidden per layer, measured)."""
    return wait_tensor(all_to_all_single_autograd(x, out_splits, in_splits, group))


class ExpertParallelMoE(nn.Module):
    """The MoE block of one expert-parallel rank: the replicated router and E/ep experts.
    Training dispatches tokens with all-to-alls over `group`; serving (no grad) runs
    fused_moe over every row with the local experts only and leaves a partial sum, which the
    hook `ExpertParallel.apply` puts on this module all-reduces over `group` (= the tp group)."""

    def __init__(self, spec: ModelSpec, ids: range, group: dist.ProcessGroup) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.top_k = moe.num_experts_per_token
        self.num_experts = moe.num_experts
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = LocalExperts(spec, ids)
        self.group = group
        self.force_load_balance = False  # round-robin routing (model.route)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, order, counts = route(self.gate, tokens, self.top_k, self.num_experts,
                                       seq_len=shape[1] if self.force_load_balance else None)
        if not torch.is_grad_enabled():
            held = {int(e): expert for e, expert in self.experts.items()}
            return fused_moe(tokens, weights, order, counts, self.top_k, held).view(shape)
        return self._dispatch(tokens, weights, order, counts).view(shape)

    def _dispatch(self, tokens: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                  counts: list[int]) -> torch.Tensor:
        ep, n = dist.get_world_size(self.group), len(self.experts)
        # Rows per (owner, its local expert), exchanged so that every rank knows what it
        # receives per (source, local expert) (MoEAlltoAllTokenDispatcher.preprocess).
        send = torch.tensor(counts, dtype=torch.int64, device=tokens.device).view(ep, n)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        chunk_sizes = recv.flatten().tolist()  # (source, local expert), source-major
        by_expert = [src * n + e for e in range(n) for src in range(ep)]
        by_source = [e * ep + src for src in range(ep) for e in range(n)]
        # Each buffer is dropped once copied, as the fused kernels free theirs: backward keeps
        # only the grouped rows (the experts' input) and the combined outputs (the weighting's).
        permuted = tokens[order // self.top_k]
        received = _all_to_all(permuted, recv_splits, send_splits, self.group)
        del permuted
        grouped = _sort_chunks(received, chunk_sizes, by_expert)
        del received
        outputs = self.experts(grouped, recv.sum(0).tolist())
        outputs = _sort_chunks(outputs, recv.t().flatten().tolist(), by_source)
        combined = _all_to_all(outputs, send_splits, recv_splits, self.group)
        del outputs
        return unpermute(combined, weights, order, self.top_k)


@dataclass
class ExpertParallel:
    """This rank's expert-parallel groups: ep (the all-to-all, or serving's all-reduce) and
    edp (expert gradient reduction and FSDP sharding), from a (pp, edp, ep, etp) mesh."""

    layout: Layout
    mesh: DeviceMesh
    ids: range  # this rank's experts

    @classmethod
    def build(cls, device_type: str, layout: Layout, spec: ModelSpec) -> ExpertParallel:
        L = layout
        edp = L.dp * L.cp * L.tp // (L.ep * L.expert_tp)
        mesh = init_device_mesh(device_type, (L.pp, edp, L.ep, L.expert_tp), mesh_dim_names=("pp", "edp", "ep", "etp"))
        assert spec.moe is not None
        per_rank = spec.moe.num_experts // L.ep
        r = mesh["ep"].get_local_rank()
        return cls(layout=L, mesh=mesh, ids=range(r * per_rank, (r + 1) * per_rank))

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh["ep"].get_group()

    @property
    def edp_size(self) -> int:
        return self.mesh["edp"].size()

    def apply(self, chunk: nn.Module, spec: ModelSpec, *, serving: bool, force_load_balance: bool = False) -> None:
        """Replace every MoE block of `chunk` (on the meta device, before tensor parallelism
        and materialising) by this rank's expert-parallel one."""
        for block in list(chunk.modules()):
            if isinstance(getattr(block, "mlp", None), MoE):
                with torch.device("meta"):
                    block.mlp = ExpertParallelMoE(spec, self.ids, self.ep_group).to(model_dtype(spec))
                block.mlp.force_load_balance = force_load_balance
                if serving:
                    block.mlp.register_forward_hook(parallel._all_reduce_in_place(self.ep_group))

    @staticmethod
    def whole_experts(tp_splits: dict[str, str]) -> dict[str, str]:
        """The manifest's tp splits with the routed experts unsplit: under expert parallelism
        each rank holds whole experts (etp = 1), so tensor parallelism leaves them alone."""
        return tp_splits | {key: "replicated" for key in EXPERT_SPLITS if key in tp_splits}

    def sharder(self, dense_sharder):
        """FSDP2 for a block: its experts first, over the edp mesh, with the gradient divide
        factor dp (torchtitan); then the rest of the block over dp (`dense_sharder`)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        L = self.layout
        edp_mesh = self.mesh["edp"]

        def apply(module: nn.Module) -> None:
            for m in module.modules():
                if isinstance(m, LocalExperts) and not isinstance(m, FSDPModule):
                    fsdp = fully_shard(m, mesh=edp_mesh, reshard_after_forward=L.zero_stage >= 3)
                    fsdp.set_gradient_divide_factor(float(L.dp * L.cp))
                    if edp_mesh.size() > 1:
                        # gloo has no PREMUL_SUM: a plain SUM, then the divide (as parallel.fsdp_sharder).
                        # Not over one rank, where torch 2.13 would divide twice (copy / factor,
                        # then the post-divide) and no collective runs anyway.
                        fsdp.set_force_sum_reduction_for_comms(True)
            dense_sharder(module)

        return apply

    def all_reduce_grads(self, chunks: list[nn.Module], dp_group: dist.ProcessGroup) -> None:
        """ZeRO-0 (DDP's buckets without the buckets): dense gradients summed over dp, expert
        gradients over edp, both divided by dp (Megatron-core's scaling factors)."""
        experts = {id(p) for ch in chunks for m in ch.modules() if isinstance(m, LocalExperts) for p in m.parameters()}
        edp_group = self.mesh["edp"].get_group() if self.edp_size > 1 else None
        for ch in chunks:
            for p in ch.parameters():
                if p.grad is None:
                    continue
                group = edp_group if id(p) in experts else dp_group
                if group is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
                p.grad.div_(self.layout.dp * self.layout.cp if id(p) in experts else dist.get_world_size(dp_group))


def force_load_balance(model: nn.Module) -> None:
    """Round-robin routing in every MoE block of `model` (the unsharded reference of a run
    whose experts are routed so)."""
    for m in model.modules():
        if isinstance(m, (MoE, ExpertParallelMoE)):
            m.force_load_balance = True


def local_experts(module: nn.Module) -> list[LocalExperts]:
    """The expert-parallel expert groups inside `module` (none without expert parallelism)."""
    return [m for m in module.modules() if isinstance(m, LocalExperts)]
