"""Serving memory per GPU with vLLM's semantics (vllm/v1/worker/gpu_worker.py,
`determine_available_memory`):

    budget   = device memory x gpu_memory_utilization
    KV bytes = budget - weights - activation peak of the profiling pass - non-torch memory
               (- CUDA graphs when they are profiled first; - the CUDA context when no
               baseline snapshot excludes it)
    blocks   = KV bytes // (block_size x KV bytes per token on this rank)

Only layers that attend keep KV; a linear-attention layer (Qwen3-Next) adds a fixed state to
each sequence instead (`kv.py`), counted in the bytes of one max_model_len sequence.

Which terms the budget counts, and how the engine refuses a max_model_len that does not fit,
change with the engine version: the workload carries them as switches resolved from
knowledge/engines/*.yaml (cost/engine.py). The engine allocates every remaining byte to the
KV cache, so a fitting rank's total equals the budget; what is outside the budget (the CUDA
context after vLLM 0.6.5, CUDA graphs before 0.21) must fit in the remaining share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardplan.cost.breakdown import MemoryBreakdown, RankMemory
from shardplan.cost.kv import kv_elements_per_token_per_layer, sliding_window_blocks_per_request, vllm_kv_cache_groups
from shardplan.cost.layout import Layout
from shardplan.cost import speculative as spec_decode
from shardplan.cost.offload import offload_memory
from shardplan.cost.params import layer_flags
from shardplan.cost.vision import vision_profile_peak_bytes
from shardplan.cost.weights import INT4_GROUP_SIZE, stage_weights
from shardplan.cost.workload import InferenceWorkload, Quantization
from shardplan.specs.hardware import HardwareProfile
from shardplan.errors import ShardplanError
from shardplan.specs.model import GROUPED_CHECKPOINT_KINDS, ModelSpec
from shardplan.units import BYTES_PER_GIB, DType, bytes_per_element

FP32_BYTES = 4.0


def static_fraction(wl: InferenceWorkload, tp: int, pp: int = 1) -> float:
    """SGLang's mem_fraction_static: as given, else its default for this tensor-parallel size (and,
    where pipeline stages change it, for pp > 1)."""
    rows = wl.static_fraction_by_tp_pipelined if pp > 1 and wl.static_fraction_by_tp_pipelined else wl.static_fraction_by_tp
    if not rows:
        return wl.gpu_memory_utilization
    return next(value for min_tp, value in rows if tp >= min_tp)


def kv_bytes_per_token_per_layer_per_rank(spec: ModelSpec, tp: int, kv_bytes_per_element: float) -> float:
    """GQA/MQA/MHA: KV heads divided over tp, one head per rank once tp exceeds them (vLLM
    replicates). MLA: the latent is replicated on every tensor-parallel rank (vLLM)."""
    if spec.mla is not None:
        return kv_elements_per_token_per_layer(spec) * kv_bytes_per_element
    heads_per_rank = max(1, spec.kv_heads // tp)
    return 2 * heads_per_rank * spec.attention_head_dim * kv_bytes_per_element


def linear_state_bytes_per_sequence_per_rank(spec: ModelSpec, layers: Sequence[int], tp: int,
                                             state_bytes_per_element: float) -> float:
    """The recurrent state one sequence holds in the linear-attention layers among `layers` on
    one rank: LinearAttentionSpec.state_elements_per_sequence per layer, its heads (and conv
    channels) split over tp as vLLM's Qwen3NextGatedDeltaNet splits them; stored like the KV."""
    la = spec.linear_attention
    if la is None:
        return 0.0
    num_linear = sum(spec.is_linear_attention_layer(i) for i in layers)
    return num_linear * la.state_elements_per_sequence / tp * state_bytes_per_element


def rotary_cache_bytes(spec: ModelSpec, dtype: DType) -> float:
    """vLLM's RotaryEmbedding keeps a cos/sin cache of max_position_embeddings x rotary_dim in
    the model dtype; it shows up in the 'model weights take' line."""
    return spec.max_position_embeddings * spec.rotary_dim * bytes_per_element(dtype)


def activation_peak_bytes(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, last_stage: bool,
                          dummy_sampler: bool = True) -> float:
    """Peak of torch-allocated temporaries in the profiling forward of max_num_batched_tokens
    tokens: the residual stream and hidden state, plus the larger of the attention and MLP
    transients of one layer (every layer frees its own), or the sampler's fp32 logits for
    max_num_seqs sequences with the sampler's sort buffers (vLLM's dummy sampler run) on
    the last stage."""
    stream, layer_peak, _ = _layer_temporaries(spec, layout, wl)
    if not last_stage or not dummy_sampler:  # SGLang sizes its pool without a profiling pass
        return layer_peak
    return max(layer_peak, stream + _logits_bytes(spec, layout, wl))


def _logits_bytes(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> float:
    """The last stage's logits in the profiling pass: the dummy sampler's rows, and (TGI) the prompt
    log-probabilities of every token, at the head's bytes per logit (`prompt_logit_bytes`)."""
    tokens = wl.max_num_batched_tokens
    # The dummy sampler run takes one logit row per dummy request, and a request holds at least
    # one token: min(max_num_seqs, tokens) rows (V1 gpu_model_runner._dummy_run: num_reqs =
    # min(num_tokens, max_num_reqs); V0 profile_run spreads the tokens over max_num_seqs seqs).
    # TGI's warm-up asks for prompt log-probabilities: logits of every token of the prefill.
    sampler = min(wl.max_num_seqs, tokens) * spec.vocab_size * wl.sampler_bytes_per_logit
    return sampler + tokens * spec.vocab_size * prompt_logit_bytes(spec, layout, wl)


def prompt_logit_bytes(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> float:
    """Bytes per prompt token and vocabulary entry the warm-up's prompt log-probabilities hold on one
    rank: the engine's figure, or where the lm_head is split over the tensor-parallel ranks and its
    logits gathered (the vocabulary divides evenly; otherwise every rank holds the whole head), the
    gathered figure (knowledge/engines/tgi.yaml prefill_logit_bytes_gathered)."""
    return wl.prefill_logit_bytes_gathered if _gathered_head(spec, layout, wl) else wl.prefill_logit_bytes


def _gathered_head(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> bool:
    """Whether the lm_head is split over the tensor-parallel ranks and its logits gathered (the engine
    says what that holds, and the vocabulary divides evenly; otherwise every rank holds the whole head)."""
    return layout.tp > 1 and spec.vocab_size % layout.tp == 0 and wl.prefill_logit_bytes_gathered > 0


def warmup_reserved_bytes(spec: ModelSpec, layout: Layout, wl: InferenceWorkload, room_bytes: float) -> float:
    """What PyTorch's caching allocator holds on the last stage when TGI reads the free memory after its
    warm-up prefill: torch.cuda.mem_get_info counts every reserved segment, in use or cached. The layers'
    temporaries leave their segments cached; a cached block serves only a request no larger than itself
    (c10/cuda/CUDACachingAllocator.cpp get_free_block), so logits larger than every layer temporary take
    segments of their own beside them; a gathered head (`prompt_logit_bytes`) also leaves its rank's share
    of the logits cached (TGI's TensorParallelHead.forward: `gather_input`, layers/tensor_parallel.py:89
    at v2.4.0, freed once gathered). Where the cached and the live do not fit in `room_bytes` (the
    allocator's memory beside the weights, the context and the warm-up batch's KV), the failed allocation
    frees the cached segments and is retried (DeviceCachingAllocator::malloc: release_cached_blocks, then
    alloc_block), and only what is live remains. The attention backend's workspace is live throughout."""
    stream_bytes, layer_peak_bytes, widest_bytes = _layer_temporaries(spec, layout, wl)
    logits_bytes = _logits_bytes(spec, layout, wl)
    one_copy_bytes = wl.max_num_batched_tokens * spec.vocab_size * bytes_per_element(wl.activation_dtype)
    # the layers' segments (the stream's among them) and a gathered head's rank share
    cached_bytes = layer_peak_bytes + (one_copy_bytes / layout.tp if _gathered_head(spec, layout, wl) else 0.0)
    live_bytes = stream_bytes + logits_bytes
    if one_copy_bytes <= widest_bytes:  # the logits fit in the layers' cached blocks
        reserved_bytes = max(cached_bytes, live_bytes)
    elif cached_bytes - stream_bytes + live_bytes > room_bytes:  # the cache was freed for them
        reserved_bytes = live_bytes
    else:
        reserved_bytes = cached_bytes - stream_bytes + live_bytes
    return reserved_bytes + wl.attention_workspace_bytes


def _layer_temporaries(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> tuple[float, float, float]:
    """(the residual stream's bytes, the peak of one layer's temporaries with the stream, the largest
    single temporary) of a forward of max_num_batched_tokens tokens on one rank."""
    tokens = wl.max_num_batched_tokens
    a = bytes_per_element(wl.activation_dtype)
    h = spec.hidden_size
    tp = layout.tp
    stream = 3 * tokens * h * a  # residual, hidden state, normalised input of the sublayer
    if spec.mla is not None:
        m = spec.mla
        heads = spec.num_attention_heads / tp
        qkv = heads * (m.qk_head_dim + m.qk_nope_head_dim + m.v_head_dim) + m.kv_lora_rank + m.qk_rope_head_dim
        attn = tokens * (qkv + heads * m.v_head_dim) * a
        widest = tokens * qkv * a
    else:
        d = spec.attention_head_dim
        q = spec.num_attention_heads * d / tp
        kv = 2 * max(1, spec.kv_heads // tp) * d
        attn = tokens * (q + kv + q) * a
        widest = tokens * (q + kv) * a  # the fused QKV projection's output
    width_factor = 3 if spec.mlp_gated else 2  # gate+up output and the activation's output
    mlp = tokens * width_factor * spec.intermediate_size / tp * a
    widest = max(widest, tokens * (width_factor - 1) * spec.intermediate_size / tp * a)  # the gate/up output
    if spec.moe is not None:
        moe = spec.moe
        etp = layout.expert_tp
        # vLLM fused_moe (model_executor/layers/fused_moe/fused_moe.py, `fused_experts_impl`,
        # `TritonExperts.workspace_shapes`): one workspace (T, k, max(2N, hidden)) holds the
        # gate/up outputs (cache1) and then the expert outputs (cache3, the same memory, as
        # cache1 is dead by then), beside the activation output (T*k, N) (cache2). Every
        # (token, slot) row is in every rank's buffers, under expert parallelism too (rows of
        # other ranks' experts are written as zeros: `expert_map`, `write_zeros_to_output`),
        # so the caches shrink with etp, not with ep.
        n = moe.expert_intermediate_size / etp
        routed = tokens * moe.num_experts_per_token * (max((width_factor - 1) * n, h) + n) * a
        router = tokens * moe.num_experts * FP32_BYTES
        shared = tokens * width_factor * moe.shared_intermediate_size * moe.num_shared_experts / tp * a
        mlp = max(mlp, routed + router + shared)
        widest = max(widest, tokens * moe.num_experts_per_token * max((width_factor - 1) * n, h) * a)
    layer_peak = stream + max(attn, mlp)
    return stream, layer_peak, widest


def llamacpp_compute_buffer_phases(spec: ModelSpec, *, ubatch_tokens: int, kv_cells: int, flash_attention: bool,
                                   output_on_gpu: bool, expert_copy_bytes: float = 0.0) -> dict[str, float]:
    """Bytes live on the GPU at each phase of llama.cpp's worst-case graph; the CUDA compute
    buffer is the largest of them (`llamacpp_compute_buffer_bytes`).

    llama.cpp reserves its compute buffer once, at start, for the graph of one full ubatch
    (n_outputs = n_ubatch) over a full KV cache (n_kv = the slot's cells): src/llama-context.cpp
    graph_reserve. ggml's graph allocator (ggml/src/ggml-alloc.c ggml_gallocr_alloc_graph_impl)
    allocates the graph inputs first, frees each tensor once its last consumer has run, and lets
    in-place ops (ggml_op_can_inplace: soft_max, rope, add, mul, unary, rms_norm) reuse their
    input; every activation is f32. So the buffer is the peak of what is live at once:

      attention, no flash attention: the f32 KQ mask (n_kv x n_ubatch, an input every layer reads),
                the layer input kept for the residual, the query (or the KQV output), and the
                scores n_head x n_kv x n_ubatch (soft_max in place);
      attention, flash attention: the f16 mask copy, the residual, the query and the output;
      feed-forward: the mask, the residual and normed input, gate and up (n_ff x n_ubatch each;
                an MoE layer: top-k experts' gate and up, and the router's n_expert logits);
      output: the logits n_vocab x n_ubatch and the final normed hidden state, when the output
                layer is on the GPU;
      expert copy (--n-cpu-moe): the feed-forward phase plus one host-held expert tensor copied in
                (`expert_copy_bytes`, the largest): a ubatch of >= 32 tokens multiplies host experts
                on the GPU (ggml_backend_cuda_device_offload_op), and the scheduler starts a new split
                at each such weight so that one copy's memory is reused by the next
                (ggml/src/ggml-backend.cpp at b11312: 'check if a weight is on a different and
                incompatible backend / by starting a new split, the memory of the previously
                offloaded weights can be reused'); with one copy of the graph (n_copies = 1) the
                copy is an ordinary node of the compute buffer, freed after its last use.
    Fragmentation of the allocator's free list is not modelled (it can only add)."""
    f32 = FP32_BYTES
    ub = ubatch_tokens
    h = spec.hidden_size
    stream = h * ub * f32
    mask = kv_cells * ub * (bytes_per_element(DType.FP16) if flash_attention else f32)  # FA takes an f16 mask
    heads = spec.num_attention_heads
    scores = 0.0 if flash_attention else heads * kv_cells * ub * f32
    attention = mask + 2 * stream + (stream if flash_attention else scores)
    dense = any(not spec.is_moe_layer(i) for i in range(spec.num_layers))
    ffn_width = 2 * spec.intermediate_size if dense else 0
    if spec.moe is not None:
        m = spec.moe
        ffn_width = max(ffn_width, 2 * m.num_experts_per_token * m.expert_intermediate_size
                        + 2 * m.shared_intermediate_size * m.num_shared_experts + m.num_experts)
    ffn = mask + 2 * stream + ffn_width * ub * f32
    output = (spec.vocab_size + h) * ub * f32 if output_on_gpu else 0.0
    phases = {"attention": attention, "ffn": ffn, "output": output}
    if expert_copy_bytes:
        phases["expert_copy"] = ffn + expert_copy_bytes
    return phases


def llamacpp_compute_buffer_bytes(spec: ModelSpec, *, ubatch_tokens: int, kv_cells: int, flash_attention: bool,
                                  output_on_gpu: bool, expert_copy_bytes: float = 0.0) -> float:
    """llama.cpp's CUDA compute buffer: the peak of `llamacpp_compute_buffer_phases`."""
    return max(llamacpp_compute_buffer_phases(spec, ubatch_tokens=ubatch_tokens, kv_cells=kv_cells,
                                              flash_attention=flash_attention, output_on_gpu=output_on_gpu,
                                              expert_copy_bytes=expert_copy_bytes).values())


def kv_pool_bytes(wl: InferenceWorkload, budget: float, weights: float, overhead: float, act: float,
                  kv_bytes_per_token: float, utilization: float) -> float:
    """The KV cache one rank sizes, by the engine's accounting (`budget` as serving_memory sets it).

    profiled (vLLM):        budget - weights - overhead - activation peak
    static_fraction (SGLang): budget - weights - overhead; activations live outside the pool
    warmup (TGI):           share x (memory free after the warm-up prefill - what the fraction holds
                            back) + the warm-up batch's KV (allocated before the measurement)
    free_fraction (TRT-LLM): fraction x (memory free after the weights and the activation peak)
    Both measure free memory on the device, so the CUDA context is in `overhead` for them."""
    if wl.accounting == "static_fraction":
        return budget - weights - overhead
    if wl.accounting == "warmup":
        warm = wl.warmup_kv_tokens * kv_bytes_per_token
        free_less_reserve = budget - weights - overhead - act - warm  # overhead holds the context here
        return wl.warmup_free_share * free_less_reserve + warm if free_less_reserve > 0 else free_less_reserve
    if wl.accounting == "free_fraction":
        free = budget - weights - overhead - act
        return utilization * free if free > 0 else free
    return budget - weights - overhead - act


def draft_profile_peak_bytes(spec: ModelSpec, draft: ModelSpec, layout: Layout, wl: InferenceWorkload) -> float:
    """The profiling pass's peak while the drafter runs: vLLM V1's `_dummy_run` calls
    `self.drafter.dummy_run(num_tokens)` after the target's forward (vllm/v1/worker/gpu_model_runner.py
    at v0.11.0), so the target's hidden states (tokens x hidden) are still held beside one draft
    layer's transients at the target's tp; the draft's forward samples nothing there."""
    held = wl.max_num_batched_tokens * spec.hidden_size * bytes_per_element(wl.activation_dtype)
    return held + activation_peak_bytes(draft, Layout(tp=layout.tp), wl, last_stage=False)


@dataclass(frozen=True)
class KvAccount:
    """The KV cache as a running request draws on it (the serving simulation's capacity).

    A request holding t tokens takes t + window_charge x min(t, window_tokens) of `capacity_tokens`:
    with vLLM's hybrid manager the pool's blocks serve full-attention and sliding-window groups
    alike, each full group a block per block_size tokens and each sliding group only the blocks its
    window still covers (SlidingWindowManager.remove_skipped_blocks frees the rest), so in units of
    a full group's tokens a sliding group costs window_charge = sliding groups / full groups per
    token, up to the window plus the block it may straddle. Without sliding groups charged apart
    (window_charge 0) every token costs one."""

    capacity_tokens: int
    window_tokens: int = 0
    window_charge: float = 0.0

    def tokens_charged(self, held_tokens: float) -> float:
        return held_tokens + self.window_charge * min(held_tokens, self.window_tokens)

    def sequences_held(self, held_tokens: float) -> int:
        """How many requests of `held_tokens` tokens the cache holds at once."""
        return int(self.capacity_tokens // max(1.0, self.tokens_charged(held_tokens)))

    def equivalent_tokens(self, held_tokens: float) -> float:
        """The capacity in plain tokens for requests of `held_tokens` tokens (each costing one a token)."""
        if not self.window_charge:
            return float(self.capacity_tokens)
        return self.capacity_tokens * held_tokens / max(1.0, self.tokens_charged(held_tokens))


@dataclass(frozen=True)
class KvPool:
    """One rank's KV pool as vLLM sizes and logs it (`vllm_kv_pool`)."""

    tokens: int  # what 'GPU KV cache size: N tokens' prints
    account: KvAccount  # what running requests draw on
    blocks: int  # blocks in the pool (num_gpu_blocks)
    bytes_per_sequence: float  # what one max_model_len request reserves in the pool, padding included
    needed_bytes: float  # V1's start-up check: one max_model_len request's KV over this rank's layers
    concurrency: float  # max_model_len requests the pool holds ('Maximum concurrency ...: Xx')
    concurrency_running: float  # the same with the speculative lookahead slots


def vllm_kv_pool(spec: ModelSpec, wl: InferenceWorkload, kv_layers: Sequence[int], per_layer_token: float,
                 draft_tok_bytes: float, state_bytes: float, kv_bytes: float, max_len: int) -> KvPool:
    """Blocks, logged tokens and concurrency of `kv_bytes` of KV on one rank holding `kv_layers`
    (docs/research/vllm-hybrid-kv.md has the lines at each version):

    hybrid (wl.hybrid_kv_cache, full and sliding-window layers): groups of `size` layers
    (`vllm_kv_cache_groups`) share one pool of blocks = kv // (page x size), page = block_size x
    KV bytes per token per layer; a request takes cdiv(L, block) blocks in each full group and
    `sliding_window_blocks_per_request` in each sliding group (its window plus
    wl.sliding_window_in_flight_batches chunks: two from 0.26); concurrency = blocks / that sum;
    the log prints blocks // groups x block_size (<= 0.20.0) or int(concurrency x L) (>= 0.20.1).
    Every layer sliding (Mistral v0.1) is one group of sliding layers.
    Otherwise every layer holds the whole sequence: blocks = kv // (block_size x KV bytes per token).
    V1's start-up check (check_enough_kv_cache_memory) counts each layer by its own spec, the
    sliding ones by their window, in every V1 release (it runs before the specs are unified)."""
    bs = wl.block_size
    full_blocks = math.ceil(max_len / bs)
    extra = math.ceil((max_len + spec_decode.lookahead_tokens(wl.speculative)) / bs) - full_blocks
    slides = layer_flags(spec)[0]
    sliding = [i for i in kv_layers if slides[i]]
    num_full = len(kv_layers) - len(sliding)
    sw_blocks = (sliding_window_blocks_per_request(spec.sliding_window, max_len, wl.max_num_batched_tokens, bs,
                                                   wl.sliding_window_in_flight_batches)
                 if sliding and spec.sliding_window is not None else full_blocks)
    page = bs * per_layer_token
    tok_bytes = per_layer_token * len(kv_layers) + draft_tok_bytes
    needed = (num_full * full_blocks + len(sliding) * sw_blocks) * page + full_blocks * bs * draft_tok_bytes + state_bytes
    if kv_bytes <= 0:
        return KvPool(0, KvAccount(0), 0, needed, needed, 0.0, 0.0)
    if tok_bytes == 0:
        return KvPool(0, KvAccount(0), 0, needed, needed, math.inf, math.inf)
    pooled = wl.hybrid_kv_cache and sliding and not draft_tok_bytes and not state_bytes
    if pooled:
        kv_all = [i for i in range(spec.num_layers) if not spec.is_linear_attention_layer(i)]
        all_sliding = sum(spec.is_sliding_layer(i) for i in kv_all)
        _, num_full_groups, num_sliding_groups = vllm_kv_cache_groups(len(kv_all) - all_sliding, all_sliding)
        # This rank's layers of each group (vLLM deals a type's layers round-robin over its groups).
        size = max(math.ceil(num_full / num_full_groups) if num_full_groups else 0,
                   math.ceil(len(sliding) / num_sliding_groups))
        blocks = int(kv_bytes // (page * size))
        per_request = num_full_groups * full_blocks + num_sliding_groups * sw_blocks
        conc = blocks / per_request
        conc_running = blocks / (per_request + (num_full_groups + num_sliding_groups) * extra)
        seq_bytes = per_request * page * size
        block_tokens = blocks // (num_full_groups + num_sliding_groups) * bs
        if num_full_groups:
            # At run time a sliding group keeps the blocks its window covers, the block it straddles too.
            window = (math.ceil((spec.sliding_window - 1) / bs) + 1) * bs
            account = KvAccount(blocks * bs // num_full_groups, window, num_sliding_groups / num_full_groups)
        else:  # every layer slides (Mistral v0.1): each token charged, so long requests are over-charged
            account = KvAccount(blocks * bs // num_sliding_groups)
    else:
        blocks = int(kv_bytes // (bs * tok_bytes))
        seq_bytes = full_blocks * bs * tok_bytes + state_bytes
        conc = kv_bytes / seq_bytes
        conc_running = kv_bytes / (seq_bytes + extra * bs * tok_bytes)
        block_tokens = blocks * bs
        account = KvAccount(block_tokens)
        if wl.kv_tokens_reported == "concurrency" and not state_bytes:
            # get_max_concurrency_for_kv_cache_config counts whole blocks: blocks / cdiv(L, block).
            return KvPool(int(blocks / full_blocks * max_len), account, blocks, seq_bytes, needed, conc, conc_running)
    tokens = int(conc * max_len) if wl.kv_tokens_reported == "concurrency" else block_tokens
    return KvPool(tokens, account, blocks, seq_bytes, needed, conc, conc_running)


def iswa_cells(spec: ModelSpec, wl: InferenceWorkload, n_ctx: int) -> int:
    """llama.cpp's cache for the sliding-window layers of a model that mixes them with full ones
    (llama_kv_cache_iswa, src/llama-kv-cache-iswa.cpp): min(n_ctx, the window x the sequences + one
    ubatch, padded to the cache's 256 cells); 0 when the engine or the model has no such cache
    (every layer then holds n_ctx cells). A unified cache, as llama-server's slots share it."""
    if not wl.hybrid_kv_cache or spec.sliding_window is None:
        return 0
    sliding = spec.num_sliding_layers
    if sliding == 0 or sliding == spec.num_layers:
        return 0
    cells = spec.sliding_window * wl.max_num_seqs + wl.max_num_batched_tokens
    return min(n_ctx, math.ceil(cells / wl.block_size) * wl.block_size)


@dataclass(frozen=True)
class ServingMemory:
    ranks: list[RankMemory]
    budget_bytes: float
    kv_bytes_per_token_per_rank: list[float]  # per stage
    kv_capacity_tokens: int  # the minimum over ranks, as the engine's log counts it
    kv_account: KvAccount  # the binding rank's cache as running requests draw on it (the simulation's)
    kv_num_blocks: int
    max_model_len: int
    kv_bytes_per_sequence: float  # the binding rank's bytes for one max_model_len sequence
    max_concurrency: float
    fits: bool
    reason: str | None


def serving_memory(spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload) -> ServingMemory:
    if not spec.lm_head:
        # vLLM and SGLang serve these as pooling models (one forward a request, no decode, no
        # KV cache kept): not what the serving model counts.
        raise ShardplanError(f"{spec.name} has a sequence-classification head ({spec.num_labels} labels): serving "
                             "models a generating (causal LM) head", field="model.head",
                             hint="plan its training with --workload training, or serve the causal-LM checkpoint")
    dense_dtype = wl.activation_dtype
    kv_dtype = wl.kv_cache_dtype or wl.activation_dtype
    kv_elt = bytes_per_element(kv_dtype)
    max_len = wl.max_model_len or spec.max_position_embeddings
    capacity = float(hw.memory_capacity_bytes)
    static = wl.accounting == "static_fraction"
    utilization = static_fraction(wl, layout.tp, layout.pp) if static else wl.gpu_memory_utilization
    context = float(hw.cuda_context_bytes)
    if static:  # SGLang: a fraction of the memory free when the worker starts, after the context
        budget = (capacity - context) * utilization
    elif wl.accounting == "warmup":  # TGI: the device less what the fraction holds back
        budget = capacity * utilization * wl.warmup_total_factor
    elif wl.accounting == "free_fraction":  # TensorRT-LLM: a share of what the device has free
        budget = capacity
    else:
        budget = capacity * utilization
    multi_rank = layout.tp * layout.pp * layout.dp > 1
    graphs = 0.0 if wl.enforce_eager or wl.cuda_graph_max_batch == 0 else float(hw.cuda_graph_bytes)  # none captured
    if wl.accounting == "fixed_context":
        # llama.cpp: ggml-cuda captures its graphs over the compute buffer's tensors (the buffer,
        # counted as activations, is the memory they use; knowledge/engines/llamacpp.yaml
        # cuda_graphs_in_budget): a profile's CUDA-graph pool would count them twice.
        graphs = 0.0
    overhead_detail = {
        "non_torch": float(hw.non_torch_bytes if wl.non_torch_bytes is None else wl.non_torch_bytes),
        "nccl_buffers": float(hw.nccl_buffer_bytes) if multi_rank else 0.0,
        "cuda_graphs": graphs if wl.cuda_graphs_in_budget else 0.0,
    }
    outside = {"cuda_context": float(hw.cuda_context_bytes), "cuda_graphs": 0.0 if wl.cuda_graphs_in_budget else graphs}
    if wl.cuda_context_in_budget:
        overhead_detail["cuda_context"] = outside.pop("cuda_context")
    overhead = sum(overhead_detail.values())
    ranks: list[RankMemory] = []
    per_token: list[float] = []
    reasons: list[str] = []
    capacities: list[tuple[KvPool, float]] = []  # each stage's pool and its KV bytes
    off = offload_memory(spec, layout, wl)  # one stage when offloading (validate_layout)
    for stage in range(layout.pp):
        w = stage_weights(spec, layout, stage, quantization=wl.quantization, dense_dtype=dense_dtype)
        sp = wl.speculative if stage == layout.pp - 1 else None  # the drafter lives on the last stage
        draft_weights = spec_decode.draft_weight_bytes_per_rank(spec, sp, layout, wl.quantization, dense_dtype) if sp else 0.0
        weights = w.bytes + rotary_cache_bytes(spec, dense_dtype) + draft_weights
        weights += off.streamed_buffer_bytes - off.weights_off_gpu_bytes - off.experts_off_gpu_bytes
        per_layer_token = kv_bytes_per_token_per_layer_per_rank(spec, layout.tp, kv_elt)
        draft_tok_bytes = spec_decode.draft_kv_bytes_per_token_per_rank(spec, sp, layout.tp, kv_elt) if sp else 0.0
        # Linear-attention layers keep no KV but one fixed state per sequence (kv.py).
        linear = layer_flags(spec)[1]
        kv_off = set(off.kv_layers_off_gpu)
        kv_layers = [i for i in w.layers if not linear[i] and i not in kv_off]
        tok_bytes = per_layer_token * len(kv_layers) + draft_tok_bytes
        per_token.append(tok_bytes)
        if wl.accounting == "warmup" and stage == layout.pp - 1:
            # TGI reads the free memory with mem_get_info: what the caching allocator reserved, within the
            # memory the shard's allocator may use beside the weights, the context and the warm-up batch's KV.
            room_bytes = capacity * utilization - weights - overhead - wl.warmup_kv_tokens * tok_bytes
            act = warmup_reserved_bytes(spec, layout, wl, room_bytes)
        else:
            act = activation_peak_bytes(spec, layout, wl, last_stage=stage == layout.pp - 1, dummy_sampler=not static)
        if wl.accounting == "fixed_context":  # llama.cpp: ggml's compute buffer, sized for one ubatch
            slot_cells = math.ceil(max_len / wl.block_size) * wl.block_size
            # The output layer is on the GPU whenever -ngl >= 1 (the export's -ngl = layers + 1 -
            # offloaded, at least 1; cost/offload.py with_serving_offload).
            copy = off.largest_expert_tensor_bytes if wl.max_num_batched_tokens >= wl.offload_batch_on_gpu_min_tokens > 0 else 0.0
            act = llamacpp_compute_buffer_bytes(
                spec, ubatch_tokens=wl.max_num_batched_tokens, kv_cells=slot_cells, flash_attention=True,
                output_on_gpu=stage == layout.pp - 1, expert_copy_bytes=copy)
        if stage == 0 and not static:  # the vision tower lives with the embedding on the first stage
            act = vision_profile_peak_bytes(spec, layout.tp, wl.vision_encoder_tokens, wl.vision_kept_tokens, act,
                                            bytes_per_element(wl.activation_dtype))
        if sp is not None and sp.draft is not None and not static:
            act = max(act, draft_profile_peak_bytes(spec, sp.draft, layout, wl))
        kv_bytes = kv_pool_bytes(wl, budget, weights, overhead, act, tok_bytes, utilization)
        host_kv = 0.0
        if wl.accounting == "fixed_context":
            # llama.cpp: a cache of exactly the context asked for (every slot's), padded to 256 cells;
            # with iSWA the sliding layers' cells are only their window's (`iswa_cells`).
            n_ctx = math.ceil(max_len * wl.max_num_seqs / wl.block_size) * wl.block_size
            swa_cells = iswa_cells(spec, wl, n_ctx)

            def cells_of(layer: int) -> int:
                return swa_cells if swa_cells and spec.is_sliding_layer(layer) else n_ctx

            host_kv = sum(cells_of(i) for i in off.kv_layers_off_gpu) * per_layer_token
            allocated = sum(cells_of(i) for i in kv_layers) * per_layer_token + n_ctx * draft_tok_bytes
            if kv_bytes < allocated:
                reasons.append(
                    f"stage {stage}: {wl.engine} allocates a KV cache of {n_ctx:,} tokens "
                    f"({allocated / BYTES_PER_GIB:.2f} GiB) but {max(kv_bytes, 0.0) / BYTES_PER_GIB:.2f} GiB "
                    f"remain beside the weights, compute buffer and overhead; lower the context or offload more layers")
            kv_bytes = allocated
        state_bytes = linear_state_bytes_per_sequence_per_rank(spec, w.layers, layout.tp, kv_elt)
        if wl.accounting == "fixed_context":
            # The cache is the context asked for, wherever its layers live (on the host for layers the
            # CPU runs): n_ctx cells, max_num_seqs slots of max_model_len (padded) each.
            seq_bytes = math.ceil(max_len / wl.block_size) * wl.block_size * tok_bytes + state_bytes
            conc = n_ctx / (math.ceil(max_len / wl.block_size) * wl.block_size)
            pool = KvPool(n_ctx, KvAccount(n_ctx), n_ctx // wl.block_size, seq_bytes, seq_bytes, conc, conc)
        else:
            pool = vllm_kv_pool(spec, wl, kv_layers, per_layer_token, draft_tok_bytes, state_bytes, kv_bytes, max_len)
        capacities.append((pool, kv_bytes))
        kv_alloc = max(kv_bytes, 0.0)
        breakdown = MemoryBreakdown(weights=weights, kv_cache=kv_alloc, activations=act, overhead=overhead)
        detail = {f"weights.{k}": v for k, v in w.bytes_by_component.items()}
        if off.layers:
            detail["weights.offloaded"] = -off.weights_off_gpu_bytes
            if off.streamed_buffer_bytes:
                detail["weights.streamed_layer"] = off.streamed_buffer_bytes
        if off.expert_layers:
            detail["weights.experts_on_host"] = -off.experts_off_gpu_bytes
        detail["weights.rotary_cache"] = rotary_cache_bytes(spec, dense_dtype)
        if sp is not None and sp.method is not spec_decode.SpeculativeMethod.NGRAM:
            detail[f"weights.{'mtp' if sp.method is spec_decode.SpeculativeMethod.MTP else 'draft'}"] = draft_weights
            detail["kv_cache.draft"] = kv_alloc * draft_tok_bytes / tok_bytes if tok_bytes else 0.0
        detail.update({f"overhead.{k}": v for k, v in overhead_detail.items()})
        detail.update({f"outside_budget.{k}": v for k, v in outside.items()})
        ranks.append(
            RankMemory(
                stage=stage,
                layers=(w.layers[0], w.layers[-1]),
                num_ranks=layout.tp * layout.dp,
                breakdown=breakdown,
                detail=detail,
                host_bytes=off.host_bytes + host_kv,
                nvme_bytes=off.nvme_bytes,
            )
        )
        split_problem = (kv_head_split_problem(spec, layout, wl) or speculative_pp_problem(layout, wl)
                         or spec_decode.draft_split_problem(sp, layout.tp)
                         or fp8_block_split_problem(spec, layout, wl) or int4_group_split_problem(spec, layout, wl)
                         or fp8_marlin_split_problem(spec, hw, layout, wl))
        if split_problem is not None:
            reasons.append(f"stage {stage}: {split_problem}")
        elif kv_bytes <= 0 and wl.accounting != "fixed_context":
            reasons.append(
                f"stage {stage}: weights {weights / BYTES_PER_GIB:.2f} GiB + activations {act / BYTES_PER_GIB:.2f} GiB"
                f" + overhead {overhead / BYTES_PER_GIB:.2f} GiB exceed the budget {budget / BYTES_PER_GIB:.2f} GiB"
                f" ({utilization:g} x {capacity / BYTES_PER_GIB:.2f} GiB); no room for a KV cache"
            )
    if off.layers or off.expert_layers:
        on_node = min(layout.tp * layout.dp, hw.gpus_per_node)
        host = max(r.host_bytes for r in ranks) * on_node
        if host > hw.host_memory_bytes_per_node:
            reasons.append(f"the offloaded weights need {host / BYTES_PER_GIB:.1f} GiB of host memory per node, more than "
                           f"the profile's {hw.host_memory_bytes_per_node / BYTES_PER_GIB:.0f} GiB")
        nvme = max(r.nvme_bytes for r in ranks) * on_node
        if nvme > hw.nvme_capacity_bytes_per_node:
            reasons.append(f"the offloaded weights need {nvme / BYTES_PER_GIB:.1f} GiB of NVMe per node, more than the "
                           f"profile's {hw.nvme_capacity_bytes_per_node / BYTES_PER_GIB:.0f} GiB")
    binding = min(capacities, key=lambda c: c[0].concurrency)[0]
    seq_bytes, conc, conc_running = binding.bytes_per_sequence, binding.concurrency, binding.concurrency_running
    short = [c for c in capacities if c[0].needed_bytes > c[1] > 0]  # V1 checks every worker
    tokens_min = min(c[0].tokens for c in capacities)
    blocks_min = min(c[0].blocks for c in capacities)
    account = min((c[0].account for c in capacities), key=lambda a: a.capacity_tokens)
    if not reasons and wl.refusal == "tokens" and tokens_min < max_len:
        reasons.append(
            f"The model's max seq len ({max_len}) is larger than the maximum number of tokens that can be stored in "
            f"KV cache ({tokens_min}). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
            f"initializing the engine."
        )
    if not reasons and wl.refusal == "total_tokens" and tokens_min < max_len:
        reasons.append(
            f"max_total_tokens ({max_len}) is more than the {tokens_min} tokens the KV cache holds after the warm-up: "
            f"the router refuses to start (NotEnoughMemory); lower --max-total-tokens or raise --cuda-memory-fraction"
        )
    if not reasons and wl.refusal == "bytes" and short:
        need_bytes, kv_avail = short[0][0].needed_bytes, short[0][1]
        est_len = int(max_len * kv_avail / need_bytes) // wl.block_size * wl.block_size
        reasons.append(
            f"To serve at least one request with the model's max seq len ({max_len}), "
            f"{need_bytes / BYTES_PER_GIB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({kv_avail / BYTES_PER_GIB:.2f} GiB). Based on the available memory, the estimated maximum "
            f"model length is {est_len}. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
            f"when initializing the engine."
        )
    # SGLang's start checks only that the pool has room; the context and the CUDA graphs it then
    # captures must fit in what the pool leaves (activations share that rest at run time).
    # TGI captures its graphs in the wiggle room and only logs a capture that runs out of memory;
    # TensorRT-LLM's KV is a share of the free memory: the rest holds them.
    beside = sum(outside.values())
    room = capacity - budget
    if wl.accounting == "free_fraction":
        room = min((1 - utilization) * (capacity - r.breakdown.weights - r.breakdown.overhead - r.breakdown.activations)
                   for r in ranks)
    if not reasons and wl.accounting != "warmup" and beside > room:
        what = " and ".join(f"{k.replace('_', ' ')} ({v / BYTES_PER_GIB:.2f} GiB)" for k, v in outside.items() if v)
        reasons.append(
            f"the {what} do not fit beside a budget of {utilization:g} of the device; lower "
            f"gpu_memory_utilization"
        )
    return ServingMemory(
        ranks=ranks,
        budget_bytes=budget,
        kv_bytes_per_token_per_rank=per_token,
        kv_capacity_tokens=tokens_min,
        kv_account=account,
        kv_num_blocks=blocks_min,
        max_model_len=max_len,
        kv_bytes_per_sequence=seq_bytes,
        max_concurrency=conc_running,
        fits=not reasons,
        reason="; ".join(reasons) or None,
    )


INT4_GROUPED = (Quantization.AWQ, Quantization.GPTQ, Quantization.INT4)
ROUTED = "the routed experts' width"


def mlp_widths(spec: ModelSpec, layout: Layout) -> list[tuple[str, int, int]]:
    """(what, width, the ranks it is split over) of each MLP tensor parallelism splits: the dense MLP's
    intermediate_size over tp (where some layer is dense), the routed experts' over the expert
    tensor-parallel degree, the shared experts' over tp. The engines' split checks read these."""
    out: list[tuple[str, int, int]] = []
    moe = spec.moe
    if moe is None or moe.first_dense_layers > 0 or bool(moe.dense_layer_indices) or moe.moe_layer_step > 1:
        out.append(("intermediate_size", spec.intermediate_size, layout.tp))
    if moe is not None:
        out.append((ROUTED, moe.expert_intermediate_size, layout.expert_tp))
        if moe.num_shared_experts:
            out.append(("the shared experts' width", moe.shared_intermediate_size * moe.num_shared_experts, layout.tp))
    return out


def speculative_pp_problem(layout: Layout, wl: InferenceWorkload) -> str | None:
    """Why an engine that runs no speculative decoding under pipeline parallelism (`wl.speculative_with_pp`
    false: SGLang, knowledge/engines/sglang.yaml) cannot start this plan, or None."""
    if wl.speculative_with_pp or wl.speculative is None or layout.pp == 1:
        return None
    return (f"{wl.engine} does not run speculative decoding with pipeline parallelism (pp {layout.pp}): use pp 1, "
            "or drop the speculative decoding")


def kv_head_split_problem(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> str | None:
    """Why an engine that gives each tensor-parallel rank whole KV heads of its own (`wl.kv_heads_copied`
    false: TGI, knowledge/engines/tgi.yaml) cannot start this split, or None: tp must divide the KV
    heads. An MLA model caches one latent per token, not heads."""
    if wl.kv_heads_copied or layout.tp == 1 or spec.mla is not None or spec.kv_heads % layout.tp == 0:
        return None
    return (f"{wl.engine} splits the KV heads over the tensor-parallel ranks without copying them: "
            f"num_key_value_heads {spec.kv_heads} / tp {layout.tp} is not whole heads per rank (use a tp that "
            f"divides {spec.kv_heads}, or an engine that copies KV heads)")


def int4_group_split_problem(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> str | None:
    """Why an engine refuses to load a 4-bit AWQ/GPTQ checkpoint split this way, or None. A row-parallel
    linear's input (the attention output projection's, the dense MLP's and the shared experts' down
    projection's) is split over tp, and each rank's share must be whole quantization groups: vLLM's
    AWQLinearMethod and GPTQLinearMethod.create_weights raise "The input size is not aligned with the
    quantized weight shape. This can be caused by too large tensor parallel size" otherwise
    (vllm/model_executor/layers/quantization/awq.py, gptq.py; Qwen2.5-VL-72B-Instruct-AWQ, whose 29,568
    wide MLP is 115.5 groups of 128 at tp 2: https://github.com/vllm-project/vllm/issues/13980). Qwen's
    72B -AWQ and -GPTQ releases pad the width to 29,696 for this. The routed experts' down projection
    takes the experts' width over the expert tensor-parallel degree, and their kernels need whole groups
    too: vLLM's Marlin MoE path runs a width per rank that is a multiple of max(64, group) only
    (marlin_utils.check_moe_marlin_supports_layer), and the MoE WNA16 kernel it falls back to raises
    "size_k must divisible by BLOCK_SIZE_K" (its block is at least the group): Qwen3-30B-A3B-AWQ (768
    wide) starts at tp 1 and 2 and fails at tp 4 and 8, Qwen3-235B-A22B-GPTQ-Int4 (1,536) at tp 8
    (https://github.com/vllm-project/vllm/issues/17604, vLLM 0.8.5 and 0.9.1); expert parallelism
    keeps whole experts. The group is the checkpoint's own (ModelSpec.checkpoint_group_size) when it
    ships the format, else the 128 the byte model assumes; a per-channel checkpoint (group_size -1) has
    none."""
    if wl.quantization not in INT4_GROUPED or (layout.tp == 1 and layout.expert_tp == 1):
        return None
    shipped = spec.shipped_format in GROUPED_CHECKPOINT_KINDS
    group = spec.checkpoint_group_size if shipped else INT4_GROUP_SIZE
    if group is None:
        return None
    widths = [("the attention output's input", spec.num_attention_heads * spec.attention_head_dim, layout.tp)]
    for name, width, parts in widths + mlp_widths(spec, layout):
        if parts > 1 and (width // parts) % group:
            fix = "expert parallelism, " if name == ROUTED else ""
            return (f"the engine refuses to load the 4-bit checkpoint: {name} {width:,} / {parts} = "
                    f"{width // parts:,} per rank is not whole {group}-wide quantization groups (use a smaller "
                    f"tensor-parallel degree, {fix}or a checkpoint padded for it)")
    return None


# The Marlin GEMM's thread tiles (thread_k, thread_n): vLLM csrc/quantization/gptq_marlin/gptq_marlin.cu
# small_batch_thread_configs {128, 128}, {64, 128}, {128, 64} and large_batch_thread_configs {64, 256},
# {64, 128}, {128, 64}; `is_valid_config` takes one whose thread_k divides the rank's k and whose
# thread_n divides its n.
MARLIN_THREAD_TILES = ((128, 128), (64, 128), (128, 64), (64, 256))


def fp8_marlin_split_problem(spec: ModelSpec, hw: HardwareProfile, layout: Layout,
                             wl: InferenceWorkload) -> str | None:
    """Why FP8 weights on a GPU without FP8 tensor cores cannot be split this way, or None. There the
    engines multiply FP8 weights through the Marlin kernel, weight-only (vLLM's Fp8LinearMethod below
    compute capability 8.9, "W8A16 (weight-only FP8) utilizing Marlin kernels" on Ampere; SGLang and
    TGI likewise), whose repack needs each rank's output width n a multiple of its 64-wide tile and whose
    GEMM a thread tile dividing (k, n) (MARLIN_THREAD_TILES): GLM-4.5V-FP8 at tp 4 on RTX A6000s, vLLM
    0.10.2rc2, "size_n = 5472 is not divisible by tile_n_size = 64" (the dense MLP's gate and up,
    2 x 10,944 / 4; https://github.com/zai-org/GLM-V/issues/178), and GLM-4.5-Air-FP8 at tp 8 on RTX
    3090s (https://github.com/zai-org/GLM-4.5/issues/94); "the limitation of marlin fp8 kernel on
    ampere gpus" (https://github.com/vllm-project/vllm/issues/25079). TGI takes Marlin on Ada too
    (`wl.fp8_marlin_architectures`, knowledge/engines/tgi.yaml fp8_marlin). The dense linears as vLLM
    merges them (q, k and v; gate and up) and the shared experts; the routed experts' Marlin MoE path
    and MLA's projections are not checked here."""
    if wl.quantization is not Quantization.FP8:
        return None
    if DType.FP8 in hw.peak_flops and hw.gpu_architecture not in wl.fp8_marlin_architectures:
        return None
    h, tp = spec.hidden_size, layout.tp
    mats: list[tuple[str, int, int]] = []  # (what, n, k) of one rank
    if spec.mla is None:
        q = spec.num_attention_heads * spec.attention_head_dim // tp
        kv = max(1, spec.kv_heads // tp) * spec.attention_head_dim
        mats += [("the q, k and v projection", q + 2 * kv, h), ("the attention output", h, q)]
    up = 2 if spec.mlp_gated else 1
    names = {"intermediate_size": "the MLP", "the shared experts' width": "the shared experts"}
    for what, width, _ in mlp_widths(spec, layout):
        if what == ROUTED:
            continue
        name = names[what]
        mats += [(f"{name}'s gate and up" if up == 2 else f"{name}'s up", up * width // tp, h),
                 (f"{name}'s down projection", h, width // tp)]
    for what, n, k in mats:
        if n % 64 or not any(k % tk == 0 and n % tn == 0 for tk, tn in MARLIN_THREAD_TILES):
            return (f"FP8 weights run through the Marlin kernel on this GPU, and {what}'s "
                    f"rank share ({n:,} outputs x {k:,} inputs at tp {tp}) fits none of its tiles (n a multiple of 64 "
                    "and a 64/128-wide k and n tile pair: use another tensor-parallel degree or weight format)")
    return None


def fp8_block_split_problem(spec: ModelSpec, layout: Layout, wl: InferenceWorkload) -> str | None:
    """Why the engines refuse to load a block-quantized FP8 checkpoint split this way, or None. Each
    rank's share of an MLP's width (the gate/up projections' outputs, the down projection's input)
    must be a whole number of the checkpoint's weight blocks: vLLM and SGLang raise "Weight
    output_partition_size = 576 is not divisible by weight quantization block_n = 128" for
    DeepSeek-R1 at tp 32 (18,432 / 32; https://github.com/sgl-project/sglang/issues/3491 and #3345),
    and a recipe capped DeepSeek-V4-Pro at tp 8 for the same reason (moe_intermediate_size 3,072 /
    16 = 192; https://github.com/vllm-project/recipes/pull/567). Still so in 2026: vLLM issue #52997
    ("Block-FP8 tensor-parallel shards smaller than a quantization block fail to load", open, with the
    padding fix #52915 open), and the MoE padding of #39046 was closed. Dense MLPs and shared experts
    split over tp, routed experts over the expert tensor-parallel degree."""
    block = spec.fp8_weight_block_size
    if block is None or wl.quantization is not Quantization.FP8:
        return None
    block_width = math.lcm(*block)  # the width is the up projections' output (n) and the down projection's input (k)
    for name, width, parts in mlp_widths(spec, layout):
        if parts > 1 and (width // parts) % block_width:
            return (f"the engine refuses to load the block-quantized FP8 checkpoint: {name} {width:,} / {parts} = "
                    f"{width // parts:,} per rank is not a multiple of its {block_width}-wide weight blocks (use a smaller "
                    "tensor-parallel degree, expert parallelism, or another format)")
    return None
