"""KV-cache size per token and per sequence.

Standard attention stores K and V: 2 * num_kv_heads * head_dim elements per token per layer.
MLA (DeepSeek-V2 Sec. 2.1.2) stores the compressed latent and the decoupled rotary key:
kv_lora_rank + qk_rope_head_dim elements per token per layer, shared by all heads.

Per-layer patterns (ModelSpec.layer_type) bound what one sequence keeps:
- a sliding-window layer keeps at most `sliding_window` tokens (Mistral, Gemma 2/3, gpt-oss);
- a chunked-attention layer attends within blocks of `attention_chunk_size` tokens and keeps at
  most that many (Llama 4's local layers, transformers' ChunkedSlidingLayer cache);
- a linear-attention layer keeps no KV at all but a fixed-size recurrent state per sequence
  (Qwen3-Next Gated DeltaNet: LinearAttentionSpec.state_elements_per_sequence).
Attention sinks (gpt-oss) are learned per-head logits, parameters rather than cached tokens:
they add nothing here.
"""

from __future__ import annotations

from shardplan.specs.model import LayerType, ModelSpec


def kv_elements_per_token_per_layer(spec: ModelSpec) -> int:
    """K/V elements one token adds to one attention layer (linear-attention layers add none)."""
    if spec.mla is not None:
        return spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    return 2 * spec.kv_heads * spec.attention_head_dim


def num_kv_layers(spec: ModelSpec) -> int:
    """Layers that keep a KV cache: all but the linear-attention ones."""
    return sum(not spec.is_linear_attention_layer(i) for i in range(spec.num_layers))


def kv_cache_bytes_per_token(spec: ModelSpec, bytes_per_element: float) -> float:
    """Whole model, every layer that keeps K/V, for a context shorter than any window (a
    sliding-window or chunked layer still stores a token it attends to). Linear-attention
    layers add nothing per token; see `kv_cache_bytes_per_sequence` for their state and for
    the windows' caps."""
    return kv_elements_per_token_per_layer(spec) * num_kv_layers(spec) * bytes_per_element


def kv_tokens_kept(spec: ModelSpec, layer_index: int, num_tokens: int) -> int:
    """Tokens of a `num_tokens`-long sequence that layer `layer_index` keeps K/V for."""
    kind = spec.layer_type(layer_index)
    if kind is LayerType.LINEAR:
        return 0
    if kind is LayerType.SLIDING and spec.sliding_window is not None:
        return min(num_tokens, spec.sliding_window)
    if kind is LayerType.CHUNKED and spec.attention_chunk_size is not None:
        return min(num_tokens, spec.attention_chunk_size)
    return num_tokens


def linear_state_elements_per_sequence(spec: ModelSpec) -> int:
    """Recurrent state of all linear-attention layers for one sequence, whatever its length."""
    if spec.linear_attention is None:
        return 0
    per_layer = spec.linear_attention.state_elements_per_sequence
    return per_layer * sum(spec.is_linear_attention_layer(i) for i in range(spec.num_layers))


def kv_cache_bytes_per_sequence(spec: ModelSpec, num_tokens: int, bytes_per_element: float,
                                state_bytes_per_element: float | None = None) -> float:
    """Cache of one sequence of `num_tokens` tokens: K/V of the tokens each layer keeps (capped
    at the window or chunk) plus the linear-attention layers' constant state, stored at
    `state_bytes_per_element` (default: as the KV cache)."""
    per_token = kv_elements_per_token_per_layer(spec)
    kv = sum(kv_tokens_kept(spec, i, num_tokens) for i in range(spec.num_layers)) * per_token * bytes_per_element
    state_elt = bytes_per_element if state_bytes_per_element is None else state_bytes_per_element
    return kv + linear_state_elements_per_sequence(spec) * state_elt


def vllm_kv_cache_groups(num_full_layers: int, num_sliding_layers: int) -> tuple[int, int, int]:
    """vLLM V1's hybrid KV cache groups: (layers per group, full-attention groups, sliding-window groups).

    Each attention type is split into groups of the same size, the smaller type's layer count, the
    last group of a type padded with empty layers: Gemma 3 27B's 10 full and 52 sliding layers
    make groups of 10, one full and six sliding (the last of 2 layers + 8 padding)
    (vllm/v1/core/kv_cache_utils.py `_get_kv_cache_config_uniform_page_size` at v0.9.1 lines
    825-836; `_get_kv_cache_groups_uniform_page_size` at v0.11.0 lines 977-1001). From 0.12.0
    the larger count is the group size when it is under 1.25x (1.5x from 0.18.0) the smaller
    (one group per type, the smaller padded): not modelled, it only differs when the counts are
    that close but unequal (a drafter's extra layer)."""
    counts = [n for n in (num_full_layers, num_sliding_layers) if n > 0]
    if not counts:
        return 0, 0, 0
    size = min(counts)
    return size, -(-num_full_layers // size), -(-num_sliding_layers // size)


def sliding_window_blocks_per_request(sliding_window: int, max_len: int, batched_tokens: int, block_size: int,
                                      in_flight_batches: int = 1) -> int:
    """Blocks one request of `max_len` tokens holds in a sliding-window layer at most: the last
    window - 1 computed tokens plus `in_flight_batches` chunks of up to `batched_tokens` new ones,
    never more than max_len, plus one block because the window need not start at a block boundary
    (vllm/v1/kv_cache_interface.py SlidingWindowSpec.max_memory_usage_bytes, v0.9.1 lines
    138-154; max_admission_blocks_per_request at v0.21.0 lines 443-463 with one chunk; from v0.26.0,
    lines 567-590, with VllmConfig.max_in_flight_tokens = max_concurrent_batches x batched_tokens,
    config/vllm.py 512-533: two batches with async scheduling, its default)."""
    num_tokens = min(sliding_window - 1 + in_flight_batches * batched_tokens, max_len)
    return -(-num_tokens // block_size) + 1
