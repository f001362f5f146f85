"""Which models a target builds at all, whatever the layout: torchtitan's own model definitions
(a table of flavors), transformers' module names for accelerate's device_map, the model flags
of Megatron's GPT model, and what verify's model builds. The exporters and verify refuse with
these, and `recommend --target` (and `runs_on`) reads them without importing an exporter.

Pure: data and predicates over a ModelSpec (no yaml, rich, typer, torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shardplan.specs.model import ModelSpec, NormType, PositionEmbedding, QKNorm


@dataclass(frozen=True)
class ModelRefusal:
    field: str  # the manifest field it names (model, model.norm_type, ...)
    says: str  # what is missing, in words
    hint: str  # the fix


# torchtitan 0.2.2 models/<name>/__init__.py flavors: (family, layers, hidden, heads, kv heads) -> (name, flavor)
TORCHTITAN_FLAVORS: dict[tuple[str, int, int, int, int], tuple[str, str]] = {
    ("llama", 32, 4096, 32, 8): ("llama3", "8B"),
    ("llama", 80, 8192, 64, 8): ("llama3", "70B"),
    ("llama", 126, 16384, 128, 8): ("llama3", "405B"),
    ("qwen3", 28, 1024, 16, 8): ("qwen3", "0.6B"),
    ("qwen3", 28, 2048, 16, 8): ("qwen3", "1.7B"),
    ("qwen3", 36, 2560, 32, 8): ("qwen3", "4B"),
    ("qwen3", 36, 4096, 32, 8): ("qwen3", "8B"),
    ("qwen3", 40, 5120, 40, 8): ("qwen3", "14B"),
    ("qwen3", 64, 5120, 64, 8): ("qwen3", "32B"),
    ("qwen3_moe", 48, 2048, 32, 4): ("qwen3", "30B-A3B"),
    ("qwen3_moe", 94, 4096, 64, 4): ("qwen3", "235B-A22B"),
    ("deepseek_v3", 61, 7168, 128, 128): ("deepseek_v3", "671B"),
}

# model_type -> (linears reading the attention norm's output, linears reading the MLP norm's output)
# where transformers' modeling_<type>.py fuses the projections: GPT2Attention.c_attn and GPT2MLP.c_fc;
# GPTNeoXAttention.query_key_value and GPTNeoXMLP.dense_h_to_4h; FalconAttention.query_key_value and
# FalconMLP.dense_h_to_4h; Phi3Attention.qkv_proj and Phi3MLP.gate_up_proj. Every other family projects
# q, k and v apart (Llama-like attention), or q_a/q and kv_a (MLA), and gate and up apart.
HF_FUSED_NORM_READERS: dict[str, tuple[int, int]] = {
    "gpt2": (1, 1),
    "gpt_neox": (1, 1),
    "falcon": (1, 1),
    "phi3": (1, 1),
}


def hf_norm_readers(spec: ModelSpec) -> tuple[int, int]:
    """How many linear layers read each norm's output in transformers' implementation of `spec`
    (attention side, dense MLP side): under autocast over fp32 weights each casts that fp32 output
    to bf16 itself and saves its own copy."""
    fused = HF_FUSED_NORM_READERS.get(spec.model_type)
    if fused is not None:
        return fused
    return (2 if spec.mla is not None else 3), (2 if spec.mlp_gated else 1)


# Families whose eager attention in transformers runs the softmax in the scores' own dtype:
# GPT2Attention (`nn.functional.softmax(attn_weights, dim=-1)`, then `.type(value.dtype)`) and Falcon
# (`F.softmax(..., dtype=hidden_states.dtype)`) in transformers 5.x. Every other family shardplan
# translates keeps transformers' `eager_attention_forward` rule, `softmax(attn_weights, dim=-1,
# dtype=torch.float32).to(query.dtype)` (modeling_llama.py, and modeling_opt.py, modeling_bloom.py,
# modeling_gpt_neox.py, modeling_mistral.py, modeling_qwen2.py, modeling_gemma.py alike): the softmax's
# fp32 output is what its backward saves, and the 16-bit copy is what the product with V saves.
# (transformers 4.x's OPTAttention upcast only under fp16: "upcast to fp32 if the weights are in fp16".)
HF_EAGER_SOFTMAX_IN_SCORES_DTYPE = frozenset({"gpt2", "falcon"})


def hf_eager_softmax_fp32(spec: ModelSpec | None, autocast: bool) -> bool:
    """Whether transformers' eager attention keeps an fp32 softmax output for backward: always under
    CUDA autocast (softmax is on its fp32 list: torch docs, "Automatic Mixed Precision", CUDA ops that
    can autocast to float32), else by the family's code (`HF_EAGER_SOFTMAX_IN_SCORES_DTYPE`); a model
    with no family known is taken as transformers' common rule."""
    if autocast:
        return True
    return spec is None or spec.model_type not in HF_EAGER_SOFTMAX_IN_SCORES_DTYPE


# model_type -> (embedding modules, "<prefix>.{i}" of block i, modules after the blocks, block class)
# (transformers' modeling_<type>.py: the submodule names of <Type>ForCausalLM)
_LLAMA_LIKE = (["model.embed_tokens", "model.rotary_emb"], "model.layers.{i}", ["model.norm", "lm_head"])
HF_MODULES: dict[str, tuple[list[str], str, list[str], str]] = {
    "llama": (*_LLAMA_LIKE, "LlamaDecoderLayer"),
    "mistral": (*_LLAMA_LIKE, "MistralDecoderLayer"),
    "mixtral": (*_LLAMA_LIKE, "MixtralDecoderLayer"),
    "qwen2": (*_LLAMA_LIKE, "Qwen2DecoderLayer"),
    "qwen2_moe": (*_LLAMA_LIKE, "Qwen2MoeDecoderLayer"),
    "qwen3": (*_LLAMA_LIKE, "Qwen3DecoderLayer"),
    "qwen3_moe": (*_LLAMA_LIKE, "Qwen3MoeDecoderLayer"),
    "gemma": (*_LLAMA_LIKE, "GemmaDecoderLayer"),
    "gemma2": (*_LLAMA_LIKE, "Gemma2DecoderLayer"),
    "deepseek_v3": (*_LLAMA_LIKE, "DeepseekV3DecoderLayer"),
    "phi3": (*_LLAMA_LIKE, "Phi3DecoderLayer"),
    "gpt_neox": (["gpt_neox.embed_in", "gpt_neox.rotary_emb"], "gpt_neox.layers.{i}",
                 ["gpt_neox.final_layer_norm", "embed_out"], "GPTNeoXLayer"),
    "gpt2": (["transformer.wte", "transformer.wpe"], "transformer.h.{i}", ["transformer.ln_f", "lm_head"], "GPT2Block"),
    "falcon": (["transformer.word_embeddings", "transformer.rotary_emb"], "transformer.h.{i}",
               ["transformer.ln_f", "lm_head"], "FalconDecoderLayer"),
}

# Megatron-LM core_v0.19.0 --position-embedding-type for each of ours
MEGATRON_POSITIONS = {PositionEmbedding.ROPE: "rope", PositionEmbedding.LEARNED: "learned_absolute",
                      PositionEmbedding.NONE: "none"}


def torchtitan_key(spec: ModelSpec) -> tuple[str, int, int, int, int]:
    return (spec.model_type, spec.num_layers, spec.hidden_size, spec.num_attention_heads,
            spec.num_kv_heads or spec.num_attention_heads)


def torchtitan(spec: ModelSpec) -> ModelRefusal | None:
    if not spec.lm_head:
        return ModelRefusal("model.head", "torchtitan trains causal language models, not a sequence-classification head",
                            "export --to deepspeed or accelerate (transformers' *ForSequenceClassification)")
    if torchtitan_key(spec) in TORCHTITAN_FLAVORS:
        return None
    known = ", ".join(sorted({f"{n} {f}" for n, f in TORCHTITAN_FLAVORS.values()}))
    return ModelRefusal("model", f"torchtitan trains its own model definitions and none has this model's shape "
                        f"({spec.model_type}, {spec.num_layers} layers, hidden {spec.hidden_size})",
                        f"plan one of {known}, or export --to megatron or torchrun")


def accelerate(spec: ModelSpec) -> ModelRefusal | None:
    if spec.model_type in HF_MODULES:
        return None
    return ModelRefusal("model.source", f"no transformers module names known for model_type '{spec.model_type}'",
                        f"use a model of type {', '.join(sorted(HF_MODULES))}")


def megatron(spec: ModelSpec) -> ModelRefusal | None:
    """The first feature of the model Megatron's GPT model has no flag for."""
    unsupported = [what for what, present in [
        ("multi-head latent attention", spec.mla is not None), ("linear attention", spec.linear_attention is not None),
        ("a vision tower", spec.vision is not None), ("sliding-window layers", spec.sliding_window is not None),
        ("attention sinks", spec.attention_sinks), ("parallel residual blocks", spec.parallel_residual),
        ("a sequence-classification head", not spec.lm_head),
        ("an lm_head bias", spec.lm_head_bias), ("a full-width qk norm", spec.qk_norm == QKNorm.FULL),
        (f"{spec.position_embedding.value} positions", spec.position_embedding not in MEGATRON_POSITIONS),
        (f"a gated {spec.hidden_act} MLP", spec.mlp_gated and spec.hidden_act != "silu"),
        ("biases on some linear layers only", spec.mlp_bias != spec.o_bias),
        ("MoE layers at a step or dense indices", spec.moe is not None and (spec.moe.moe_layer_step != 1
                                                                          or bool(spec.moe.dense_layer_indices))),
    ] if present]
    if not unsupported:
        return None
    return ModelRefusal("model", f"{unsupported[0]} has no pretrain_gpt.py flag",
                        "export --to torchrun with your own training script")


def verify(spec: ModelSpec) -> ModelRefusal | None:
    """The first feature verify's model (a Llama-style dense or MoE decoder) does not build."""
    unsupported = [
        (spec.mla is not None, "model", "multi-head latent attention (MLA)"),
        (not spec.lm_head, "model.head", "sequence-classification heads"),
        (spec.norm_type is not NormType.RMSNORM, "model.norm_type", "LayerNorm models"),
        (spec.position_embedding is not PositionEmbedding.ROPE, "model.position_embedding", "non-rotary position embeddings"),
        (spec.rotary_fraction != 1.0, "model.rotary_fraction", "partial rotary embeddings"),
        (spec.sliding_window is not None, "model.sliding_window", "sliding-window attention"),
        (spec.parallel_residual, "model.parallel_residual", "parallel-residual blocks"),
        (spec.qk_norm is not QKNorm.NONE, "model.qk_norm", "q/k norms"),
        (spec.qkv_bias or spec.o_bias or spec.mlp_bias or spec.lm_head_bias, "model", "linear biases"),
        (not spec.mlp_gated or spec.hidden_act not in ("silu", "swiglu"), "model.hidden_act", "MLPs other than SwiGLU"),
        (spec.num_norms_per_layer != 2, "model.num_norms_per_layer", "blocks without exactly two norms"),
        (spec.moe is not None and (spec.moe.num_shared_experts > 0 or spec.moe.router_bias), "model.moe",
         "shared experts or router biases"),
    ]
    for bad, field, what in unsupported:
        if bad:
            return ModelRefusal(field, f"verify does not run {what} yet",
                                "verify runs Llama-style dense and MoE decoders; check this model with estimate")
    return None


# target -> its check (targets not named build any model shardplan loads); fsdp runs verify's model
BY_TARGET: dict[str, Callable[[ModelSpec], ModelRefusal | None]] = {
    "torchtitan": torchtitan, "accelerate": accelerate, "megatron": megatron, "fsdp": verify,
}


def model_refusal(target: str, spec: ModelSpec) -> ModelRefusal | None:
    """Why `target` cannot build this model whatever the layout, or None."""
    check = BY_TARGET.get(target)
    return None if check is None else check(spec)


__all__ = ["BY_TARGET", "HF_MODULES", "MEGATRON_POSITIONS", "ModelRefusal", "TORCHTITAN_FLAVORS", "accelerate",
           "megatron", "model_refusal", "torchtitan", "torchtitan_key", "verify"]
