"""The decoder verify runs: a Llama-style transformer (RMSNorm, RoPE, GQA, SwiGLU; MoE blocks
with top-k routing) built from a ModelSpec, parameter names as in `cost.params`.

It keeps for backward what fused training kernels keep, so its activations are the ones the
cost model counts (Korthikanti et al. 2022, Sec. 4.1, with flash attention):
- RMSNorm saves its input and the fp32 per-row 1/rms (Apex/TransformerEngine fused norms);
- SwiGLU saves its two inputs and recomputes silu in backward (Megatron's fused bias-swiglu);
- attention is `scaled_dot_product_attention` (the flash kernel on CPU and GPU: q, k, v, the
  output and the log-sum-exp), with q/k/v in (batch, seq, heads, dim) layout so the output
  feeds the output projection without a copy.

A stage of a pipeline is the same class holding only its layers (`layer_ids`), with the
embedding on the first chunk and the final norm and lm_head on the last.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardplan.specs.model import ModelSpec

RMS_EPS = 1e-5


def model_dtype(spec: ModelSpec) -> torch.dtype:
    """The torch format of the run's weights and activations (`spec.dtype`: float32 or bfloat16)."""
    return getattr(torch, spec.dtype)


class _RMSNormFn(torch.autograd.Function):
    """Fused RMSNorm as Apex/TransformerEngine run it: fp32 math inside, the output in the
    input's format; saves the input and the fp32 per-row 1/rms."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        if x.dtype == torch.float32:
            return x * rstd * weight
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        g = grad.float()
        grad_weight = (g * x_hat).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        g = g * weight.float()
        grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        out = F.silu(gate)
        return out.mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_up = grad * silu
        grad_gate = grad * up * sig * (1 + gate * (1 - sig))
        return grad_gate, grad_up


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, RMS_EPS)


def rope_cache(spec: ModelSpec, device: torch.device | str) -> torch.Tensor:
    """cos and sin of every position, (max_position_embeddings, head_dim): the first half cos,
    the second sin, in the model's format (one cache per model, as vLLM's `cos_sin_cache`)."""
    d = spec.attention_head_dim
    inv_freq = 1.0 / (spec.rope_theta or 10000.0) ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    pos = torch.arange(spec.max_position_embeddings, dtype=torch.float64, device=device)
    freqs = torch.outer(pos, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(model_dtype(spec))


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """x: (batch, seq, heads, dim); cos_sin: (seq, dim) for x's positions (HF rotate_half form).

    `in_place` rotates x's own storage, as vLLM's `rotary_embedding` kernel writes q and k.
    The rotation's gradient needs only cos and sin, so an out-of-place kernel frees its input
    at once and backward keeps the same either way; in place is used where the input must
    stay alive regardless (a projection output that selective checkpointing saves)."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    if not in_place:
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x2_sin, x1_sin = x2 * sin, x1 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
    return x


def project(module: nn.Module, x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """The column-parallel projections of `x`. Under sequence parallelism `x` is this rank's
    share of the sequence and `module.sequence_parallel` gathers it first, keeping for backward
    the share, not the gathered sequence (Megatron's ColumnParallelLinear re-gathers it)."""
    if module.sequence_parallel is None:
        return tuple(lin(x) for lin in linears)
    return module.sequence_parallel.project(x, linears)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, h, kv = spec.attention_head_dim, spec.num_attention_heads, spec.kv_heads
        self.head_dim = d
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=False)
        self.sequence_parallel = None  # set by parallel.apply_tp: gathers the sequence for the projections
        self.context_parallel = None  # set by context.apply_cp: causal attention with K/V gathered over cp

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                pos: int = 0) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism the projections hold this rank's heads only.
        if self.sequence_parallel is None:
            # One projection at a time, its input to the rotation freed before the next (the
            # serving peak counts what is alive at once).
            q = apply_rope(self.q_proj(x).view(b, s, -1, self.head_dim), cos_sin)
            k = apply_rope(self.k_proj(x).view(b, s, -1, self.head_dim), cos_sin)
            v = self.v_proj(x).view(b, s, -1, self.head_dim)
        else:
            q, k, v = self.sequence_parallel.project(x, (self.q_proj, self.k_proj, self.v_proj))
            q = apply_rope(q.view(b, s, -1, self.head_dim), cos_sin, in_place=True)
            k = apply_rope(k.view(b, s, -1, self.head_dim), cos_sin, in_place=True)
            v = v.view(b, s, -1, self.head_dim)
        if cache is not None:
            k_cache, v_cache = cache
            k_cache[:, pos:pos + s] = k
            v_cache[:, pos:pos + s] = v
            k, v = k_cache[:, :pos + s], v_cache[:, :pos + s]
        causal = pos == 0 and s > 1  # decode: one query attends to every cached position
        if self.context_parallel is not None:
            out = self.context_parallel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.sequence_parallel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No names for the gate and up outputs: they are freed when SwiGLU returns, before the
        # down projection (the serving peak counts what is alive at once).
        return self.down_proj(_SwiGLUFn.apply(*project(self, x, (self.gate_proj, self.up_proj))))


FUSED_MOE_BLOCK_ROWS = 16  # token rows one step of the serving MoE reads (the kernel's BLOCK_SIZE_M)


class MoE(nn.Module):
    """Top-k routing (softmax over experts, the k largest renormalised: Mixtral), written as
    Megatron-core's token dispatcher does it: the tokens are permuted into expert order, each
    expert runs on its contiguous segment, the outputs are weighted by the router
    probabilities and un-permuted by indexing (whose backward keeps only the indices), then
    the k copies of each token are summed. What backward keeps is then what Megatron keeps:
    the router probabilities, the permuted tokens, each expert's SwiGLU inputs and down-
    projection input, and the expert outputs the probability weighting multiplies.
    (An `index_add` would also keep its k x hidden source, for nothing but its shape.)"""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.top_k = moe.num_experts_per_token
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(spec.hidden_size, moe.expert_intermediate_size) for _ in range(moe.num_experts))
        self.force_load_balance = False  # round-robin routing (see `route`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, order, counts = route(self.gate, tokens, self.top_k, len(self.experts),
                                       seq_len=shape[1] if self.force_load_balance else None)
        if not torch.is_grad_enabled():
            return fused_moe(tokens, weights, order, counts, self.top_k, dict(enumerate(self.experts))).view(shape)
        permuted = tokens[order // self.top_k]
        # Every expert runs, an empty segment included: its weight gradient is then zeros, as a
        # grouped GEMM over stacked expert weights gives (Megatron GroupedMLP, torchtitan), not
        # None, so a small batch that leaves an expert idle still holds every gradient.
        outputs = [expert(seg) for expert, seg in zip(self.experts, permuted.split(counts))]
        return unpermute(torch.cat(outputs), weights, order, self.top_k).view(shape)


def route(gate: nn.Module, tokens: torch.Tensor, top_k: int, num_experts: int,
          seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Mixtral's router: softmax over the experts, the k largest renormalised. Returns the
    (tokens, k) weights, the (token, slot) pairs in expert order (a stable sort, so each
    expert's rows keep token order) and the number of rows each expert receives.

    With `seq_len` (rows are sequences of that many tokens), the experts are chosen round-robin
    instead, the weights still the router's probabilities of them: torchtitan's
    `debug.moe_force_load_balance` (TokenChoiceTopKRouter._debug_force_load_balance_routing),
    counted over sequence positions rather than flat rows so that any data-parallel split of
    the batch routes as the unsharded reference does."""
    probs = torch.softmax(gate(tokens), dim=-1)
    if seq_len is None:
        weights, chosen = probs.topk(top_k, dim=-1)
    else:
        positions = torch.arange(tokens.shape[0], device=tokens.device) % seq_len
        chosen = (positions[:, None] * top_k + torch.arange(top_k, device=tokens.device)) % num_experts
        weights = probs.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    order = chosen.flatten().argsort(stable=True)
    counts = torch.bincount(chosen.flatten(), minlength=num_experts).tolist()
    return weights, order, counts


def unpermute(expert_outputs: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert outputs (in expert order) weighted by the router probabilities, put back in
    (token, slot) order by indexing (whose backward keeps only the indices) and the k copies of
    each token summed (Megatron-core moe_utils.unpermute)."""
    weighted = expert_outputs * weights.flatten()[order, None]
    unpermuted = weighted[order.argsort()]
    return unpermuted.view(-1, top_k, unpermuted.shape[-1]).sum(1)


def fused_moe(tokens: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, counts: list[int], top_k: int,
              experts: dict[int, MLP]) -> torch.Tensor:
    """Serving, with the buffers of vLLM's fused_moe (vllm/model_executor/layers/fused_moe/
    fused_moe.py, `fused_experts_impl` and `TritonExperts.workspace_shapes`), allocated up
    front: one workspace of T k x max(2N, hidden) that holds the gate and up outputs
    (`intermediate_cache1`) and, once the activation has read them, the weighted expert
    outputs (`intermediate_cache3`, the same memory), and the SwiGLU output (T k x N,
    `intermediate_cache2`). Each expert writes its rows, a block of rows at a time as the
    kernel reads them; then the k rows of each token are summed into the input's own storage
    (`fused_experts(..., inplace=True)`).

    `experts` maps a global expert index to the expert this rank holds. Under tensor
    parallelism every expert is held and N is this rank's share; under expert parallelism
    (vLLM's `expert_map`) the rows of other ranks' experts are still in every buffer and are
    written as zeros (the kernel's `write_zeros_to_output` for expert id -1). Either way the
    sum is a partial one, which a forward hook on the MoE module reduces in place (vLLM
    reduces after the experts)."""
    n = _local(next(iter(experts.values())).gate_proj.weight).shape[0]
    rows, hidden = tokens.shape[0] * top_k, tokens.shape[1]
    workspace = tokens.new_empty(rows * max(2 * n, hidden))
    gate, up = workspace[: rows * n].view(rows, n), workspace[rows * n: 2 * rows * n].view(rows, n)
    act = tokens.new_empty(rows, n)
    starts = [sum(counts[:e]) for e in range(len(counts))]
    for e, (start, count) in enumerate(zip(starts, counts)):
        if e not in experts:
            gate[start:start + count].zero_()
            up[start:start + count].zero_()
            continue
        w_gate, w_up = (_local(lin.weight).t() for lin in (experts[e].gate_proj, experts[e].up_proj))
        for first in range(start, start + count, FUSED_MOE_BLOCK_ROWS):
            seg = slice(first, min(first + FUSED_MOE_BLOCK_ROWS, start + count))
            x = tokens[order[seg] // top_k]
            torch.mm(x, w_gate, out=gate[seg])
            torch.mm(x, w_up, out=up[seg])
    torch.mul(F.silu(gate, inplace=True), up, out=act)
    down = workspace[: rows * hidden].view(rows, hidden)  # gate and up are dead from here on
    for e, (start, count) in enumerate(zip(starts, counts)):
        seg = slice(start, start + count)
        if e in experts:
            torch.mm(act[seg], _local(experts[e].down_proj.weight).t(), out=down[seg])
        else:
            down[seg].zero_()
    down.mul_(weights.flatten()[order, None])
    return tokens.zero_().index_add_(0, order // top_k, down)


def _local(w: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (DTensor) or the parameter itself."""
    return w.to_local() if hasattr(w, "to_local") else w


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int) -> None:
        super().__init__()
        self.norm0 = RMSNorm(spec.hidden_size)
        self.self_attn = Attention(spec)
        self.norm1 = RMSNorm(spec.hidden_size)
        self.mlp = MoE(spec) if spec.is_moe_layer(layer_index) else MLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, cache=None, pos: int = 0) -> torch.Tensor:
        h = x + self.self_attn(self.norm0(x), cos_sin, cache, pos)
        return h + self.mlp(self.norm1(h))


class Decoder(nn.Module):
    """The whole model (`layer_ids` = every layer) or one pipeline chunk of it.

    Input: token ids (first chunk) or hidden states; output: logits (last chunk) or hidden
    states. Layers sit in a ModuleDict keyed by their global index, so parameter names are
    the same in every chunk and in the unsharded reference."""

    def __init__(self, spec: ModelSpec, layer_ids: list[int] | None = None, *, first: bool = True, last: bool = True) -> None:
        super().__init__()
        self.spec = spec
        ids = list(range(spec.num_layers)) if layer_ids is None else layer_ids
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size) if first else None
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in ids})
        self.final_norm = RMSNorm(spec.hidden_size) if last else None
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if last else None
        if spec.tie_word_embeddings and first and last:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", torch.empty(spec.max_position_embeddings, spec.attention_head_dim),
                             persistent=False)
        self.to(model_dtype(spec))  # weights and the RoPE cache in the run's format
        self.caches: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # serving: per layer K and V
        self.pos = 0  # serving: tokens already in the cache
        self.last_position_only = False  # serving: logits of each sequence's last position only (as vLLM)
        self.pending_input: torch.Tensor | None = None
        self.sequence_parallel = None  # set by parallel.apply_tp: the residual stream is sequence-sharded

    def reset_buffers(self) -> None:
        """Fill the non-persistent RoPE cache (after `to_empty`, which leaves it uninitialised)."""
        self.cos_sin = rope_cache(self.spec, self.cos_sin.device)

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        if x is None:  # serving: a received stage input handed over, so no caller keeps it alive
            x, self.pending_input = self.pending_input, None
        if self.embed_tokens is None:
            # A pipeline stage receives (and sends) this rank's share of the sequence.
            h = x if self.sequence_parallel is None else self.sequence_parallel.enter(x)
        else:
            h = self.embed_tokens(x)
            if isinstance(self.embed_tokens.weight, DTensor):
                # A vocabulary-parallel embedding's all-reduced output: DTensor's async wrapper
                # keeps the collective's buffer and a copy alive as long as the result does;
                # keep one plain tensor instead.
                h = h.clone()
        del x  # a received stage input is the first block's input, not one more live tensor
        s = h.shape[1]
        cos_sin = self.cos_sin[self.pos:self.pos + s]
        for name, layer in self.layers.items():
            cache = self.caches[name] if self.caches is not None else None
            h = layer(h, cos_sin, cache, self.pos)
        if self.lm_head is None:
            return h if self.sequence_parallel is None else self.sequence_parallel.leave(h)
        if self.last_position_only:
            h = h[:, -1:]
        if self.sequence_parallel is None:
            return self.lm_head(self.final_norm(h))
        return self.sequence_parallel.vocab_sharded(project(self, self.final_norm(h), (self.lm_head,))[0])
