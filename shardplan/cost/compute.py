"""Compute time of one forward pass of one transformer layer on one GPU: a roofline per op.

Every op takes the larger of its compute time and its memory time (Williams et al. 2009):

    compute = FLOPs / (dense peak at the compute dtype x attainable share)
    memory  = bytes moved / (HBM bandwidth x memory efficiency)

plus a fixed GPU-side `kernel_overhead` per kernel (ramp-up and tail), and the host's
launch time where it is not hidden: kernels are queued asynchronously, so a layer takes
max(GPU time, kernels x launch time) -- launches show only when the kernels are shorter
than they are (small prefills, decode without CUDA graphs). This is what makes a tiny
step cost more than its bytes.

GEMMs (Y[M,N] = X[M,K] W[K,N]) do 2MNK FLOPs and move the weight once plus their input and
output. Their attainable share of the peak falls for thin shapes (tile and wave
quantisation): share = e x prod_d d / (d + d_half), d in (M, N, K), with `e` the profile's
`matmul` (or `matmul_fp8`) and `d_half` its `matmul_half_dim`. Decode GEMMs (M = batch)
therefore read all local weights and are memory-bound; prefill GEMMs are compute-bound.

Attention (scores and the weighted sum) does 2 q kv (d_qk + d_v) FLOPs per head and
sequence (Kaplan et al. 2020, Table 1, per token: 2 n_ctx d_attn for each of QK and AV).
With flash attention (Dao et al. 2022) a causal kernel skips the masked half and moves
only Q, K, V and O; without it the full score matrix is computed, written, read by the
softmax, written again and read by AV. Decode reads every cached K/V of the sequence
(sliding-window layers: only the window). MLA decode runs on the latent (DeepSeek-V2
weight absorption, as vLLM's MLA backend does): d_qk = kv_lora_rank + rope dim, d_v =
kv_lora_rank.

Memory-bound elementwise work per token: each norm reads and writes h, each residual add
reads 2h and writes h, rotary reads and writes q and k, the activation function reads 2f
and writes f (gated; plain: reads f, writes f), dropout reads, writes and keeps a 1-byte
mask. Outside the tensor-parallel region (norms, residuals, dropout) every TP rank repeats
the work unless sequence parallelism splits it (Korthikanti et al. 2022, Sec. 4.2.2).

A linear-attention layer (Qwen3-Next Gated DeltaNet) has its own weights (`cost.params`): its
projections are GEMMs like any other, and its token mixer is the chunked gated delta rule
(`delta_rule_flops_per_token_per_head`), whose work per token is fixed by the heads and the
head dimensions, not by the context: no KV is read, one recurrent state per sequence is.

Mixture-of-experts: with balanced routing an EP rank's local experts see
k x T x (distinct token sets in the EP group) / E tokens each; a decode step reads only
the experts its tokens touch, E_local (1 - (1 - k/E)^(tokens)) of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from shardplan.cost import memo
from shardplan.cost.memo import hash_once
from shardplan.cost.layout import Layout
from shardplan.cost.params import Component, Split, WeightKind, block_weights, layer_kind
from shardplan.cost.weights import bytes_per_weight_element, is_quantized_tensor, numel_per_rank
from shardplan.cost.workload import Quantization
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec, NormType, PositionEmbedding
from shardplan.units import DType, bytes_per_element

LOW_PRECISION = (DType.FP8, DType.INT8)
DROPOUT_MASK_BYTES = 1.0
# fla's chunked gated delta rule (fla/ops/gated_delta_rule/chunk.py, chunk_gated_delta_rule_fwd:
# `chunk_local_cumsum(g, chunk_size=64)`), the kernel vLLM and transformers run for Qwen3-Next.
DELTA_RULE_CHUNK_TOKENS = 64
# Its forward kernels: cumsum, K K^T, the triangular solve, w/u, the chunk states, the output.
DELTA_RULE_PREFILL_KERNELS = 6


@dataclass(frozen=True)
class PassTime:
    """Seconds of one pass on one GPU by kind of work; `flops` are the FLOPs executed."""

    matmul_seconds: float = 0.0
    attention_seconds: float = 0.0
    memory_seconds: float = 0.0  # memory-bound elementwise ops, embedding gathers
    kernel_seconds: float = 0.0  # fixed per-kernel overhead
    flops: float = 0.0
    model_flops: float = 0.0  # the same, without recomputation (MFU's numerator)
    attention_flops: float = 0.0  # the attention core's share of `flops`
    kernels: float = 0.0  # kernels launched (what a host issues per pass without CUDA graphs)
    # The matmuls PyTorch op-level selective checkpointing drops and recomputes: every second
    # one in forward order (torchtitan's 'op' policy), seconds and FLOPs.
    dropped_matmul_seconds: float = 0.0
    dropped_matmul_flops: float = 0.0

    @property
    def seconds(self) -> float:
        return self.matmul_seconds + self.attention_seconds + self.memory_seconds + self.kernel_seconds

    # Field by field, written out: `dataclasses.fields()` on every addition was a tenth of a
    # search's time (the same sums and products either way).
    def __add__(self, other: "PassTime") -> "PassTime":
        return PassTime(
            self.matmul_seconds + other.matmul_seconds, self.attention_seconds + other.attention_seconds,
            self.memory_seconds + other.memory_seconds, self.kernel_seconds + other.kernel_seconds,
            self.flops + other.flops, self.model_flops + other.model_flops,
            self.attention_flops + other.attention_flops, self.kernels + other.kernels,
            self.dropped_matmul_seconds + other.dropped_matmul_seconds,
            self.dropped_matmul_flops + other.dropped_matmul_flops,
        )

    def scaled(self, factor: float) -> "PassTime":
        return PassTime(
            self.matmul_seconds * factor, self.attention_seconds * factor, self.memory_seconds * factor,
            self.kernel_seconds * factor, self.flops * factor, self.model_flops * factor,
            self.attention_flops * factor, self.kernels * factor, self.dropped_matmul_seconds * factor,
            self.dropped_matmul_flops * factor,
        )


@dataclass(frozen=True)
class ElementwiseTraffic:
    """Forward memory traffic of a layer's elementwise ops, bytes per element at 16-bit
    activations, and their kernels (scaled by the activation width for other dtypes). FUSED is
    one read and one write per norm and per rotary element, two reads and a write per gated
    activation: fused kernels (Transformer Engine, torch.compile, serving engines). A training
    stack that runs eager ops gives its own counts (knowledge/stacks/*.yaml eager_elementwise)."""

    norm_bytes_per_element: float = 4.0
    norm_kernels: int = 1
    rope_bytes_per_element: float = 4.0
    rope_kernels: int = 1
    act_bytes_per_element: float = 6.0
    act_kernels: int = 1


FUSED = ElementwiseTraffic()
# fp8 training (torchao Float8Linear, Transformer Engine with dynamic scaling): each GEMM input
# is scanned for its absolute maximum (reads 2 bytes) and cast to fp8 (reads 2, writes 1).
FP8_CAST_BYTES_PER_ELEMENT = 5.0
# Dropout on a 16-bit score matrix: reads 2, writes 2 and a 1-byte mask.
EAGER_DROPOUT_BYTES_PER_SCORE = 5.0


@hash_once
@dataclass(frozen=True)
class Work:
    """What one forward pass of a layer processes on one GPU.

    tokens:   rows of the GEMMs on this rank (the tensor-parallel group's tokens)
    num_seqs: sequences among them; q_len tokens of each are new, kv_len are attended
    decode:   K/V come from the cache in memory (a generation step)
    """

    tokens: float
    num_seqs: float
    q_len: float
    kv_len: float
    decode: bool
    causal: bool = True
    flash_attention: bool = True
    dropout: bool = False  # the residual branches' (hidden) dropout
    attention_dropout: bool | None = None  # on the attention probabilities; None: as `dropout`
    act_dtype: DType = DType.BF16
    kv_dtype: DType = DType.BF16
    quantization: Quantization = Quantization.NONE
    cp: int = 1  # context parallelism: q_len is this rank's share of a kv_len sequence
    # Decode attention that loads K/V once per query head instead of once per KV head
    # (TensorRT-LLM <= 0.6's masked-MHA kernel before XQA): GQA saves memory, not traffic.
    kv_read_per_query_head: bool = False
    # No host launch cost per layer: replayed from a CUDA graph, or costed per step by the
    # caller (serving: time_serving.host_seconds).
    cuda_graphs: bool = False
    # Training stacks: the attention kernel's forward efficiency (None: the profile's
    # `attention`), the elementwise ops' traffic, and fp8 GEMMs in the linear layers with
    # their input casts (Work.quantization FP8 makes the GEMMs fp8).
    attention_efficiency: float | None = None
    elementwise: ElementwiseTraffic = FUSED
    fp8_casts: bool = False
    eager_attention_bytes_per_score: float = 13.0  # TrainingWorkload's: unfused attention's traffic a score
    # The tokens the expert group's ranks route to their experts in all (the sum of its distinct token
    # sets); None: `tokens` from each of `expert_token_sets` sets alike. A serving group whose replicas
    # step together (DP attention) carries different batches on its ranks (cost/step_model.py).
    expert_group_tokens: float | None = None


GGML_MMVQ_MAX_TOKENS = 8  # ggml/src/ggml-cuda/mmvq.cuh MMVQ_MAX_BATCH_SIZE


def _share(d: float, half: float) -> float:
    return d / (d + half) if d > 0 else 0.0


def gemm_time(
    hw: HardwareProfile, m: float, n: float, k: float, *, count: float, weight_bytes: float, act_bytes: float, dtype: DType
) -> tuple[float, float]:
    """(seconds, FLOPs) of `count` GEMMs [m,k] x [k,n] whose weight has `weight_bytes` per element."""
    if m <= 0 or count <= 0:
        return 0.0, 0.0
    flops = 2.0 * m * n * k * count
    base = hw.matmul_fp8_efficiency if dtype in LOW_PRECISION and dtype in hw.peak_flops else hw.matmul_efficiency
    share = base * _share(m, hw.matmul_half_dim) * _share(n, hw.matmul_half_dim) * _share(k, hw.matmul_half_dim)
    t_compute = flops / (hw.peak_flops_for(dtype) * share)
    nbytes = count * (n * k * weight_bytes + m * k * act_bytes + m * n * act_bytes)
    return roofline(t_compute, memory_seconds(hw, nbytes)), flops


def roofline(compute_seconds: float, memory_seconds_: float) -> float:
    """One kernel's time from its compute and memory times: a smooth maximum (L2 norm), equal
    to the larger at either extreme and sqrt(2) x it when they balance, since a kernel's loads
    and math overlap imperfectly near the ridge point."""
    return (compute_seconds**2 + memory_seconds_**2) ** 0.5


def memory_seconds(hw: HardwareProfile, nbytes: float) -> float:
    return nbytes / (hw.memory_bandwidth_bytes_per_second * hw.memory_bandwidth_efficiency)


def compute_dtype(quantization: Quantization, act_dtype: DType) -> DType:
    """The dtype a quantized GEMM computes in: fp8 and W8A8 int8 use the 8-bit tensor cores;
    weight-only int4 (GPTQ/AWQ) dequantises to 16 bits."""
    if quantization is Quantization.FP8:
        return DType.FP8
    if quantization is Quantization.INT8:
        return DType.INT8
    return act_dtype


def expert_token_sets(layout: Layout) -> float:
    """Distinct token sets in an expert-parallel group: its ep x etp ranks are laid out
    tensor-parallel ranks first, and ranks of one TP group share their tokens."""
    return max(1.0, layout.ep * layout.expert_tp / layout.tp)


def expert_group_tokens(work: Work, layout: Layout) -> float:
    """The tokens an expert group routes in all (`Work.expert_group_tokens`)."""
    return work.tokens * expert_token_sets(layout) if work.expert_group_tokens is None else work.expert_group_tokens


def _linear_time(spec: ModelSpec, hw: HardwareProfile, layout: Layout, w: WeightKind, work: Work) -> tuple[float, float]:
    out_f, in_f = w.shape
    a = bytes_per_element(work.act_dtype)
    wb = bytes_per_weight_element(w, work.quantization, work.act_dtype, spec, expert_tp=layout.expert_tp)
    dt = compute_dtype(work.quantization, work.act_dtype) if is_quantized_tensor(w) else work.act_dtype
    elems = numel_per_rank(w, spec, layout)
    if w.routed_expert:
        moe = spec.moe
        if moe is None:  # routed experts exist only in MoE specs
            return 0.0, 0.0
        local_experts = w.copies / layout.ep
        group_tokens = expert_group_tokens(work, layout)
        routed_tokens = routed_rows(work, layout, moe.num_experts_per_token)
        touched = local_experts * (1.0 - (1.0 - moe.num_experts_per_token / moe.num_experts) ** group_tokens)
        touched = max(touched, 1e-9)
        per_copy = elems / local_experts
        n = per_copy / in_f
        return gemm_time(hw, routed_tokens / touched, n, in_f, count=touched, weight_bytes=wb, act_bytes=a, dtype=dt)
    # Shard along the dimension the split divides: output columns or input rows.
    n, k = (out_f, elems / out_f) if w.split is Split.ROW else (elems / in_f, in_f)
    if work.quantization.is_gguf and work.tokens <= GGML_MMVQ_MAX_TOKENS:
        # llama.cpp's CUDA backend multiplies a few tokens by a quantized matrix with a
        # matrix-vector kernel (ggml-cuda.cu: mul_mat_vec_q for src1 columns <= MMVQ_MAX_BATCH_SIZE = 8)
        # that streams the weights once and does its arithmetic on CUDA cores: bandwidth-bound.
        nbytes = n * k * wb + work.tokens * (k + n) * a
        return memory_seconds(hw, nbytes), 2.0 * work.tokens * n * k
    return gemm_time(hw, work.tokens, n, k, count=1, weight_bytes=wb, act_bytes=a, dtype=dt)


def _block_linear_time(spec: ModelSpec, hw: HardwareProfile, layout: Layout, w: WeightKind, work: Work) -> tuple[float, float]:
    """`_linear_time`, cached on what it reads of the layout: tp for a dense weight; tp, ep and
    etp for a routed expert's. The attention and shared weights of an MoE layer are then costed
    once for every expert-parallel degree."""
    if w.routed_expert:
        return _linear_time_of(spec, hw, w, work, layout.tp, layout.ep, layout.expert_tp)
    return _linear_time_of(spec, hw, w, work, layout.tp, 1, None)


@lru_cache(maxsize=65536)
def _linear_time_of(spec: ModelSpec, hw: HardwareProfile, w: WeightKind, work: Work, tp: int, ep: int,
                    etp: int | None) -> tuple[float, float]:
    return _linear_time(spec, hw, _shape(tp, 1, ep, etp, False), w, work)


def attention_time(spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work, layer_index: int) -> tuple[float, float, int]:
    """(seconds, FLOPs, kernels) of the attention core of one layer on one rank."""
    heads = spec.num_attention_heads / layout.tp
    a = bytes_per_element(work.act_dtype)
    kv_len = work.kv_len
    if spec.is_sliding_layer(layer_index) and spec.sliding_window is not None:
        kv_len = min(kv_len, spec.sliding_window)
    if work.decode or not work.causal or not work.flash_attention:
        kv_eff = kv_len  # a generation step attends to all; unfused kernels compute the masked half too
    elif work.cp > 1:
        kv_eff = (kv_len + 1) / 2  # load-balanced causal chunks: every rank does its share of the triangle
    else:
        kv_eff = max(1.0, kv_len - (work.q_len - 1) / 2)  # causal: the masked triangle is skipped
    if spec.mla is not None:
        m = spec.mla
        d_qk, d_v = (m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank) if work.decode else (m.qk_head_dim, m.v_head_dim)
        kv_per_token = (m.kv_lora_rank + m.qk_rope_head_dim) * bytes_per_element(work.kv_dtype)
    else:
        d_qk = d_v = spec.attention_head_dim
        kv_per_token = 2 * max(1.0, spec.kv_heads / layout.tp) * spec.attention_head_dim * bytes_per_element(work.kv_dtype)
    flops = 2.0 * work.num_seqs * heads * work.q_len * kv_eff * (d_qk + d_v)
    q_o_bytes = 2 * work.tokens * heads * max(d_qk, d_v) * a
    if work.decode:
        if work.kv_read_per_query_head and spec.mla is None:
            kv_per_token *= heads / max(1.0, spec.kv_heads / layout.tp)
        nbytes = q_o_bytes + work.num_seqs * kv_len * kv_per_token
        share = hw.attention_efficiency * _share(work.q_len * heads, hw.matmul_half_dim)
        t = roofline(flops / (hw.peak_flops_for(work.act_dtype) * share), memory_seconds(hw, nbytes))
        return t, flops, 1
    nbytes = q_o_bytes + work.num_seqs * kv_len * kv_per_token
    if work.flash_attention:
        base = hw.attention_efficiency if work.attention_efficiency is None else work.attention_efficiency
        share = base * _share(work.q_len, hw.matmul_half_dim) * _share(kv_eff, hw.matmul_half_dim)
        t = roofline(flops / (hw.peak_flops_for(work.act_dtype) * share), memory_seconds(hw, nbytes))
        return t, flops, 1
    # Unfused: QK^T and AV as batched GEMMs, softmax (and dropout) over the score matrix, with
    # the stack's traffic per score (Megatron's fused softmax: QK^T writes, softmax reads and
    # writes, AV reads; an eager stack's scale, mask, upcast and cast each read and write).
    scores = work.num_seqs * heads * work.q_len * kv_len
    score_dropout = work.dropout if work.attention_dropout is None else work.attention_dropout
    per_score = work.eager_attention_bytes_per_score - (0.0 if score_dropout else EAGER_DROPOUT_BYTES_PER_SCORE)
    score_bytes = scores * per_score * a / 2
    share = hw.matmul_efficiency * _share(work.q_len, hw.matmul_half_dim) * _share(kv_len, hw.matmul_half_dim)
    share *= _share(d_qk, hw.matmul_half_dim)
    t_gemm = roofline(flops / (hw.peak_flops_for(work.act_dtype) * share), memory_seconds(hw, nbytes))
    return t_gemm + memory_seconds(hw, score_bytes), flops, 3 + int(score_dropout)


def delta_rule_flops_per_token_per_head(key_head_dim: int, value_head_dim: int, chunk_tokens: float) -> float:
    """FLOPs of the gated delta rule for one token and one value head, chunkwise with chunks of
    C tokens (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", arXiv 2406.06484, the chunkwise form: O(L C d + L d^2); Gated DeltaNet,
    Yang, Kautz and Hatamizadeh 2024, arXiv 2412.06464, adds a per-token decay, elementwise
    work). Per chunk, as fla's forward runs it
    (fla/ops/gated_delta_rule/chunk.py, chunk_gated_delta_rule_fwd), with K and V the head dims:

        A = beta K K^T (chunk_scaled_dot_kkt)          2 C^2 K
        (I + A)^-1, unit lower triangular (solve_tril)   C^3 / 3
        w = A (beta k e^g), u = A (beta v) (recompute_w_u)  2 C^2 K + 2 C^2 V
        v' = u - w S, S <- S + k^T v' (fwd_h)         2 C K V + 2 C K V
        o = q S + (q k^T masked) v' (fwd_o)             2 C K V + 2 C^2 K + 2 C^2 V

    so per token 6 K V + C (6 K + 4 V) + C^2 / 3: the state terms (6 K V) do not grow with the
    context, unlike attention's 2 n_ctx (d_qk + d_v). A decode step is the recurrence itself
    (fused_recurrent: S k, the rank-one update, S q: 6 K V), the same formula with C = 1 up to
    its O(K + V) terms. Elementwise work (decay, gates) is left to the memory-bound ops."""
    k, v, c = key_head_dim, value_head_dim, chunk_tokens
    return 6.0 * k * v + c * (6.0 * k + 4.0 * v) + c * c / 3.0


def linear_attention_time(spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work) -> tuple[float, float, int]:
    """(seconds, FLOPs, kernels) of a Gated DeltaNet token mixer on one rank: value heads split
    over tp (vLLM Qwen3NextGatedDeltaNet). Bytes: q, k, v in and the output out per token, the
    per-chunk states fla writes and reads back (prefill), or each sequence's recurrent state
    read and written once (decode; kept in the KV dtype, as `kv.kv_cache_bytes_per_sequence`)."""
    la = spec.linear_attention
    if la is None:  # internal: only linear-attention layers come here
        raise ValueError(f"{spec.name} has no linear_attention")
    heads = la.num_value_heads / layout.tp
    a = bytes_per_element(work.act_dtype)
    state_elements = heads * la.key_head_dim * la.value_head_dim
    state_bytes = state_elements * bytes_per_element(work.kv_dtype)
    chunk = 1.0 if work.decode else max(1.0, min(float(DELTA_RULE_CHUNK_TOKENS), work.q_len))
    flops = work.tokens * heads * delta_rule_flops_per_token_per_head(la.key_head_dim, la.value_head_dim, chunk)
    io_bytes = work.tokens * (2 * la.key_dim + 2 * la.value_dim) / layout.tp * a
    if work.decode:
        nbytes = io_bytes + 2 * work.num_seqs * state_bytes
        share = hw.attention_efficiency * _share(heads, hw.matmul_half_dim)
        kernels = 1
    else:
        chunks = work.num_seqs * -(-work.q_len // DELTA_RULE_CHUNK_TOKENS)
        nbytes = io_bytes + 2 * chunks * state_elements * a + 2 * work.num_seqs * state_bytes
        share = hw.attention_efficiency * _share(chunk, hw.matmul_half_dim) * _share(la.key_head_dim, hw.matmul_half_dim)
        kernels = DELTA_RULE_PREFILL_KERNELS
    t = roofline(flops / (hw.peak_flops_for(work.act_dtype) * share), memory_seconds(hw, nbytes))
    return t, flops, kernels


def _linear_attention_elementwise(spec: ModelSpec, layout: Layout, work: Work) -> tuple[float, int]:
    """(bytes, kernels) of a Gated DeltaNet layer's elementwise ops inside the TP region (vLLM
    Qwen3NextGatedDeltaNet.forward): the short causal conv with its SiLU over q, k and v (reads
    and writes conv_dim), the L2 norm of q and k (reads and writes 2 key_dim), the gates g and
    beta (fp32, per value head: negligible bytes, one kernel), and the gated RMSNorm of the
    output (reads o and z, writes value_dim). No rotary embedding."""
    la = spec.linear_attention
    if la is None:
        return 0.0, 0
    a = bytes_per_element(work.act_dtype)
    per_token = 2 * la.conv_dim + 2 * 2 * la.key_dim + 3 * la.value_dim
    return per_token / layout.tp * work.tokens * a, 4


def routed_rows(work: Work, layout: Layout, top_k: int) -> float:
    """Rows this rank's experts run: the expert group's tokens, each sent to top-k experts,
    spread evenly over the ep ranks."""
    return expert_group_tokens(work, layout) * top_k / layout.ep


def _activation_traffic(spec: ModelSpec, work: Work) -> tuple[float, int]:
    """The MLP activation's forward traffic per intermediate element, in units of the activation
    width (bytes / its bytes per element), and its kernels: a gated activation as the stack runs it
    (`Work.elementwise`), GeLU one read and one write in one kernel."""
    if spec.mlp_gated:
        a = bytes_per_element(work.act_dtype)
        return work.elementwise.act_bytes_per_element * (a / 2) / a, work.elementwise.act_kernels
    return 2, 1


def elementwise_bytes(spec: ModelSpec, layout: Layout, work: Work, moe_layer: bool,
                      linear_attention: bool = False) -> tuple[float, int]:
    """(bytes, kernels) of the memory-bound elementwise ops of one layer's forward on one rank."""
    a = bytes_per_element(work.act_dtype)
    ew = work.elementwise
    width = a / 2  # the traffic counts are per element at 16-bit activations
    h = spec.hidden_size
    t = layout.tp
    outside = work.tokens / t if layout.sequence_parallel else work.tokens  # tokens outside the TP region
    # An eager stack's counts are for RMSNorm and gated activations written as PyTorch ops;
    # LayerNorm (F.layer_norm) and a plain GeLU are single native kernels even in eager mode.
    norm_bytes, norm_kernels = ((ew.norm_bytes_per_element, ew.norm_kernels) if spec.norm_type is NormType.RMSNORM
                                else (FUSED.norm_bytes_per_element, FUSED.norm_kernels))
    kernels = spec.num_norms_per_layer * norm_kernels + 2
    nbytes = spec.num_norms_per_layer * norm_bytes * width * h * outside
    residual_adds = 1 if spec.parallel_residual else 2
    nbytes += residual_adds * 3 * h * outside * a
    if work.dropout:
        nbytes += residual_adds * (2 * a + DROPOUT_MASK_BYTES) * h * outside
        kernels += residual_adds
    if linear_attention:
        mixer_bytes, mixer_kernels = _linear_attention_elementwise(spec, layout, work)
        nbytes += mixer_bytes
        kernels += mixer_kernels
    elif spec.position_embedding is PositionEmbedding.ROPE:
        if spec.mla is not None:
            rot = spec.mla.qk_rope_head_dim * (spec.num_attention_heads / t + 1)
        else:
            rot = spec.rotary_dim * (spec.num_attention_heads / t + max(1.0, spec.kv_heads / t))
        nbytes += ew.rope_bytes_per_element * width * rot * work.tokens
        kernels += ew.rope_kernels
    per_width, act_kernels = _activation_traffic(spec, work)
    if moe_layer and spec.moe is not None:
        moe = spec.moe
        routed = routed_rows(work, layout, moe.num_experts_per_token)
        nbytes += per_width * moe.expert_intermediate_size / layout.expert_tp * routed * a
        nbytes += 4 * routed * h * a  # permute (dispatch) and unpermute (combine): read and write
        nbytes += work.tokens * moe.num_experts * 4 * 2  # fp32 router logits: softmax/top-k read and write
        kernels += 3 + act_kernels
        if moe.num_shared_experts:
            nbytes += per_width * moe.shared_intermediate_size * moe.num_shared_experts / t * work.tokens * a
            kernels += act_kernels
        mlp_inputs = routed * (h + moe.expert_intermediate_size / layout.expert_tp)
    else:
        nbytes += per_width * spec.intermediate_size / t * work.tokens * a
        kernels += act_kernels
        mlp_inputs = work.tokens * (h + spec.intermediate_size / t)
    if work.fp8_casts:
        # The inputs of the QKV and output projections and of the MLP's two GEMMs, cast to fp8.
        la = spec.linear_attention
        mixed = la.value_dim if linear_attention and la is not None else spec.num_attention_heads * spec.attention_head_dim
        attn_inputs = work.tokens * (h + mixed / t)
        nbytes += FP8_CAST_BYTES_PER_ELEMENT * (attn_inputs + mlp_inputs)
        kernels += 8
    return nbytes, kernels


def kernel_overhead_seconds(hw: HardwareProfile, kernels: int, gpu_seconds: float, cuda_graphs: bool) -> float:
    """GPU-side per-kernel cost, plus the part of the host's launches the GPU work does not hide."""
    launch = 0.0 if cuda_graphs else kernels * hw.kernel_launch_seconds
    return kernels * hw.kernel_overhead_seconds + max(0.0, launch - gpu_seconds)


def layer_forward(
    spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work, layer_index: int
) -> PassTime:
    """One forward pass of layer `layer_index` on one rank: its own weights' GEMMs (`layer_kind`),
    its token mixer (softmax attention or the gated delta rule) and its elementwise ops."""
    moe_layer, linear = layer_kind(spec, layer_index)
    mm_t = mm_f = drop_t = drop_f = 0.0
    kernels = 0
    for w in block_weights(spec, moe_layer, linear):
        if len(w.shape) != 2:
            continue
        t, f = _block_linear_time(spec, hw, layout, w, work)
        mm_t += t
        mm_f += f
        kernels += 1
        if kernels % 2 == 0:  # the 2nd, 4th, ... matmul in forward order
            drop_t += t
            drop_f += f
    if linear:
        at_t, at_f, at_k = linear_attention_time(spec, hw, layout, work)
    else:
        at_t, at_f, at_k = attention_time(spec, hw, layout, work, layer_index)
    ew_bytes, ew_k = elementwise_bytes(spec, layout, work, moe_layer, linear)
    kernels += at_k + ew_k
    flops = mm_f + at_f
    ew_t = memory_seconds(hw, ew_bytes)
    return PassTime(
        matmul_seconds=mm_t,
        attention_seconds=at_t,
        memory_seconds=ew_t,
        kernel_seconds=kernel_overhead_seconds(hw, kernels, mm_t + at_t + ew_t, work.cuda_graphs),
        flops=flops,
        model_flops=flops,
        attention_flops=at_f,
        kernels=kernels,
        dropped_matmul_seconds=drop_t,
        dropped_matmul_flops=drop_f,
    )


def layers_forward(spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work, layers: Sequence[int]) -> PassTime:
    """One forward pass over `layers` on one rank; layers of the same kind (MoE, sliding window,
    linear attention) are costed once."""
    groups = _kind_groups_of(spec, layers) if isinstance(layers, tuple) else layer_kind_groups(spec, layers)
    return kinds_forward(spec, hw, layout, work, groups)


@lru_cache(maxsize=8192)
def _kind_groups_of(spec: ModelSpec, layers: tuple[int, ...]) -> tuple[tuple["LayerKind", int, int], ...]:
    """`layer_kind_groups` of a stage's layers, cached: the training search asks for the same few
    stages (pp, virtual stages) thousands of times, each a walk over up to every layer."""
    return layer_kind_groups(spec, layers)


LayerKind = tuple[bool, bool, bool]  # MoE, sliding window, linear attention: what a layer's forward depends on


def layer_kind_groups(spec: ModelSpec, layers: Iterable[int]) -> tuple[tuple[LayerKind, int, int], ...]:
    """(kind, its first layer, how many of `layers`) in the order the kinds first appear, the
    order `layers_forward` sums them in."""
    groups: dict[LayerKind, tuple[int, int]] = {}
    for i in layers:
        key = (spec.is_moe_layer(i), spec.is_sliding_layer(i), spec.is_linear_attention_layer(i))
        first, n = groups.get(key, (i, 0))
        groups[key] = (first, n + 1)
    return tuple((kind, first, n) for kind, (first, n) in groups.items())


def kinds_forward(spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work,
                  groups: tuple[tuple[LayerKind, int, int], ...]) -> PassTime:
    """`layers_forward` from the layers' kind groups (`layer_kind_groups`). A layer's forward
    depends on its index only through its kind, so each kind is costed at one representative
    layer, the model's first of that kind (the cache then serves every stage that holds it);
    the reference path (cost/memo.py) costs the group's own first layer, as it always did."""
    reps = _kind_representatives(spec) if memo.ENABLED else None
    total = PassTime()
    for kind, first, n in groups:
        at = reps[kind] if reps is not None else first
        total = total + _layer_forward(spec, hw, _compute_shape(layout, kind[0]), work, at).scaled(n)
    return total


@lru_cache(maxsize=256)
def _kind_representatives(spec: ModelSpec) -> dict[LayerKind, int]:
    reps: dict[LayerKind, int] = {}
    for i in range(spec.num_layers):
        reps.setdefault((spec.is_moe_layer(i), spec.is_sliding_layer(i), spec.is_linear_attention_layer(i)), i)
    return reps


def _compute_shape(layout: Layout, moe_layer: bool) -> Layout:
    """The fields of a layout that a layer's compute depends on (the cache key): expert
    parallelism matters to MoE layers only."""
    if not moe_layer:
        return _shape(layout.tp, layout.cp, 1, None, layout.sequence_parallel)
    return _shape(layout.tp, layout.cp, layout.ep, layout.expert_tp, layout.sequence_parallel)


@lru_cache(maxsize=4096)
def _shape(tp: int, cp: int, ep: int, etp: int | None, sp: bool) -> Layout:
    return Layout(tp=tp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp)


@lru_cache(maxsize=16384)
def _layer_forward(spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work, layer_index: int) -> PassTime:
    return layer_forward(spec, hw, layout, work, layer_index)


# The linears each Megatron-Core recompute module runs again in backward (name prefixes of
# `block_weights`): the MLA up-projections, a dense layer's MLP, an MoE layer's router, experts
# and shared experts, the shared experts alone.
RECOMPUTED_LINEARS: dict[str, tuple[str, ...]] = {
    "mla_up_proj": ("self_attn.q_b_proj", "self_attn.kv_b_proj"),
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.fc1", "mlp.fc2"),
    "moe": ("mlp.gate", "mlp.experts.", "mlp.shared_experts.", "mlp.shared_expert_gate"),
    "shared_experts": ("mlp.shared_experts.",),
}


def recomputed_forward(spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work,
                       layers: tuple[int, ...], modules: tuple[str, ...]) -> PassTime:
    """The forward work selective recomputation of Megatron-Core `modules` (other than the
    attention core, which the caller adds) runs again in backward over `layers`: the modules'
    GEMMs at the forward's own speed (`_block_linear_time`), and the elementwise ops they rerun
    (the separate norms under "layernorm", the experts' activation under "moe_act" or "moe",
    the dense activation under "mlp"). Counted as executed FLOPs, not model FLOPs."""
    total = PassTime()
    for kind, _first, n in _kind_groups_of(spec, layers):
        total = total + _recomputed_layer(spec, hw, _compute_shape(layout, kind[0]), work,
                                          _kind_representatives(spec)[kind], modules).scaled(n)
    return total


@lru_cache(maxsize=4096)
def _recomputed_layer(spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work, layer_index: int,
                      modules: tuple[str, ...]) -> PassTime:
    moe_layer, linear = layer_kind(spec, layer_index)
    moe_here = moe_layer and spec.moe is not None
    applies = {"mla_up_proj": spec.mla is not None, "mlp": not moe_here, "moe": moe_here,
               "shared_experts": moe_here and "moe" not in modules}
    prefixes = tuple(p for m in modules if applies.get(m, False) for p in RECOMPUTED_LINEARS[m])
    mm_t = mm_f = 0.0
    kernels = 0
    for w in block_weights(spec, moe_layer, linear):
        if len(w.shape) == 2 and w.name.startswith(prefixes):
            t, f = _block_linear_time(spec, hw, layout, w, work)
            mm_t += t
            mm_f += f
            kernels += 1
    a = bytes_per_element(work.act_dtype)
    ew = work.elementwise
    width = a / 2
    h = spec.hidden_size
    outside = work.tokens / layout.tp if layout.sequence_parallel else work.tokens
    nbytes = 0.0
    if "layernorm" in modules:  # the separate norms only: MLA's input norm, an MoE layer's pre-MLP norm
        norms = int(spec.mla is not None) + int(moe_here)
        nbytes += norms * ew.norm_bytes_per_element * width * h * outside
        kernels += norms * ew.norm_kernels
    per_width, act_kernels = _activation_traffic(spec, work)
    if moe_here and ("moe_act" in modules or "moe" in modules):
        moe = spec.moe
        assert moe is not None
        routed = routed_rows(work, layout, moe.num_experts_per_token)
        nbytes += per_width * moe.expert_intermediate_size / layout.expert_tp * routed * a
        kernels += act_kernels
        if "moe" in modules:  # the rest of the layer's forward, as `elementwise_bytes` counts it
            nbytes += 4 * routed * h * a + work.tokens * moe.num_experts * 4 * 2  # permute, unpermute; router
            kernels += 3
            if moe.num_shared_experts:
                nbytes += per_width * moe.shared_intermediate_size * moe.num_shared_experts / layout.tp * work.tokens * a
                kernels += act_kernels
    if not moe_here and "mlp" in modules:
        nbytes += per_width * spec.intermediate_size / layout.tp * work.tokens * a
        kernels += act_kernels
    ew_t = memory_seconds(hw, nbytes)
    return PassTime(matmul_seconds=mm_t, memory_seconds=ew_t,
                    kernel_seconds=kernel_overhead_seconds(hw, kernels, mm_t + ew_t, work.cuda_graphs),
                    flops=mm_f, kernels=kernels)


def head_forward(spec: ModelSpec, hw: HardwareProfile, layout: Layout, work: Work, logit_tokens: float) -> PassTime:
    """Final norm and the vocabulary-parallel lm_head over `logit_tokens` rows (training: every
    token; serving: the last position of each sequence)."""
    a = bytes_per_element(work.act_dtype)
    h = spec.hidden_size
    n = spec.vocab_size / layout.tp if spec.lm_head else spec.num_labels  # a classification score is replicated
    k = spec.embedding_width if spec.lm_head else h  # OPT-350m's project_out narrows the lm_head's input
    if work.quantization.is_gguf:  # a GGUF file quantizes the output matrix too (Q6_K, or Q8_0)
        head = WeightKind("lm_head.weight", Component.LM_HEAD, (spec.vocab_size, k), Split.VOCAB)
        wb = bytes_per_weight_element(head, work.quantization, work.act_dtype, spec)
        if logit_tokens <= GGML_MMVQ_MAX_TOKENS:
            t, f = memory_seconds(hw, n * k * wb + logit_tokens * (k + n) * a), 2.0 * logit_tokens * n * k
        else:
            t, f = gemm_time(hw, logit_tokens, n, k, count=1, weight_bytes=wb, act_bytes=a, dtype=work.act_dtype)
    else:
        t, f = gemm_time(hw, logit_tokens, n, k, count=1, weight_bytes=a, act_bytes=a, dtype=work.act_dtype)
    norm = memory_seconds(hw, 2 * h * logit_tokens * a)
    return PassTime(matmul_seconds=t, memory_seconds=norm, kernel_seconds=2 * hw.kernel_overhead_seconds, flops=f, model_flops=f,
                    kernels=2)


def embedding_forward(spec: ModelSpec, hw: HardwareProfile, work: Work) -> PassTime:
    """Token-embedding gather: read and write one row per token."""
    a = bytes_per_element(work.act_dtype)
    return PassTime(
        memory_seconds=memory_seconds(hw, 2 * spec.hidden_size * work.tokens * a),
        kernel_seconds=hw.kernel_overhead_seconds,
        kernels=1,
    )
