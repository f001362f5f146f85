"""A multimodal model's vision tower in a serving engine's profiling pass.

The engine runs its largest images through the tower before it sizes the KV cache (how many, by
version: cost/engine.py `profile_vision`), so the tower's activations can set the pass's peak.
The tower is a ViT: every block holds the residual stream and its normed copy beside the larger
of its attention and MLP transients, like a decoder layer (memory_serving.activation_peak_bytes),
and frees them before the next block. vLLM's vision encoders run memory-efficient attention
(xformers, SDPA or FlashAttention varlen over each image: vllm/attention/layer.py
MultiHeadAttention, qwen2_vl.py Qwen2VisionAttention at v0.10.2), so no tokens^2 score matrix
is held. The tower is sharded like the text model over tp (column/row-parallel linears).
"""

from __future__ import annotations

from shardplan.specs.model import ModelSpec, VisionSpec


def vision_block_peak_bytes(v: VisionSpec, tokens: int, tp: int, bytes_per_element: float) -> float:
    """One tower block over `tokens` tokens (every image of the pass together): residual, hidden
    and normed input (3 x tokens x hidden), plus the larger of attention (q, k, v and the output
    before its projection: 4 x tokens x heads x head_dim / tp) and the MLP (fc1 output and its
    activation, or gate, up and their product: 2 or 3 x tokens x intermediate / tp)."""
    stream = 3 * tokens * v.hidden_size
    attn = 4 * tokens * v.num_attention_heads * v.attention_head_dim / tp
    mlp = (3 if v.mlp_gated else 2) * tokens * v.intermediate_size / tp
    return (stream + max(attn, mlp)) * bytes_per_element


def vision_profile_peak_bytes(spec: ModelSpec, tp: int, encoder_tokens: int, kept_tokens: int, text_peak_bytes: float,
                              bytes_per_element: float) -> float:
    """The first stage's peak in a pass that profiles the tower: the tower's block peak with the
    pixel values it embeds (tokens x channels x patch area), or the text pass's peak with the
    encoder outputs still kept (kept rows x the language model's hidden size), the larger."""
    if spec.vision is None or encoder_tokens <= 0:
        return text_peak_bytes
    v = spec.vision
    tower = vision_block_peak_bytes(v, encoder_tokens, tp, bytes_per_element)
    tower += encoder_tokens * v.patch_embedding_inputs * bytes_per_element
    kept = kept_tokens * spec.hidden_size * bytes_per_element
    return max(tower, text_peak_bytes + kept)


__all__ = ["vision_block_peak_bytes", "vision_profile_peak_bytes"]
