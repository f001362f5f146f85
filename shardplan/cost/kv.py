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
