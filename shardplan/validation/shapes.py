"""A model given by its shape (`shape:` in a shipped training row, for a published run of a
model shardplan bundles no config for), written as a Hugging Face config of the family it names,
so that it goes through the same translator as a config.json (shardplan/specs/hf.py)."""

from __future__ import annotations

# `shape:` keys -> the Hugging Face config keys of each family's translator (shardplan/specs/hf.py).
_FAMILY_KEYS = {
    "gpt2": {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn": "n_inner", "vocab": "vocab_size",
             "max_positions": "n_positions", "activation": "activation_function",
             "tied_embeddings": "tie_word_embeddings"},
    "opt": {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads", "ffn": "ffn_dim",
            "vocab": "vocab_size", "max_positions": "max_position_embeddings", "activation": "activation_function",
            "tied_embeddings": "tie_word_embeddings", "embed_proj": "word_embed_proj_dim",
            "pre_ln": "do_layer_norm_before"},
    "falcon": {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "ffn": "ffn_hidden_size", "vocab": "vocab_size", "max_positions": "max_position_embeddings",
               "activation": "activation", "tied_embeddings": "tie_word_embeddings", "bias": "bias"},
}
_LLAMA_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size",
               "head_dim": "head_dim", "max_positions": "max_position_embeddings", "activation": "hidden_act",
               "tied_embeddings": "tie_word_embeddings", "bias": "attention_bias"}
_SHAPE_KEYS = {"layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "gated_mlp", "family", "head_dim",
               "max_positions", "activation", "tied_embeddings", "bias", "positions", "overrides", "notes",
               "embed_proj", "pre_ln"}


def shape_config(shape: dict) -> dict:
    """A Hugging Face config dict for a `shape:` block, so that the model goes through the same
    translator as a config.json. `family` picks the layout (default: llama for a gated MLP; gpt2 --
    LayerNorm, learned positions, biases everywhere, plain MLP -- otherwise; falcon with
    `positions: alibi` is BLOOM's layout: LayerNorm, ALiBi, biases, sequential residual; opt takes
    `embed_proj` (word_embed_proj_dim) and `pre_ln` (do_layer_norm_before));
    llama/qwen2/gemma take kv_heads, head_dim and `bias` (q/k/v/o bias; qwen2 has q/k/v bias only).
    What no family expresses goes in `overrides:`, ModelSpec fields set after the translation."""
    unknown = set(shape) - _SHAPE_KEYS
    if unknown:
        raise ValueError(f"shape: unknown keys {sorted(unknown)}")
    positions = shape.get("positions")
    family = shape.get("family") or ("llama" if shape.get("gated_mlp") else
                                     "falcon" if positions == "alibi" else "gpt2")
    gated = family in ("llama", "qwen2", "gemma")
    if bool(shape.get("gated_mlp", gated)) != gated and "mlp_gated" not in (shape.get("overrides") or {}):
        raise ValueError(f"shape: gated_mlp {shape.get('gated_mlp')} does not fit family {family}")
    if family in ("gpt2", "opt", "falcon") and shape.get("kv_heads", shape["heads"]) != shape["heads"]:
        raise ValueError(f"shape: family {family} has no grouped-query attention; give family llama and "
                         "overrides such as {mlp_gated: false, norm_type: layernorm, mlp_bias: true}")
    keys = _FAMILY_KEYS.get(family, _LLAMA_KEYS)
    cfg = {"model_type": family, **{keys[k]: v for k, v in shape.items() if k in keys and v is not None}}
    if family == "falcon":
        cfg.update(alibi=positions == "alibi", parallel_attn=False, multi_query=False,
                   new_decoder_architecture=False, bias=shape.get("bias", True))
    return cfg


__all__ = ["shape_config"]
