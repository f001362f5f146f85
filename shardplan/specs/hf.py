"""Translate a Hugging Face `config.json` (a dict) into a ModelSpec.

Each family's translator reads the keys its transformers config class defines, with that
class's defaults where a key is absent, and the structural facts its modelling code
hard-codes (Qwen2's q/k/v bias, Gemma 2's four norms per layer). Pure: takes a dict,
returns a ModelSpec or raises UnsupportedModelError/ValueError with the field named.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardplan.errors import UnsupportedModelError
from shardplan.specs.model import (
    MLASpec,
    ModelSpec,
    MoESpec,
    NormType,
    PositionEmbedding,
    QKNorm,
)

Config = Mapping[str, Any]


class MissingField(ValueError):
    """A key the family needs is absent from the config."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _req(cfg: Config, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise MissingField(key)
    return cfg[key]


def _common(cfg: Config, name: str, model_type: str) -> dict[str, Any]:
    """Keys shared by the Llama-like families."""
    hidden = _req(cfg, "hidden_size")
    heads = _req(cfg, "num_attention_heads")
    return dict(
        name=name,
        model_type=model_type,
        vocab_size=_req(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=_req(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim"),
        intermediate_size=_req(cfg, "intermediate_size"),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=_rope_theta(cfg),
        hidden_act=cfg.get("hidden_act", "silu"),
        dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
    )


def _rope_theta(cfg: Config) -> float | None:
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(cfg.get("rope_parameters"), Mapping):
        theta = cfg["rope_parameters"].get("rope_theta")
    return float(theta) if theta is not None else None


def _sliding(cfg: Config) -> int | None:
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _llama(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "llama")
    bias = bool(cfg.get("attention_bias", False))
    d.update(
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    return d


def _mistral(cfg: Config, name: str) -> dict[str, Any]:
    d = _llama(cfg, name)
    d.update(model_type="mistral", sliding_window=_sliding(cfg))
    return d


def _mixtral(cfg: Config, name: str) -> dict[str, Any]:
    d = _mistral(cfg, name)
    d.update(
        model_type="mixtral",
        moe=MoESpec(
            num_experts=_req(cfg, "num_local_experts"),
            num_experts_per_token=_req(cfg, "num_experts_per_tok"),
            expert_intermediate_size=_req(cfg, "intermediate_size"),
        ),
    )
    return d


def _granitemoe(cfg: Config, name: str) -> dict[str, Any]:
    """IBM Granite 3.x MoE (GraniteMoeForCausalLM): Mixtral's block (top-k routed SwiGLU experts of
    intermediate_size, no shared expert) with tied embeddings; its multipliers change no shape."""
    d = _mixtral(cfg, name)
    d.update(model_type="granitemoe", sliding_window=None,
             tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    return d


def _qwen2(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "qwen2")
    # Qwen2Attention hard-codes bias=True on q/k/v and bias=False on o_proj.
    d.update(qkv_bias=True, o_bias=False, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    if cfg.get("use_sliding_window"):
        d["sliding_window"] = _sliding(cfg)
    return d


def _qwen_moe_layers(cfg: Config) -> dict[str, Any]:
    return dict(
        moe_layer_step=int(cfg.get("decoder_sparse_step", 1) or 1),
        dense_layer_indices=tuple(cfg.get("mlp_only_layers") or ()),
    )


def _qwen2_moe(cfg: Config, name: str) -> dict[str, Any]:
    d = _qwen2(cfg, name)
    shared = cfg.get("shared_expert_intermediate_size") or 0
    d.update(
        model_type="qwen2_moe",
        moe=MoESpec(
            num_experts=_req(cfg, "num_experts"),
            num_experts_per_token=_req(cfg, "num_experts_per_tok"),
            expert_intermediate_size=_req(cfg, "moe_intermediate_size"),
            num_shared_experts=1 if shared else 0,
            shared_expert_intermediate_size=shared or None,
            shared_expert_gate=bool(shared),
            **_qwen_moe_layers(cfg),
        ),
    )
    return d


def _qwen3(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "qwen3")
    bias = bool(cfg.get("attention_bias", False))
    d.update(
        head_dim=cfg.get("head_dim") or 128,  # Qwen3Config default
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=QKNorm.PER_HEAD,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    if cfg.get("use_sliding_window"):
        d["sliding_window"] = _sliding(cfg)
    return d


def _qwen3_moe(cfg: Config, name: str) -> dict[str, Any]:
    d = _qwen3(cfg, name)
    d.update(
        model_type="qwen3_moe",
        moe=MoESpec(
            num_experts=_req(cfg, "num_experts"),
            num_experts_per_token=_req(cfg, "num_experts_per_tok"),
            expert_intermediate_size=_req(cfg, "moe_intermediate_size"),
            **_qwen_moe_layers(cfg),
        ),
    )
    return d


def _gemma(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "gemma")
    bias = bool(cfg.get("attention_bias", False))
    d.update(
        head_dim=cfg.get("head_dim") or 256,
        qkv_bias=bias,
        o_bias=bias,
        mlp_gated=True,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )
    return d


def _gemma2(cfg: Config, name: str) -> dict[str, Any]:
    d = _gemma(cfg, name)
    # Gemma2DecoderLayer: input, post_attention, pre_feedforward, post_feedforward norms;
    # even layers slide over `sliding_window` tokens, odd layers attend globally.
    d.update(model_type="gemma2", num_norms_per_layer=4, sliding_window=_sliding(cfg) or 4096, global_layer_every=2)
    return d


def _gpt2(cfg: Config, name: str) -> dict[str, Any]:
    hidden = _req(cfg, "n_embd")
    return dict(
        name=name,
        model_type="gpt2",
        vocab_size=_req(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=_req(cfg, "n_layer"),
        num_attention_heads=_req(cfg, "n_head"),
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        mlp_gated=False,
        hidden_act=cfg.get("activation_function", "gelu_new"),
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
        norm_type=NormType.LAYERNORM,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        position_embedding=PositionEmbedding.LEARNED,
        max_position_embeddings=cfg.get("n_positions", 1024),
        dtype=str(cfg.get("torch_dtype") or "float32"),
    )


def _gpt_neox(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "gpt_neox")
    bias = bool(cfg.get("attention_bias", True))
    d.update(
        num_kv_heads=None,
        head_dim=None,
        mlp_gated=False,
        hidden_act=cfg.get("hidden_act", "gelu"),
        mlp_bias=True,
        qkv_bias=bias,
        o_bias=bias,
        norm_type=NormType.LAYERNORM,
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
        rotary_fraction=float(cfg.get("rotary_pct", cfg.get("partial_rotary_factor", 0.25))),
        rope_theta=float(cfg.get("rotary_emb_base", cfg.get("rope_theta", 10000))),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    return d


def _falcon(cfg: Config, name: str) -> dict[str, Any]:
    hidden = _req(cfg, "hidden_size")
    heads = _req(cfg, "num_attention_heads")
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    parallel = bool(cfg.get("parallel_attn", True))
    if new_arch:
        kv = cfg.get("num_kv_heads") or heads
        # FalconDecoderLayer: ln_attn + ln_mlp unless num_ln_in_parallel_attn == 1.
        norms = 1 if cfg.get("num_ln_in_parallel_attn") == 1 else 2
    else:
        kv = 1 if cfg.get("multi_query", True) else heads
        norms = 1 if parallel else 2
    bias = bool(cfg.get("bias", False))
    alibi = bool(cfg.get("alibi", False))
    return dict(
        name=name,
        model_type="falcon",
        vocab_size=_req(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=_req(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=cfg.get("head_dim"),
        intermediate_size=cfg.get("ffn_hidden_size") or 4 * hidden,
        mlp_gated=False,
        hidden_act=cfg.get("activation", "gelu"),
        mlp_bias=bias,
        qkv_bias=bias,
        o_bias=bias,
        norm_type=NormType.LAYERNORM,
        num_norms_per_layer=norms,
        parallel_residual=parallel or new_arch,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        position_embedding=PositionEmbedding.ALIBI if alibi else PositionEmbedding.ROPE,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        dtype=str(cfg.get("torch_dtype") or "bfloat16"),
    )


def _phi3(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "phi3")
    d.update(
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rotary_fraction=float(cfg.get("partial_rotary_factor", 1.0)),
        sliding_window=_sliding(cfg),
    )
    return d


def _deepseek(cfg: Config, name: str, model_type: str) -> dict[str, Any]:
    hidden = _req(cfg, "hidden_size")
    heads = _req(cfg, "num_attention_heads")
    bias = bool(cfg.get("attention_bias", False))
    n_routed = cfg.get("n_routed_experts")
    moe = None
    if n_routed:
        moe = MoESpec(
            num_experts=n_routed,
            num_experts_per_token=_req(cfg, "num_experts_per_tok"),
            expert_intermediate_size=_req(cfg, "moe_intermediate_size"),
            num_shared_experts=cfg.get("n_shared_experts") or 0,
            # DeepSeek-V3's aux-loss-free balancing stores a per-expert bias (noaux_tc).
            router_bias=cfg.get("topk_method", "noaux_tc" if model_type == "deepseek_v3" else "greedy") == "noaux_tc",
            first_dense_layers=cfg.get("first_k_dense_replace", 0) or 0,
            moe_layer_step=cfg.get("moe_layer_freq", 1) or 1,
        )
    return dict(
        name=name,
        model_type=model_type,
        vocab_size=_req(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=_req(cfg, "num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=heads,
        intermediate_size=_req(cfg, "intermediate_size"),
        qkv_bias=bias,
        o_bias=bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_theta=_rope_theta(cfg),
        hidden_act=cfg.get("hidden_act", "silu"),
        mla=MLASpec(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=_req(cfg, "kv_lora_rank"),
            qk_rope_head_dim=_req(cfg, "qk_rope_head_dim"),
            qk_nope_head_dim=_req(cfg, "qk_nope_head_dim"),
            v_head_dim=_req(cfg, "v_head_dim"),
        ),
        moe=moe,
        num_mtp_layers=cfg.get("num_nextn_predict_layers", 0) or 0,
        dtype=str(cfg.get("torch_dtype") or "bfloat16"),
    )


TRANSLATORS: dict[str, Callable[[Config, str], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "granitemoe": _granitemoe,
    "qwen2": _qwen2,
    "qwen2_moe": _qwen2_moe,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "falcon": _falcon,
    "phi3": _phi3,
    "deepseek_v2": lambda c, n: _deepseek(c, n, "deepseek_v2"),
    "deepseek_v3": lambda c, n: _deepseek(c, n, "deepseek_v3"),
}

# `architectures[0]` -> model_type, for configs that lack model_type.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "GraniteMoeForCausalLM": "granitemoe",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "GPT2LMHeadModel": "gpt2",
    "GPTNeoXForCausalLM": "gpt_neox",
    "FalconForCausalLM": "falcon",
    "RWForCausalLM": "falcon",
    "Phi3ForCausalLM": "phi3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

SPEC_FIELDS_HINT = (
    "write a shardplan model YAML with an `architecture:` block giving hidden_size, num_layers, "
    "num_attention_heads, num_kv_heads, intermediate_size, vocab_size, max_position_embeddings "
    "(and moe:/mla: for MoE or latent attention); see `shardplan models show debug --json`"
)


def detect_model_type(cfg: Config) -> str:
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in TRANSLATORS:
        return model_type
    archs = cfg.get("architectures") or []
    if isinstance(archs, list):
        for arch in archs:
            if arch in ARCHITECTURES:
                return ARCHITECTURES[arch]
    label = model_type or (archs[0] if isinstance(archs, list) and archs else None)
    raise UnsupportedModelError(
        f"unsupported model_type {label!r}; supported: {', '.join(sorted(TRANSLATORS))}",
        field="model_type",
        hint=SPEC_FIELDS_HINT,
    )


# Dropout probabilities from the keys the families use (the largest present) and
# transformers' defaults where the config omits them (configuration_<family>.py __init__
# signatures: GPT2Config attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1; GPTNeoXConfig and
# FalconConfig attention_dropout=0.0, hidden_dropout=0.0; LlamaConfig, MistralConfig,
# Qwen2Config, Qwen3Config, GemmaConfig and the MoE/DeepSeek configs attention_dropout=0.0 and
# no hidden dropout; Phi3Config attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0).
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop")
HIDDEN_DROPOUT_KEYS = ("hidden_dropout", "resid_pdrop", "embd_pdrop")
DROPOUT_DEFAULTS = {"gpt2": (0.1, 0.1)}  # family -> (attention, hidden) when the config is silent


def _dropouts(cfg: Config, model_type: str) -> dict[str, float]:
    default_attn, default_hidden = DROPOUT_DEFAULTS.get(model_type, (0.0, 0.0))

    def first(keys: tuple[str, ...], default: float) -> float:
        values = [cfg[k] for k in keys if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)]
        return float(max(values)) if values else default

    return {"attention_dropout": first(ATTENTION_DROPOUT_KEYS, default_attn),
            "hidden_dropout": first(HIDDEN_DROPOUT_KEYS, default_hidden)}


def hf_config_to_spec_fields(cfg: Config, name: str) -> dict[str, Any]:
    """Return ModelSpec keyword arguments for an HF config dict (validation happens in ModelSpec)."""
    if "text_config" in cfg and "hidden_size" not in cfg and isinstance(cfg["text_config"], Mapping):
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    model_type = detect_model_type(cfg)
    return {**TRANSLATORS[model_type](cfg, name), **_dropouts(cfg, model_type)}


def spec_from_hf_config(cfg: Config, name: str, source: str | None = None) -> ModelSpec:
    fields = hf_config_to_spec_fields(cfg, name)
    return ModelSpec(**fields, source=source)
