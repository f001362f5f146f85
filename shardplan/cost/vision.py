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
from shardplan.units import BYTES_PER_ELEMENT, DType


def vision_block_peak_bytes(v: VisionSpec, tokens: int, tp: int, bytes_per_element: float) -> float:
    """One tower block over `tokens` tokens (every image of the pass together): residual, hidden
    and normed input (3 x tokens x hidden), plus the larger of attention (q, k, v and the output
    before its projection: 4 x tokens x heads x head_dim / tp) and the MLP (fc1 output and its
    activation, or gate, up and their product: 2 or 3 x tokens x intermediate / tp)."""
    stream = 3 * tokens * v.hidden_size
    attn = 4 * tokens * v.num_attention_heads * v.attention_head_dim / tp
    mlp = (3 if v.mlp_gated else 2) * tokens * v.intermediate_size / tp
    return (stream + max(attn, mlp)) * bytes_per_element


TILE_PAD_TOKENS = 8  # vLLM's MllamaVisionModel pads each tile's tokens to a multiple of 8


def tiled_tower_extra_bytes(v: VisionSpec, encoder_tokens: int, bytes_per_element: float) -> float:
    """What a tiled tower (Mllama: `num_tiles_max` > 1) holds beyond its blocks while it runs, as vLLM
    V0 runs it (model_executor/models/mllama.py at v0.6.3.post1 and v0.6.6.post1):

      the attention mask over all tiles of each image, built by _prepare_aspect_ratio_attention_mask
      as a dense (images, 1, T, T) tensor in the model dtype, T = tiles x (tokens per tile padded to
      a multiple of 8), alive through both transformers;
      the pixel values in fp32 twice: the batch the runner hands over and the zero-padded
      (images, 1, tiles, 3, size, size) copy _parse_and_validate_image_input builds (patch inputs
      = channels x patch^2 per patch, the class token has none).
    The intermediate hidden states the tower keeps for its output (`num_kept_hidden_states`) are
    not added: the one published split of such a pass (PR #12126, 128 images on an H100: activation
    peak 36.63 GiB) is met without them."""
    if v.num_tiles_max <= 1 or v.image_encoder_tokens_max is None:
        return 0.0
    images = encoder_tokens // v.image_encoder_tokens_max
    per_tile = v.image_encoder_tokens_max // v.num_tiles_max
    side = v.num_tiles_max * -(-per_tile // TILE_PAD_TOKENS) * TILE_PAD_TOKENS
    mask = images * side * side * bytes_per_element
    pixels = 2 * images * v.num_tiles_max * (per_tile - 1) * v.patch_embedding_inputs * BYTES_PER_ELEMENT[DType.FP32]
    return mask + pixels


def tower_tokens(v: VisionSpec, encoder_tokens: int) -> int:
    """Tokens the tower's blocks run over: a tiled tower pads each tile to a multiple of 8 tokens."""
    if v.num_tiles_max <= 1 or v.image_encoder_tokens_max is None:
        return encoder_tokens
    per_tile = v.image_encoder_tokens_max // v.num_tiles_max
    padded = -(-per_tile // TILE_PAD_TOKENS) * TILE_PAD_TOKENS
    return encoder_tokens // per_tile * padded


def vision_profile_peak_bytes(spec: ModelSpec, tp: int, encoder_tokens: int, kept_tokens: int, text_peak_bytes: float,
                              bytes_per_element: float) -> float:
    """The first stage's peak in a pass that profiles the tower: the tower's block peak with the
    pixel values it embeds (tokens x channels x patch area; a tiled tower's mask and fp32 pixel
    buffers instead, `tiled_tower_extra_bytes`), or the text pass's peak with the encoder outputs
    still kept (kept rows x the language model's hidden size), the larger."""
    if spec.vision is None or encoder_tokens <= 0:
        return text_peak_bytes
    v = spec.vision
    tower = vision_block_peak_bytes(v, tower_tokens(v, encoder_tokens), tp, bytes_per_element)
    extra = tiled_tower_extra_bytes(v, encoder_tokens, bytes_per_element)
    tower += extra if extra else encoder_tokens * v.patch_embedding_inputs * bytes_per_element
    kept = kept_tokens * spec.hidden_size * bytes_per_element
    return max(tower, text_peak_bytes + kept)


__all__ = ["tiled_tower_extra_bytes", "tower_tokens", "vision_block_peak_bytes", "vision_profile_peak_bytes"]
