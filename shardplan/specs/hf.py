"""Translate a Hugging Face `config.json` (a dict) into a ModelSpec.

Each family's translator reads the keys its transformers config class defines, with that
class's defaults where a key is absent, and the structural facts its modelling code
hard-codes (Qwen2's q/k/v bias, Gemma 2's four norms per layer). Pure: takes a dict,
returns a ModelSpec or raises UnsupportedModelError/ValueError with the field named.

The families of issue 27 (Llama 4, gpt-oss, Gemma 3, Qwen2-VL/2.5-VL, LLaVA/LLaVA-NeXT,
Mistral 3, Phi-3.5-MoE, Qwen3-Next) read transformers' defaults from hf_defaults.yaml, also
inside a composite's text_config / vision_config, and every key a translation does not read
and does not know to be harmless is named in a warning (`translate`). A model_type outside
TRANSLATORS is built by transformers on the meta device when it is installed (hf_meta.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from shardplan.errors import InputFileError, UnsupportedModelError
from shardplan.units import DTYPE_ALIASES
from shardplan.specs.model import (
    LayerType,
    LinearAttentionSpec,
    MLASpec,
    ModelSpec,
    MoESpec,
    NamedShape,
    NormType,
    PositionEmbedding,
    QKNorm,
    VisionSpec,
)

Config = Mapping[str, Any]


class MissingField(ValueError):
    """A key the family needs is absent from the config."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _req(cfg: Config, key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise MissingField(_where(cfg, key))
    return cfg[key]


def _flag(cfg: Config, key: str, default: bool = False) -> bool:
    """A boolean key (`default` where absent, false where null). JSON's own true/false only: the
    string "false" would read as true, and transformers' config classes refuse 0/1."""
    value = cfg.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise InputFileError(f"must be a JSON boolean, got {_shown(value)}", field=_where(cfg, key),
                             hint=f'write "{_where(cfg, key)}": true or false, without quotes')
    return bool(value)


def _short(value: Any) -> str:
    """`value` for an error message, bounded; a string quoted."""
    return repr(value[:40]) if isinstance(value, str) else str(value)[:40]


def _shown(value: Any) -> str:
    """`value` for an error message, saying when it is a string (the string "false" is not false)."""
    return f"the string {_short(value)}" if isinstance(value, str) else _short(value)


def _kv_heads(cfg: Config, heads: Any, key: str = "num_key_value_heads") -> Any:
    """KV heads: `heads` (multi-head attention) where the key is absent or null, as transformers'
    config classes read it; else a positive divisor of `heads`. transformers takes 0, negatives and
    non-divisors into the config but cannot build the model (num_attention_heads // 0, a negative
    k_proj width, repeat_kv's mismatch), and vLLM asserts the division. A default (hf_defaults.yaml)
    that does not divide the file's num_attention_heads is left to ModelSpec, which names both."""
    value = cfg.get(key)
    if value is None:
        return heads
    heads_known = isinstance(heads, int) and not isinstance(heads, bool) and heads > 0
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())  # 8.0 reads as 8
    if isinstance(value, bool) or not whole or value <= 0:
        bad = True
    else:
        in_file = key in cfg._cfg if isinstance(cfg, _Tracked) else True
        bad = in_file and heads_known and heads % value != 0
    if bad:
        of = f" of num_attention_heads ({heads})" if heads_known else ""
        raise InputFileError(f"must be a positive divisor{of}, got {_shown(value)}", field=_where(cfg, key),
                             hint="give the model's KV heads (e.g. 8 for grouped-query attention), or leave it "
                                  "out or null for one KV head per attention head")
    return value


# The keys a checkpoint's dtype is under (transformers >= 4.56 writes `dtype`, older ones `torch_dtype`).
DTYPE_KEYS = ("torch_dtype", "dtype")


def config_dtype(cfg: Config, default: str | None) -> str | None:
    """The checkpoint's dtype (torch_dtype, else dtype, else `default`), a name units.DTYPE_ALIASES
    knows; any other value, in either key, is the file's error (`checkpoint` and every byte figure
    read it)."""
    found = None
    for key in DTYPE_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or value.strip().lower() not in DTYPE_ALIASES:
            raise InputFileError(f"unknown dtype {_short(value)}; shardplan knows {', '.join(DTYPE_ALIASES)}",
                                 field=_where(cfg, key), hint='give the checkpoint\'s dtype, e.g. "bfloat16"')
        found = found or value
    return found or default


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
        num_kv_heads=_kv_heads(cfg, heads),
        head_dim=cfg.get("head_dim"),
        intermediate_size=_req(cfg, "intermediate_size"),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=_rope_theta(cfg),
        hidden_act=cfg.get("hidden_act", "silu"),
        dtype=config_dtype(cfg, "bfloat16"),
    )


def _as_float(value: Any) -> float:
    """`value` as a float, NaN where it is none (a string, a list, an integer past float's range)."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def _number(cfg: Config, key: str, value: Any) -> float:
    """`value` (read from `key`, or its default) as a finite float; anything else is the file's error."""
    number = _as_float(value)
    if isinstance(value, bool) or not math.isfinite(number):
        raise InputFileError(f"must be a finite number, got {str(value)[:40]!r}", field=_where(cfg, key),
                             hint="use the value from the model's config.json")
    return number


def _first_key(cfg: Config, keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
    """(the first of `keys` the config has, its value), or (the first key, `default`)."""
    for key in keys:
        if key in cfg:
            return key, cfg[key]
    return keys[0], default


def _rope_theta(cfg: Config) -> float | None:
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(cfg.get("rope_parameters"), Mapping):
        theta = cfg["rope_parameters"].get("rope_theta")
    if theta is None:
        return None
    value = _as_float(theta)
    if not math.isfinite(value) or value <= 0:
        raise InputFileError(f"rope_theta {str(theta)[:40]} is not a positive finite number", field="rope_theta",
                             hint="give the RoPE base, e.g. 500000.0")
    return value


def _sliding(cfg: Config) -> int | None:
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _llama(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "llama")
    bias = _flag(cfg, "attention_bias")
    d.update(
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=_flag(cfg, "mlp_bias"),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
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
             tie_word_embeddings=_flag(cfg, "tie_word_embeddings", True))
    return d


def _qwen2(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "qwen2")
    # Qwen2Attention hard-codes bias=True on q/k/v and bias=False on o_proj.
    d.update(qkv_bias=True, o_bias=False, tie_word_embeddings=_flag(cfg, "tie_word_embeddings"))
    _qwen_sliding(cfg, d)
    return d


def _qwen_sliding(cfg: Config, d: dict[str, Any]) -> None:
    """Qwen2/Qwen3: a window only with use_sliding_window. Their config classes drop sliding_window
    otherwise, and a layer_types of only full_attention layers is what they derive themselves:
    neither changes a shape or the cache."""
    if _flag(cfg, "use_sliding_window"):
        d["sliding_window"] = _sliding(cfg)
        return
    _acknowledge(cfg, "sliding_window")
    given = cfg._cfg.get("layer_types") if isinstance(cfg, _Tracked) else None
    if isinstance(given, list) and set(given) <= {"full_attention"}:
        _acknowledge(cfg, "layer_types")


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
        qkv_bias=_flag(cfg, "qkv_bias", True),  # Qwen2MoeConfig's since transformers 5 (Qwen2's fixed True before)
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
    bias = _flag(cfg, "attention_bias")
    d.update(
        head_dim=cfg.get("head_dim") or 128,  # Qwen3Config default
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=QKNorm.PER_HEAD,
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
    )
    _qwen_sliding(cfg, d)
    return d


def _routed_experts(cfg: Config) -> Any:
    """Qwen3MoeConfig's routed experts: num_experts up to transformers 4, num_local_experts in the
    configs transformers 5 writes (both are read; two different counts are refused)."""
    old, new = cfg.get("num_experts"), cfg.get("num_local_experts")
    if old is not None and new is not None and old != new:
        raise InputFileError(f"num_experts {_shown(old)} and num_local_experts {_shown(new)} differ",
                             field=_where(cfg, "num_local_experts"),
                             hint="keep one of them: the number of routed experts per MoE layer")
    return _req(cfg, "num_local_experts" if new is not None else "num_experts")


def _qwen3_moe(cfg: Config, name: str) -> dict[str, Any]:
    d = _qwen3(cfg, name)
    d.update(
        model_type="qwen3_moe",
        # Not Qwen3Config's 128: Qwen3MoeConfig has no head_dim default, and its attention takes
        # getattr(config, "head_dim", hidden_size // num_attention_heads) (modeling_qwen3_moe.py in
        # transformers 4.51.3 and 5.24.0; vLLM's qwen3_moe.py likewise): None is that quotient here.
        head_dim=cfg.get("head_dim"),
        moe=MoESpec(
            num_experts=_routed_experts(cfg),
            num_experts_per_token=_req(cfg, "num_experts_per_tok"),
            expert_intermediate_size=_req(cfg, "moe_intermediate_size"),
            **_qwen_moe_layers(cfg),
        ),
    )
    return d


def _gemma(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "gemma")
    bias = _flag(cfg, "attention_bias")
    d.update(
        head_dim=cfg.get("head_dim") or 256,
        qkv_bias=bias,
        o_bias=bias,
        mlp_gated=True,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", True),
    )
    return d


def _gemma2(cfg: Config, name: str) -> dict[str, Any]:
    d = _gemma(cfg, name)
    # Gemma2DecoderLayer: input, post_attention, pre_feedforward, post_feedforward norms;
    # even layers slide over `sliding_window` tokens, odd layers attend globally.
    d.update(model_type="gemma2", num_norms_per_layer=4, sliding_window=_sliding(cfg) or 4096, global_layer_every=2)
    # Gemma2Config derives this same pattern as layer_types (transformers >= 4.56 saves it): a copy of
    # it changes nothing; any other list is not read, so it is named in a warning.
    given = cfg._cfg.get("layer_types") if isinstance(cfg, _Tracked) else None
    if isinstance(given, list) and len(given) == d["num_layers"] and given == [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(len(given))]:
        _acknowledge(cfg, "layer_types")
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
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", True),
        position_embedding=PositionEmbedding.LEARNED,
        max_position_embeddings=cfg.get("n_positions", 1024),
        dtype=config_dtype(cfg, "float32"),
    )


def _opt(cfg: Config, name: str) -> dict[str, Any]:
    """OPT (transformers' modeling_opt.py): LayerNorm before (do_layer_norm_before) or after each
    block, learned positions with 2 rows beyond max_position_embeddings
    (OPTLearnedPositionalEmbedding's offset), biases on every linear (enable_bias), a plain MLP
    fc1/fc2 of ffn_dim, a final LayerNorm only with pre-LN, the lm_head tied and bias-free.
    A word_embed_proj_dim other than hidden_size (OPT-350m) narrows the word embeddings and the
    lm_head, with project_in/project_out (bias-free) between them and the blocks."""
    hidden = _req(cfg, "hidden_size")
    pre_ln = _flag(cfg, "do_layer_norm_before", True)
    bias = _flag(cfg, "enable_bias", True)
    return dict(
        name=name,
        model_type="opt",
        vocab_size=_req(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=_req(cfg, "num_hidden_layers"),
        num_attention_heads=_req(cfg, "num_attention_heads"),
        intermediate_size=_req(cfg, "ffn_dim"),
        mlp_gated=False,
        hidden_act=cfg.get("activation_function", "relu"),
        mlp_bias=bias,
        qkv_bias=bias,
        o_bias=bias,
        norm_type=NormType.LAYERNORM,
        final_norm=pre_ln and not _flag(cfg, "_remove_final_layer_norm"),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", True),
        position_embedding=PositionEmbedding.LEARNED,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        position_embedding_offset=OPT_POSITION_OFFSET,
        word_embed_proj_dim=cfg.get("word_embed_proj_dim") if _opt_projects_embeddings(cfg) else None,
        dtype=config_dtype(cfg, "float16"),
    )


OPT_POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding: "OPT is set up so that if padding_idx is specified then offset the embedding ids by 2"


def _opt_projects_embeddings(cfg: Config) -> bool:
    """OPT-350m's word embeddings are narrower than the blocks (project_in / project_out)."""
    proj = cfg.get("word_embed_proj_dim")
    return isinstance(proj, int) and proj != cfg.get("hidden_size")


def _gpt_neox(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "gpt_neox")
    bias = _flag(cfg, "attention_bias", True)
    d.update(
        num_kv_heads=None,
        head_dim=None,
        mlp_gated=False,
        hidden_act=cfg.get("hidden_act", "gelu"),
        mlp_bias=True,
        qkv_bias=bias,
        o_bias=bias,
        norm_type=NormType.LAYERNORM,
        parallel_residual=_flag(cfg, "use_parallel_residual", True),
        rotary_fraction=_number(cfg, *_first_key(cfg, ("rotary_pct", "partial_rotary_factor"), 0.25)),
        rope_theta=_number(cfg, *_first_key(cfg, ("rotary_emb_base", "rope_theta"), 10000)),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
    )
    return d


def _falcon(cfg: Config, name: str) -> dict[str, Any]:
    hidden = _req(cfg, "hidden_size")
    heads = _req(cfg, "num_attention_heads")
    new_arch = _flag(cfg, "new_decoder_architecture")
    parallel = _flag(cfg, "parallel_attn", True)
    if new_arch:
        kv = _kv_heads(cfg, heads, "num_kv_heads")
        _acknowledge(cfg, "multi_query")  # FalconAttention sizes q/k/v by num_kv_heads alone here
    else:
        kv = 1 if _flag(cfg, "multi_query", True) else heads
        # The fused q/k/v is hidden + 2 heads (multi-query) or 3 x hidden: num_kv_heads shapes nothing.
        _acknowledge(cfg, "num_kv_heads")
    # FalconDecoderLayer: two norms (input, post-attention) without parallel attention; with it,
    # ln_attn + ln_mlp where num_ln_in_parallel_attn is 2 (its default under the new architecture),
    # else one input_layernorm.
    num_ln = cfg.get("num_ln_in_parallel_attn")
    norms = 2 if not parallel or num_ln == 2 or (num_ln is None and new_arch) else 1
    bias = _flag(cfg, "bias")
    alibi = _flag(cfg, "alibi")
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
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", True),
        position_embedding=PositionEmbedding.ALIBI if alibi else PositionEmbedding.ROPE,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=_number(cfg, "rope_theta", cfg.get("rope_theta", 10000.0)),
        dtype=config_dtype(cfg, "bfloat16"),
    )


def _bloom(cfg: Config, name: str) -> dict[str, Any]:
    """BLOOM (transformers' modeling_bloom.py): ALiBi instead of positions, a LayerNorm right after
    the word embeddings (word_embeddings_layernorm), fused query_key_value and dense with biases, an
    MLP of dense_h_to_4h / dense_4h_to_h (4 h, GeLU, biases; BloomMLP takes no other width, so
    n_inner is read by nothing), LayerNorm with biases, the lm_head tied. No position limit of its
    own: the training length (seq_length, 2048 for BLOOM) stands for one."""
    hidden = cfg.get("hidden_size") or _req(cfg, "n_embed")
    for key in ("n_embed", "n_inner", "masked_softmax_fusion", "slow_but_exact", "offset_alibi", "skip_bias_add",
                "skip_bias_add_qkv", "attention_softmax_in_fp32", "bias_dropout_fusion", "unk_token_id"):
        _acknowledge(cfg, key)  # aliases, training fusions and numerics of the Megatron-DeepSpeed port
    return dict(
        name=name,
        model_type="bloom",
        vocab_size=_req(cfg, "vocab_size"),
        hidden_size=hidden,
        num_layers=cfg.get("num_hidden_layers") or _req(cfg, "n_layer"),
        num_attention_heads=cfg.get("num_attention_heads") or _req(cfg, "n_head"),
        intermediate_size=4 * hidden,
        mlp_gated=False,
        hidden_act="gelu",
        mlp_bias=True,
        qkv_bias=True,
        o_bias=True,
        norm_type=NormType.LAYERNORM,
        embedding_norm=True,
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", True),
        position_embedding=PositionEmbedding.ALIBI,
        max_position_embeddings=cfg.get("seq_length", 2048),
        dtype=config_dtype(cfg, "bfloat16"),
    )


def _nemotron(cfg: Config, name: str) -> dict[str, Any]:
    """Nemotron-4 and Minitron (transformers' modeling_nemotron.py): an MLP of up_proj and down_proj
    with no gate (NemotronMLP: down(act(up(x))), squared ReLU by default), LayerNorm1P norms (a
    LayerNorm with weight and bias), rotary positions on partial_rotary_factor of each head (0.5
    by default), untied embeddings; biases on the attention and MLP linears only where
    attention_bias / mlp_bias say so."""
    d = _common(cfg, name, "nemotron")
    bias = _flag(cfg, "attention_bias")
    d.update(
        mlp_gated=False,
        hidden_act=cfg.get("hidden_act", "relu2"),
        mlp_bias=_flag(cfg, "mlp_bias"),
        qkv_bias=bias,
        o_bias=bias,
        norm_type=NormType.LAYERNORM,
        rotary_fraction=_nemotron_rotary_fraction(cfg),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
    )
    return d


def _nemotron_rotary_fraction(cfg: Config) -> float:
    """partial_rotary_factor at the top (the checkpoints' config.json) or in rope_parameters (as
    transformers 5 writes it); 0.5, NemotronConfig's default, where neither says."""
    nested = cfg.get("rope_parameters")
    if isinstance(nested, Mapping) and "partial_rotary_factor" in nested and "partial_rotary_factor" not in cfg:
        return _number(cfg, "rope_parameters.partial_rotary_factor", nested["partial_rotary_factor"])
    return _number(cfg, *_first_key(cfg, ("partial_rotary_factor",), 0.5))


def _phi3(cfg: Config, name: str) -> dict[str, Any]:
    d = _common(cfg, name, "phi3")
    d.update(
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
        rotary_fraction=_number(cfg, "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)),
        sliding_window=_sliding(cfg),
    )
    return d


def _deepseek(cfg: Config, name: str, model_type: str) -> dict[str, Any]:
    hidden = _req(cfg, "hidden_size")
    heads = _req(cfg, "num_attention_heads")
    bias = _flag(cfg, "attention_bias")
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
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
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
        dtype=config_dtype(cfg, "bfloat16"),
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
    "opt": _opt,
    "gpt_neox": _gpt_neox,
    "falcon": _falcon,
    "phi3": _phi3,
    "nemotron": _nemotron,
    "bloom": _bloom,
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
    "OPTForCausalLM": "opt",
    "GPTNeoXForCausalLM": "gpt_neox",
    "FalconForCausalLM": "falcon",
    "RWForCausalLM": "falcon",
    "Phi3ForCausalLM": "phi3",
    "NemotronForCausalLM": "nemotron",
    "BloomForCausalLM": "bloom",
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
    if isinstance(model_type, str) and (model_type in TRANSLATORS or model_type in DEFAULTED):
        return model_type
    archs = cfg.get("architectures") or []
    if isinstance(archs, list):
        for arch in archs:
            if arch in ARCHITECTURES:
                return ARCHITECTURES[arch]
    label = model_type or (archs[0] if isinstance(archs, list) and archs else None)
    raise UnsupportedModelError(
        f"unsupported model_type {label!r}; supported: {', '.join(sorted({*TRANSLATORS, *DEFAULTED}))}",
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
FAMILY_HIDDEN_DROPOUT_KEYS = {"opt": ("dropout",)}  # OPTConfig's `dropout` is the residual branches' (and embeddings')
# family -> (attention, hidden) when the config is silent (OPTConfig: dropout=0.1, attention_dropout=0.0)
DROPOUT_DEFAULTS = {"gpt2": (0.1, 0.1), "opt": (0.0, 0.1)}


def _dropouts(cfg: Config, model_type: str) -> dict[str, float]:
    default_attn, default_hidden = DROPOUT_DEFAULTS.get(model_type, (0.0, 0.0))

    def first(keys: tuple[str, ...], default: float) -> float:
        values = [(cfg[k], k) for k in keys if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)]
        if not values:
            return default
        value, key = max(values, key=lambda vk: vk[0])
        return _number(cfg, key, value)

    return {"attention_dropout": first(ATTENTION_DROPOUT_KEYS, default_attn),
            "hidden_dropout": first(FAMILY_HIDDEN_DROPOUT_KEYS.get(model_type, HIDDEN_DROPOUT_KEYS), default_hidden)}


def hf_config_to_spec_fields(cfg: Config, name: str) -> dict[str, Any]:
    """Return ModelSpec keyword arguments for an HF config dict (validation happens in ModelSpec)."""
    return translate(cfg, name).fields


@dataclass(frozen=True)
class Translation:
    """ModelSpec keyword arguments, the config keys nothing read (as warnings) and notes."""

    fields: dict[str, Any]
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def _fp8_weight_block(quant: Any) -> tuple[int, int] | None:
    """quantization_config of a block-quantized FP8 checkpoint (quant_method fp8 with a
    weight_block_size of two positive integers, as DeepSeek-V3's); anything else: None."""
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 20 for b in block)):
        return int(block[0]), int(block[1])
    return None


def _head_fields(cfg: Config) -> dict[str, Any]:
    """A *ForSequenceClassification checkpoint (a reward model, a classifier): no lm_head, a
    `score` linear over num_labels (transformers: the length of id2label, else num_labels, else
    PretrainedConfig's default 2), pooled at each sequence's last token."""
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)
            and archs[0].endswith("ForSequenceClassification")):
        return {}
    labels = cfg.get("id2label")
    if isinstance(labels, Mapping) and labels:
        n = len(labels)
    else:
        n = cfg.get("num_labels", 2)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_labels {n!r} is not a positive integer (set num_labels, or id2label, to the "
                             "classification head's outputs)")
    return {"head": "sequence_classification", "num_labels": n, "tie_word_embeddings": False}


_QUANT_METHOD = re.compile(r"[A-Za-z0-9_.-]{1,40}")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ct_scheme(quant: Mapping[str, Any]) -> tuple[str, Any] | None:
    """(kind, its weights' scheme) of an llm-compressor compressed-tensors quantization_config whose
    config groups all quantize the Linear layers' weights one way: FP8 weights ("ct-fp8", with FP8 or
    no activation quantization: W8A8 or vLLM's W8A16 Marlin), INT8 weights with INT8 activations
    ("ct-int8", W8A8), or 4-bit integer weights alone ("ct-w4a16"); None otherwise (another scheme,
    several, or a shape this does not read)."""
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        return None
    kinds = set()
    weights = None
    for group in groups.values():
        if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
            return None
        weights, acts = group["weights"], group.get("input_activations")
        bits, typ = weights.get("num_bits"), weights.get("type")
        act_bits = acts.get("num_bits") if isinstance(acts, Mapping) else None
        act_type = acts.get("type") if isinstance(acts, Mapping) else None
        if typ == "float" and bits == 8 and _whole(bits) and (acts is None or (act_type == "float" and act_bits == 8)):
            kinds.add("ct-fp8")
        elif typ == "int" and bits == 8 and _whole(bits) and act_type == "int" and act_bits == 8:
            kinds.add("ct-int8")
        elif typ == "int" and bits == 4 and _whole(bits) and acts is None:
            kinds.add("ct-w4a16")
        else:
            return None
    return (kinds.pop(), weights) if len(kinds) == 1 else None


def _checkpoint_kind(quant: Any) -> tuple[str, int | None] | None:
    """(kind, quantization group) of a quantized checkpoint that engines load as it ships
    (ModelSpec.checkpoint_quantization and checkpoint_group_size, CHECKPOINT_KINDS), or None. Kinds:
    "awq" or "gptq" for 4-bit AWQ or GPTQ weights (AutoAWQ and GPTQModel/AutoGPTQ write quant_method
    and bits; AutoAWQ's own "w_bit" in older exports), or a compressed-tensors scheme (`_ct_scheme`).
    The group runs along each weight's input (group_size; "q_group_size" in older AutoAWQ exports; a
    compressed-tensors scheme's weights' group_size with strategy "group") when it is a positive
    integer; None for -1 or a per-channel scheme (no constraint on a split)."""
    if not isinstance(quant, Mapping):
        return None
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        scheme = _ct_scheme(quant)
        if scheme is None:
            return None
        kind, weights = scheme
        group = weights.get("group_size") if weights.get("strategy") == "group" else None
    else:
        bits = quant.get("bits", quant.get("w_bit"))
        if method not in ("awq", "gptq") or not _whole(bits) or bits != 4:
            return None
        kind, group = method, quant.get("group_size", quant.get("q_group_size"))
    return kind, (group if _whole(group) and 0 < group <= 1 << 20 else None)


def _shipped_quantization_note(cfg: Config) -> str | None:
    """A note for a checkpoint whose quantization_config names a format shardplan does not plan as
    shipped (it plans block-quantized FP8, gpt-oss's MXFP4 experts and 4-bit AWQ/GPTQ as shipped:
    ModelSpec.shipped_format): 8-bit GPTQ, bitsandbytes, compressed-tensors... Engines read the format from the checkpoint (vLLM's
    --quantization: "If None, we first check the quantization_config attribute in the model config
    file", docs.vllm.ai engine_args), so the plan at the model's dtype overstates the weights."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, Mapping) or _fp8_weight_block(quant) is not None or _checkpoint_kind(quant) is not None:
        return None
    method = quant.get("quant_method")
    if not isinstance(method, str) or method == "mxfp4":
        return None
    shown = method if _QUANT_METHOD.fullmatch(method) else "a method shardplan does not print"
    bits = quant.get("bits")
    size = f"{bits}-bit " if _whole(bits) and 1 <= bits <= 16 else ""
    # 4-bit AWQ/GPTQ are planned as shipped (_checkpoint_kind): what is left is another width or method.
    named = (({8: "--quantization int8", 4: "--quantization int4"}.get(bits) if _whole(bits) else None) if method in ("awq", "gptq")
             else {"fp8": "--quantization fp8"}.get(method))
    how = f" ({named})" if named else " (fp8, int8, int4, awq or gptq)"
    return (f"the checkpoint's weights are quantized ({size}{shown}, its quantization_config) and engines load them "
            f"so; shardplan plans the model's dtype unless --quantization names the format{how}")


def translate(cfg: Config, name: str) -> Translation:
    """An HF config dict as ModelSpec fields, with a warning naming each key not understood and a
    note for a quantized checkpoint planned at the model's dtype."""
    t = _translate(cfg, name)
    head = _head_fields(cfg)
    block = _fp8_weight_block(cfg.get("quantization_config"))
    if block is not None and "fp8_weight_block_size" not in t.fields:
        head = {**head, "fp8_weight_block_size": block}  # the paths through transformers or a text_config
    found = _checkpoint_kind(cfg.get("quantization_config"))
    if found is not None:
        kind, group = found
        head = {**head, "checkpoint_quantization": kind, **({"checkpoint_group_size": group} if group else {})}
    if head:
        t = Translation({**t.fields, **head}, t.warnings, t.notes)
    note = _shipped_quantization_note(cfg)
    return Translation(t.fields, t.warnings, t.notes + (note,)) if note else t


def _translate(cfg: Config, name: str) -> Translation:
    model_type = cfg.get("model_type")
    if model_type is None and isinstance(cfg.get("architectures"), list):
        found = [ARCHITECTURES[a] for a in cfg["architectures"] if a in ARCHITECTURES]
        if found and found[0] in DEFAULTED:
            model_type = found[0]
            cfg = {**cfg, "model_type": model_type}
    if isinstance(model_type, str) and model_type in DEFAULTED:
        tracked = _Tracked(cfg, hf_defaults().defaults(model_type))
        fields = DEFAULTED[model_type](tracked, name)
        block = _fp8_weight_block(cfg.get("quantization_config"))
        if block is not None:
            fields["fp8_weight_block_size"] = block
        if fields.get("vision") is None:
            fields.update(_dropouts(tracked, model_type))
        dtype = config_dtype(tracked, None)
        if fields.get("vision") is not None and dtype is not None:
            fields["dtype"] = dtype  # a composite's dtype is the top-level one
        notes = (f"routed experts stored as {fields['expert_dtype']}",) if fields.get("expert_dtype") else ()
        return Translation(fields, tuple(tracked.unread_warnings()), notes)
    outer = None
    if "text_config" in cfg and "hidden_size" not in cfg and isinstance(cfg["text_config"], Mapping):
        # A composite read for its language model alone: its other keys (a vision_config...) are
        # named in warnings like any other key nothing reads.
        outer = _Tracked(cfg, {})
        outer.acknowledge("text_config")
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    try:
        model_type = detect_model_type(cfg)
    except UnsupportedModelError:
        label = cfg.get("model_type")
        if isinstance(label, str):
            from shardplan.specs import hf_meta

            return hf_meta.translate_with_transformers(cfg, name)
        raise
    # The same bookkeeping as DEFAULTED's, without defaults under it: each family's translator
    # states its own.
    tracked = _Tracked(cfg, {}, prefix="text_config." if outer is not None else "")
    block = _fp8_weight_block(tracked.get("quantization_config"))
    fields = {**TRANSLATORS[model_type](tracked, name), **_dropouts(tracked, model_type),
              **({"fp8_weight_block_size": block} if block is not None else {})}
    if outer is None:
        return Translation(fields, tuple(tracked.unread_warnings()))
    outer._children.append(tracked)
    return Translation(fields, tuple(outer.unread_warnings()))


def spec_from_hf_config(cfg: Config, name: str, source: str | None = None) -> ModelSpec:
    fields = hf_config_to_spec_fields(cfg, name)
    return ModelSpec(**fields, source=source)


# ----- transformers' defaults (hf_defaults.yaml) ----------------------------------------------

DEFAULTS_FILE = Path(__file__).with_name("hf_defaults.yaml")


@dataclass(frozen=True)
class HfDefaults:
    """transformers' config-class defaults per model_type, and each composite's sub-config types."""

    transformers_version: str
    configs: Mapping[str, Any]
    subconfigs: Mapping[str, Any]

    def defaults(self, model_type: str) -> dict[str, Any]:
        entry = self.configs.get(model_type)
        return dict(entry["defaults"]) if entry else {}

    def subconfig_type(self, model_type: str, key: str) -> str | None:
        return (self.subconfigs.get(model_type) or {}).get(key, {}).get("model_type")

    def when_absent(self, model_type: str, key: str) -> dict[str, Any]:
        return dict((self.subconfigs.get(model_type) or {}).get(key, {}).get("when_absent") or {})


@lru_cache(maxsize=1)
def hf_defaults() -> HfDefaults:
    data = yaml.safe_load(DEFAULTS_FILE.read_text(encoding="utf-8"))
    return HfDefaults(str(data["transformers_version"]), data["configs"], data["subconfigs"])


# Keys that change no parameter count and no cache size: token ids, initialisation, numerics,
# training-only switches, generation and bookkeeping. A key outside this list that no
# translation reads is named in a warning.
HARMLESS_KEYS = frozenset({
    "_name_or_path", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "model_type",
    "bos_token_id", "eos_token_id", "pad_token_id", "image_token_index", "image_token_id", "video_token_id",
    "vision_start_token_id", "vision_end_token_id", "vision_token_id", "boi_token_index", "eoi_token_index",
    "initializer_range", "initializer_factor", "rms_norm_eps", "layer_norm_eps", "norm_eps", "use_cache",
    "rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq", "partial_rotary_factor",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "cache_implementation",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "input_jitter_noise", "norm_topk_prob",
    "swiglu_limit", "swiglu_alpha", "attn_temperature_tuning", "floor_scale", "attn_scale", "use_qk_norm",
    "for_llm_compressor", "quantization_config", "initial_context_length", "hidden_act", "hidden_activation",
    "projector_hidden_act", "vision_feature_select_strategy", "image_seq_length", "image_grid_pinpoints",
    "mm_tokens_per_image", "projection_dim", "tokens_per_second", "window_size", "fullatt_block_indexes",
    "spatial_patch_size", "in_chans", "attention_dropout", "projector_dropout", "hidden_dropout", "resid_pdrop",
    "embd_pdrop", "attn_pdrop", "_attn_implementation_autoset", "use_bidirectional_attention",
    "max_window_layers", "use_sliding_window", "tie_word_embeddings", "experts_per_token", "use_polar_compatible_rope",
    "pretraining_tp", "multi_modal_projector_bias", "num_key_value_heads", "head_dim", "vocab_size",
    "vision_output_dim", "mrope_section", "rope_type", "original_max_position_embeddings",
    "ignore_index", "pixel_shuffle_ratio", "vision_feature_layer",  # shape-free (the projector reads the composite's)
    "id2label", "label2id", "num_labels", "problem_type",  # read by _head_fields (a classification head)
    # The same kinds of key as their config classes (transformers 5.x) define them for the families of
    # TRANSLATORS: numerics, routing, scalars, training-only switches, and copies transformers ignores.
    "layer_norm_epsilon", "rope_interleave", "use_mrope", "apply_residual_connection_post_layernorm",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    "n_group", "topk_group", "routed_scaling_factor", "scoring_func", "ep_size", "aux_loss_alpha",
    "seq_aux",  # DeepSeek's routing: which experts, never how many or how wide
    "attention_multiplier", "embedding_multiplier", "logits_scaling", "residual_multiplier",  # Granite's scalars
    "init_std", "layerdrop", "activation_dropout", "classifier_dropout", "is_decoder",
    "attention_probs_dropout_prob", "hidden_dropout_prob",  # GPT-NeoX-20B's old names, which GPTNeoXConfig ignores
    "n_ctx", "sliding_window_size", "qk_head_dim",  # copies of n_positions, sliding_window, qk_nope + qk_rope
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout",  # GPT2DoubleHeadsModel's head, which a causal LM does not build
    "task_specific_params", "prefix", "tokenizer_class", "gradient_checkpointing",  # pipelines', tokenizers', training
})
# Keys that change no shape at this value only (at another they add or remove tensors).
HARMLESS_VALUES: dict[str, bool] = {
    "add_cross_attention": False,  # GPT-2: true adds a cross-attention block to each layer
    "layer_norm_elementwise_affine": True,  # OPT: false drops the LayerNorms' weights and biases
    "mlp_bias": False,  # DeepSeek-V2 (transformers 5): true adds biases to every MLP
}


class _Tracked(Mapping[str, Any]):
    """A config with transformers' defaults under it that remembers which of its own keys were read."""

    def __init__(self, cfg: Config, defaults: Mapping[str, Any], prefix: str = "") -> None:
        self._cfg = dict(cfg)
        self._merged = {**defaults, **{k: v for k, v in cfg.items()}}
        self._read: set[str] = set()
        self._children: list[_Tracked] = []
        self._notes: list[str] = []
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        self._read.add(key)
        return self._merged[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self._read.add(key)
        return key in self._merged

    def __iter__(self) -> Iterator[str]:
        return iter(self._merged)

    def __len__(self) -> int:
        return len(self._merged)

    def given(self, key: str) -> bool:
        """Whether the file itself sets `key` (not a default)."""
        self._read.add(key)
        return key in self._cfg

    def child(self, key: str, defaults: Mapping[str, Any], absent: Mapping[str, Any] | None = None) -> "_Tracked":
        self._read.add(key)
        raw = self._cfg.get(key)
        if raw is None:
            raw = dict(absent or {})
        if not isinstance(raw, Mapping):
            raise InputFileError(f"must be a mapping of keys to values, got {type(raw).__name__} {_shown(raw)}",
                                 field=f"{self.prefix}{key}", hint=f"give {key} as an object of the model's config "
                                                                   "keys, as in its config.json, or leave it out")
        sub = _Tracked(raw, defaults, prefix=f"{self.prefix}{key}.")
        self._children.append(sub)
        return sub

    def acknowledge(self, key: str, warning: str | None = None) -> None:
        """Mark `key` as accounted for: a key transformers itself ignores for this config; a
        warning, if given, says why its value does not count."""
        self._read.add(key)
        if warning:
            self._notes.append(warning)

    def unread_warnings(self) -> Iterator[str]:
        yield from self._notes
        for key in sorted(self._cfg, key=str):
            if key not in self._read and key not in HARMLESS_KEYS and not (
                    key in HARMLESS_VALUES and self._cfg[key] is HARMLESS_VALUES[key]):
                yield (f"config key '{self.prefix}{key}' is not understood by shardplan and was ignored; "
                       f"check that it changes no parameter count or cache size")
        for sub in self._children:
            yield from sub.unread_warnings()


def _acknowledge(cfg: Config, key: str) -> None:
    """Mark `key` as accounted for where `cfg` tracks its reads (a translator may get a plain dict)."""
    if isinstance(cfg, _Tracked):
        cfg.acknowledge(key)


def _where(cfg: Config, key: str) -> str:
    return f"{getattr(cfg, 'prefix', '')}{key}"


def _int(cfg: Config, key: str) -> int:
    value = _req(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputFileError(f"must be a positive integer, got {str(value)[:40]!r}", field=_where(cfg, key),
                             hint="use the value from the model's config.json")
    return value


SLIDING_OR_FULL = frozenset({LayerType.SLIDING, LayerType.FULL})  # gpt-oss, Gemma 3


def _layer_types(cfg: Config, num_layers: int, default: Callable[[int], LayerType],
                 allowed: frozenset[LayerType]) -> tuple[LayerType, ...]:
    """The config's layer_types (each one of `allowed`, the types the family's modelling code builds),
    else `default(i)` for each layer as the config class derives them."""
    given = cfg.get("layer_types")
    if not given:
        return tuple(default(i) for i in range(num_layers))
    field = _where(cfg, "layer_types")
    names = " or ".join(sorted(t.value for t in allowed))
    if not isinstance(given, list) or len(given) != num_layers:
        raise InputFileError(f"must list one layer type for each of the {num_layers} layers", field=field,
                             hint=f"give {num_layers} of {names}, or leave it out for the family's pattern")
    for i, name in enumerate(given):
        if not isinstance(name, str) or name not in {t.value for t in allowed}:
            raise InputFileError(f"layer {i} is {_shown(name)}, not a layer type this model builds ({names})",
                                 field=field, hint="use the value from the model's config.json, or leave "
                                                   "layer_types out for the family's pattern")
    return tuple(LayerType(t) for t in given)


# ----- text families --------------------------------------------------------------------------


def _gpt_oss(cfg: Config, name: str) -> dict[str, Any]:
    """GptOssForCausalLM (transformers models/gpt_oss/modeling_gpt_oss.py): biased q/k/v/o, a learned
    sink per head, every layer MoE with a biased router and biased experts; layer_types default to
    sliding on even, full on odd layers (GptOssConfig.__post_init__). Experts ship as MXFP4."""
    d = _common(cfg, name, "gpt_oss")
    layers = d["num_layers"]
    bias = _flag(cfg, "attention_bias")
    quant = cfg.get("quantization_config")
    mxfp4 = isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4"
    d.update(
        qkv_bias=bias, o_bias=bias, mlp_bias=True, attention_sinks=True,
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
        sliding_window=_sliding(cfg),
        layer_types=_layer_types(cfg, layers, lambda i: LayerType.SLIDING if (i + 1) % 2 else LayerType.FULL,
                                 SLIDING_OR_FULL),
        moe=MoESpec(num_experts=_int(cfg, "num_local_experts"), num_experts_per_token=_int(cfg, "num_experts_per_tok"),
                    expert_intermediate_size=_int(cfg, "intermediate_size"), router_linear_bias=True),
        expert_dtype="mxfp4" if mxfp4 else None,
    )
    return d


def _phimoe(cfg: Config, name: str) -> dict[str, Any]:
    """PhimoeForCausalLM (Phi-3.5-MoE): Mixtral's block with LayerNorms (weight and bias), optional
    q/k/v/o bias and lm_head bias."""
    d = _common(cfg, name, "phimoe")
    bias = _flag(cfg, "attention_bias")
    d.update(
        qkv_bias=bias, o_bias=bias, norm_type=NormType.LAYERNORM, lm_head_bias=_flag(cfg, "lm_head_bias"),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"), sliding_window=_sliding(cfg),
        moe=MoESpec(num_experts=_int(cfg, "num_local_experts"), num_experts_per_token=_int(cfg, "num_experts_per_tok"),
                    expert_intermediate_size=_int(cfg, "intermediate_size")),
    )
    return d


def _gemma3_text(cfg: Config, name: str) -> dict[str, Any]:
    """Gemma3TextModel: Gemma 2's four norms per block with per-head q/k RMSNorm; 5 sliding layers
    to 1 global (layer_types, else the legacy sliding_window_pattern, 6 in Gemma3TextConfig)."""
    d = _gemma(cfg, name)
    pattern = cfg.get("sliding_window_pattern", 6)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise InputFileError(f"must be a positive integer, got {_shown(pattern)}",
                             field=_where(cfg, "sliding_window_pattern"),
                             hint="use the value from the model's config.json")
    d.update(
        model_type="gemma3_text", num_norms_per_layer=4, qk_norm=QKNorm.PER_HEAD,
        sliding_window=_sliding(cfg),
        layer_types=_layer_types(cfg, d["num_layers"],
                                 lambda i: LayerType.SLIDING if (i + 1) % pattern else LayerType.FULL,
                                 SLIDING_OR_FULL),
    )
    return d


def _llama4_text(cfg: Config, name: str) -> dict[str, Any]:
    """Llama4TextModel: MoE layers (a routed top-k of num_local_experts plus one shared expert, both
    of intermediate_size) at moe_layers, else every interleave_moe_layer_step-th layer; dense layers
    of intermediate_size_mlp. RoPE layers attend in chunks of attention_chunk_size, every
    no_rope_layer_interval-th layer is a global NoPE layer (Llama4TextConfig.__post_init__). The
    q/k L2 norm has no weights."""
    d = _common(cfg, name, "llama4_text")
    layers = d["num_layers"]
    bias = _flag(cfg, "attention_bias")
    chunk = cfg.get("attention_chunk_size")
    interval = cfg.get("no_rope_layer_interval", 4)
    no_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    experts = cfg.get("num_local_experts") or 0
    moe = None
    if experts:
        step = cfg.get("interleave_moe_layer_step", 1)
        moe_layers = cfg.get("moe_layers")
        if moe_layers is None:
            moe_layers = list(range(step - 1, layers, step)) if step else []
        moe = MoESpec(num_experts=experts, num_experts_per_token=_int(cfg, "num_experts_per_tok"),
                      expert_intermediate_size=_int(cfg, "intermediate_size"), num_shared_experts=1,
                      dense_layer_indices=tuple(i for i in range(layers) if i not in set(moe_layers)))
    d.update(
        intermediate_size=_int(cfg, "intermediate_size_mlp"), qkv_bias=bias, o_bias=bias,
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"), moe=moe,
        attention_chunk_size=int(chunk) if chunk else None,
        layer_types=_layer_types(cfg, layers, lambda i: LayerType.CHUNKED if no_rope[i] and chunk else LayerType.FULL,
                                 frozenset({LayerType.CHUNKED, LayerType.FULL})),
    )
    return d


def _qwen3_next(cfg: Config, name: str) -> dict[str, Any]:
    """Qwen3NextForCausalLM: linear-attention (Gated DeltaNet) layers and, every
    full_attention_interval-th layer (4, Qwen3NextConfig.__post_init__), a gated softmax attention
    with per-head q/k norms; Qwen2-MoE's experts with a gated shared expert."""
    d = _qwen3(cfg, name)
    interval = cfg.get("full_attention_interval", 4)
    shared = cfg.get("shared_expert_intermediate_size") or 0
    d.update(
        model_type="qwen3_next", head_dim=_int(cfg, "head_dim"), attention_output_gate=True,
        layer_types=_layer_types(cfg, d["num_layers"],
                                 lambda i: LayerType.LINEAR if (i + 1) % interval else LayerType.FULL,
                                 frozenset({LayerType.LINEAR, LayerType.FULL})),
        linear_attention=LinearAttentionSpec(
            num_key_heads=_int(cfg, "linear_num_key_heads"), num_value_heads=_int(cfg, "linear_num_value_heads"),
            key_head_dim=_int(cfg, "linear_key_head_dim"), value_head_dim=_int(cfg, "linear_value_head_dim"),
            conv_kernel_size=_int(cfg, "linear_conv_kernel_dim")),
        sliding_window=None,
        moe=MoESpec(num_experts=_int(cfg, "num_experts"), num_experts_per_token=_int(cfg, "num_experts_per_tok"),
                    expert_intermediate_size=_int(cfg, "moe_intermediate_size"), num_shared_experts=1 if shared else 0,
                    shared_expert_intermediate_size=shared or None, shared_expert_gate=bool(shared),
                    **_qwen_moe_layers(cfg)),
    )
    return d


# ----- vision towers --------------------------------------------------------------------------


def _patches(cfg: Config) -> int:
    image, patch = _int(cfg, "image_size"), _int(cfg, "patch_size")
    return (image // patch) ** 2


def _vit(cfg: Config, model_type: str, **kw: Any) -> dict[str, Any]:
    return dict(model_type=model_type, hidden_size=_int(cfg, "hidden_size"), num_layers=_int(cfg, "num_hidden_layers"),
                num_attention_heads=_int(cfg, "num_attention_heads"), intermediate_size=_int(cfg, "intermediate_size"),
                **kw)


def _clip_tower(cfg: Config) -> dict[str, Any]:
    """CLIPVisionModel: class vector, bias-free patch conv, (patches + 1) positions, pre and post
    LayerNorm, biased blocks."""
    return _vit(cfg, "clip_vision_model", class_embedding=True, num_position_embeddings=_patches(cfg) + 1,
                num_outer_norms=2, patch_embedding_inputs=_int(cfg, "num_channels") * _int(cfg, "patch_size") ** 2)


def _siglip_tower(cfg: Config) -> dict[str, Any]:
    """SiglipVisionModel: biased patch conv, one position per patch, post LayerNorm, and the
    attention-pooling head unless vision_use_head is false (probe, nn.MultiheadAttention, a
    LayerNorm and an MLP)."""
    h, inter = _int(cfg, "hidden_size"), _int(cfg, "intermediate_size")
    extra: list[NamedShape] = []
    if _flag(cfg, "vision_use_head", True):
        extra = [NamedShape(name=n, shape=s) for n, s in (
            ("head.probe", (1, 1, h)), ("head.attention.in_proj_weight", (3 * h, h)),
            ("head.attention.in_proj_bias", (3 * h,)), ("head.attention.out_proj.weight", (h, h)),
            ("head.attention.out_proj.bias", (h,)), ("head.layernorm.weight", (h,)), ("head.layernorm.bias", (h,)),
            ("head.mlp.fc1.weight", (inter, h)), ("head.mlp.fc1.bias", (inter,)), ("head.mlp.fc2.weight", (h, inter)),
            ("head.mlp.fc2.bias", (h,)))]
    return _vit(cfg, "siglip_vision_model", patch_embedding_bias=True, num_position_embeddings=_patches(cfg),
                num_outer_norms=1, patch_embedding_inputs=_int(cfg, "num_channels") * _int(cfg, "patch_size") ** 2,
                extra_tensors=tuple(extra))


def _pixtral_tower(cfg: Config) -> dict[str, Any]:
    """PixtralVisionModel: bias-free patch conv, ln_pre RMSNorm, bias-free blocks with a gated MLP
    and RMSNorms, 2D rotary positions (no table)."""
    cfg.get("image_size")  # sizes the rotary frequencies only: no parameters
    return _vit(cfg, "pixtral", head_dim=cfg.get("head_dim"), mlp_gated=True, mlp_bias=False, qkv_bias=False,
                o_bias=False, norm_type=NormType.RMSNORM, num_outer_norms=1,
                patch_embedding_inputs=_int(cfg, "num_channels") * _int(cfg, "patch_size") ** 2)


TOWERS: dict[str, Callable[[Config], dict[str, Any]]] = {
    "clip_vision_model": _clip_tower, "siglip_vision_model": _siglip_tower, "pixtral": _pixtral_tower,
}


def _tower(parent: _Tracked, composite: str) -> tuple[_Tracked, dict[str, Any]]:
    d = hf_defaults()
    raw = parent._cfg.get("vision_config")
    vt = (raw or {}).get("model_type") if isinstance(raw, Mapping) else None
    vt = vt or d.subconfig_type(composite, "vision_config")
    if vt not in TOWERS:
        raise UnsupportedModelError(f"unsupported vision tower {vt!r}; supported: {', '.join(sorted(TOWERS))}",
                                    field="vision_config.model_type", hint=SPEC_FIELDS_HINT)
    vcfg = parent.child("vision_config", d.defaults(vt), d.when_absent(composite, "vision_config"))
    return vcfg, TOWERS[vt](vcfg)


def _text(parent: _Tracked, composite: str, name: str) -> tuple[_Tracked, dict[str, Any]]:
    """The language model of a composite config: its own family's translation and defaults."""
    d = hf_defaults()
    raw = parent._cfg.get("text_config")
    tt = (raw or {}).get("model_type") if isinstance(raw, Mapping) else None
    tt = tt or d.subconfig_type(composite, "text_config")
    translator = DEFAULTED.get(tt) or TRANSLATORS.get(tt)  # type: ignore[arg-type]
    if translator is None:
        raise UnsupportedModelError(f"unsupported text model_type {tt!r}", field="text_config.model_type",
                                    hint=SPEC_FIELDS_HINT)
    tcfg = parent.child("text_config", d.defaults(tt), d.when_absent(composite, "text_config"))
    return tcfg, {**translator(tcfg, name), **_dropouts(tcfg, tt)}


def _feature_layers(cfg: Config) -> int:
    layer = cfg.get("vision_feature_layer", -1)
    return len(layer) if isinstance(layer, list) else 1


def _tie(cfg: _Tracked, text: Config) -> bool:
    """The composite's tie_word_embeddings, or the text config's (pre-v5 configs saved it there;
    LlavaConfig and Qwen2VLConfig __post_init__ forward it)."""
    return _flag(cfg, "tie_word_embeddings") or _flag(text, "tie_word_embeddings")


def _vision_spec(tower: dict[str, Any], projector: list[tuple[str, tuple[int, ...]]]) -> VisionSpec:
    return VisionSpec(**tower, projector=tuple(NamedShape(name=n, shape=s) for n, s in projector))


def _llava(cfg: _Tracked, name: str) -> dict[str, Any]:
    """LlavaForConditionalGeneration: any text model, a CLIP (or SigLIP) tower, and a two-layer MLP
    projector (vision hidden x feature layers -> text hidden -> text hidden, biased unless
    multimodal_projector_bias is false); LLaVA-NeXT adds the image_newline vector."""
    composite = cfg["model_type"]
    tcfg, d = _text(cfg, composite, name)
    vcfg, tower = _tower(cfg, composite)
    th, vh = d["hidden_size"], tower["hidden_size"]
    bias = _flag(cfg, "multimodal_projector_bias", True)
    proj = [("linear_1.weight", (th, vh * _feature_layers(cfg))), ("linear_2.weight", (th, th))]
    if bias:
        proj += [("linear_1.bias", (th,)), ("linear_2.bias", (th,))]
    if composite == "llava_next":
        proj.append(("image_newline", (th,)))
    tower.update(_llava_image_tokens(cfg, vcfg, tower, composite))
    d.update(model_type=composite, tie_word_embeddings=_tie(cfg, tcfg), vision=_vision_spec(tower, proj))
    return d


def _llava_image_tokens(cfg: _Tracked, vcfg: Config, tower: dict[str, Any], composite: str) -> dict[str, int]:
    """The largest image's tokens as vLLM counts them (model_executor/models/llava.py and
    llava_next.py at v0.10.2, `get_num_image_tokens` / `get_image_size_with_most_features`): the
    tower's tokens per tile (patches, plus the class token for CLIP), less the class token under
    vision_feature_select_strategy "default"; LLaVA-NeXT adds, for the grid pinpoint (h, w) with
    the most features, the unpadded grid of (h / image_size) x (w / image_size) tiles of patches
    and one newline per row of patches. The tower runs over the base tile and every grid tile."""
    side = _int(vcfg, "image_size") // _int(vcfg, "patch_size")
    per_tile = side * side + (1 if tower.get("class_embedding") else 0)
    base = per_tile - 1 if cfg.get("vision_feature_select_strategy", "default") == "default" else per_tile
    if composite != "llava_next":
        return dict(image_tokens_max=base, image_encoder_tokens_max=per_tile)
    size = _int(vcfg, "image_size")
    best = (base, per_tile)
    for point in cfg.get("image_grid_pinpoints") or []:
        if not (isinstance(point, (list, tuple)) and len(point) == 2 and all(isinstance(x, int) and x > 0 for x in point)):
            continue  # a malformed pinpoint shapes no parameter; the processor would refuse it
        rows, cols = point[0] // size, point[1] // size
        tokens = base + (side * rows) * (side * cols) + side * rows
        if tokens > best[0]:
            best = (tokens, per_tile * (1 + rows * cols))
    return dict(image_tokens_max=best[0], image_encoder_tokens_max=best[1])


def _mistral3(cfg: _Tracked, name: str) -> dict[str, Any]:
    """Mistral3ForConditionalGeneration: a Mistral text model, a Pixtral tower, and a projector of an
    RMSNorm, a patch merger (vision hidden x spatial_merge_size^2 -> vision hidden) and a two-layer
    MLP; tie_word_embeddings defaults to true in Mistral3Config."""
    tcfg, d = _text(cfg, "mistral3", name)
    vcfg, tower = _tower(cfg, "mistral3")
    th, vh = d["hidden_size"], tower["hidden_size"]
    merge = _int(cfg, "spatial_merge_size")
    proj = [("norm.weight", (vh,)), ("patch_merger.merging_layer.weight", (vh, vh * merge**2)),
            ("linear_1.weight", (th, vh * _feature_layers(cfg))), ("linear_2.weight", (th, th))]
    if _flag(cfg, "multimodal_projector_bias"):
        proj += [("linear_1.bias", (th,)), ("linear_2.bias", (th,))]
    # vLLM's PixtralHFEncoderInfo (pixtral.py at v0.10.2): a square image of vision image_size runs
    # (image_size / patch)^2 patches and takes (image_size / (patch x spatial_merge_size))^2 tokens.
    side = _int(vcfg, "image_size") // _int(vcfg, "patch_size")
    tower.update(image_tokens_max=(side // merge) ** 2, image_encoder_tokens_max=side * side)
    d.update(model_type="mistral3", tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
             vision=_vision_spec(tower, proj))
    return d


def _gemma3(cfg: _Tracked, name: str) -> dict[str, Any]:
    """Gemma3ForConditionalGeneration: a Gemma 3 text model, a SigLIP tower, and a projector of an
    RMSNorm over the vision features and a (vision hidden x text hidden) matrix."""
    tcfg, d = _text(cfg, "gemma3", name)
    vcfg, tower = _tower(cfg, "gemma3")
    th, vh = d["hidden_size"], tower["hidden_size"]
    proj = [("mm_input_projection_weight", (vh, th)), ("mm_soft_emb_norm.weight", (vh,))]
    # The SigLIP tower runs every patch of its square image; average pooling leaves mm_tokens_per_image
    # (vLLM gemma3_mm.py at v0.10.2: processor.image_seq_length; pan-and-scan crops are off by default).
    tower.update(image_tokens_max=_int(cfg, "mm_tokens_per_image"), image_encoder_tokens_max=_patches(vcfg))
    d.update(model_type="gemma3", tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
             vision=_vision_spec(tower, proj))
    return d


# Llama4ImageProcessor's max_patches (the published preprocessor_config.json; vLLM's get_max_num_tiles
# reads it), which config.json does not carry.
LLAMA4_MAX_TILES = 16


def _llama4(cfg: _Tracked, name: str) -> dict[str, Any]:
    """Llama4ForConditionalGeneration: the Llama 4 text model and Llama4VisionModel (class vector,
    bias-free patch linear, (patches + 1) positions, pre/post LayerNorm, biased blocks, and the
    pixel-shuffle adapter fc1 intermediate -> projector_input_dim, fc2 projector_output_dim squared),
    then a bias-free linear vision_output_dim -> text hidden."""
    tcfg, d = _text(cfg, "llama4", name)
    v = cfg.child("vision_config", hf_defaults().defaults("llama4_vision_model"))
    inter, pin, pout = _int(v, "intermediate_size"), _int(v, "projector_input_dim"), _int(v, "projector_output_dim")
    tower = _vit(v, "llama4_vision_model", class_embedding=True, num_position_embeddings=_patches(v) + 1,
                 num_outer_norms=2, patch_embedding_inputs=_int(v, "num_channels") * _int(v, "patch_size") ** 2,
                 extra_tensors=(NamedShape(name="vision_adapter.mlp.fc1.weight", shape=(pin, inter)),
                                NamedShape(name="vision_adapter.mlp.fc2.weight", shape=(pout, pout))))
    th = d["hidden_size"]
    proj = [("linear_1.weight", (th, _int(v, "vision_output_dim")))]
    if _flag(v, "multi_modal_projector_bias"):
        proj.append(("linear_1.bias", (th,)))
    # The largest image: LLAMA4_MAX_TILES tiles of image_size (16:1) plus the global tile the processor
    # adds to a tiled image; each tile runs (patches + class) tokens through the tower and keeps
    # patches x pixel_shuffle_ratio^2 features (vLLM mllama4.py at v0.10.2, get_max_num_tiles,
    # get_image_size_with_most_features, get_patch_per_chunk).
    side = _int(v, "image_size") // _int(v, "patch_size")
    ratio = v.get("pixel_shuffle_ratio")
    shuffle = int(round(1.0 / float(ratio) ** 2)) if isinstance(ratio, (int, float)) and 0 < ratio <= 1 else 1
    chunks = LLAMA4_MAX_TILES + 1
    tower.update(image_tokens_max=chunks * (side * side // shuffle), image_encoder_tokens_max=chunks * (side * side + 1))
    d.update(model_type="llama4", tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
             vision=_vision_spec(tower, proj))
    return d


# max_pixels of Qwen2-VL's and Qwen2.5-VL's published preprocessor_config.json (Qwen2VLImageProcessor;
# 12845056 = 16384 x 28 x 28), which config.json does not carry and vLLM's profiling reads.
QWEN_VL_MAX_PIXELS = 12_845_056


def _qwen_vl(cfg: _Tracked, name: str) -> dict[str, Any]:
    """Qwen2VLForConditionalGeneration / Qwen2_5_VL: a Qwen2 text model (from text_config, or from
    the top level as pre-v5 configs store it) and a ViT with a 3D patch conv (channels x temporal x
    patch^2, no bias), no position table, and the patch merger as projector (a norm, then
    hidden x merge^2 -> same -> output width, biased). Qwen2-VL: LayerNorms and fc1/fc2 of
    embed_dim x mlp_ratio; Qwen2.5-VL: RMSNorms and a biased gated MLP of intermediate_size."""
    composite = cfg["model_type"]
    d_ = hf_defaults()
    text_type = d_.subconfig_type(composite, "text_config") or ""
    if cfg.given("text_config"):
        tcfg = cfg.child("text_config", d_.defaults(text_type))
        # Configs re-saved by transformers >= 4.53 also repeat the text keys at the top level; the
        # config class then builds its text config from text_config alone (Qwen2_5_VLConfig
        # __post_init__ reads the flat keys only when text_config is absent).
        for key in cfg._cfg.keys() & (tcfg._merged.keys() - HARMLESS_KEYS):
            flat, nested = cfg._cfg[key], tcfg._merged[key]
            cfg.acknowledge(key, None if flat == nested else (
                f"config key '{key}' ({flat!r}) is ignored, as transformers ignores it: its text model "
                f"reads text_config.{key} ({nested!r})"))
    else:  # flat pre-v5 config: the text keys are the top-level ones
        tcfg = _Tracked({}, {**d_.defaults(text_type), **cfg._cfg})
        cfg._children.append(tcfg)
        tcfg._cfg = {}
        cfg._read |= {k for k in cfg._cfg if k in d_.defaults(text_type)}
    d = {**_qwen2(tcfg, name), **_dropouts(tcfg, "qwen2")}
    raw_v = cfg._cfg.get("vision_config")
    vtype = d_.subconfig_type(composite, "vision_config") or ""
    v = cfg.child("vision_config", d_.defaults(vtype))
    if isinstance(raw_v, Mapping):
        v._read.add("model_type")
    patch = _int(v, "patch_size")
    inputs = _int(v, "in_channels") * _int(v, "temporal_patch_size") * patch * patch
    merge = _int(v, "spatial_merge_size")
    if composite == "qwen2_vl":
        vh = _int(v, "embed_dim")
        out = _int(v, "hidden_size")
        tower = dict(model_type="qwen2_vl_vision", hidden_size=vh, intermediate_size=vh * _int(v, "mlp_ratio"),
                     norm_type=NormType.LAYERNORM, mlp_gated=False)
        ln = [("merger.ln_q.weight", (vh,)), ("merger.ln_q.bias", (vh,))]
    else:
        vh = _int(v, "hidden_size")
        out = _int(v, "out_hidden_size")
        tower = dict(model_type="qwen2_5_vl_vision", hidden_size=vh, intermediate_size=_int(v, "intermediate_size"),
                     norm_type=NormType.RMSNORM, mlp_gated=True)
        ln = [("merger.ln_q.weight", (vh,))]
    wide = vh * merge**2
    proj = ln + [("merger.mlp.0.weight", (wide, wide)), ("merger.mlp.0.bias", (wide,)),
                 ("merger.mlp.2.weight", (out, wide)), ("merger.mlp.2.bias", (out,))]
    # The largest image the processor admits: max_pixels / (patch x merge)^2 tokens after the merger,
    # merge^2 times as many patches through the tower (vLLM qwen2_vl.py at v0.10.2,
    # get_image_size_with_most_features with the processor's max_pixels).
    tokens = QWEN_VL_MAX_PIXELS // (patch * merge) ** 2
    vision = VisionSpec(num_layers=_int(v, "depth"), num_attention_heads=_int(v, "num_heads"),
                        patch_embedding_inputs=inputs, **tower, image_tokens_max=tokens,
                        image_encoder_tokens_max=tokens * merge**2,
                        projector=tuple(NamedShape(name=n, shape=s) for n, s in proj))
    d.update(model_type=composite, tie_word_embeddings=_tie(cfg, tcfg), vision=vision)
    return d


# MllamaVisionConfig.__post_init__'s default supported_aspect_ratios (for max_num_tiles 4).
MLLAMA_ASPECT_RATIOS = [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]
MLLAMA_INTERMEDIATE_LAYERS = [3, 7, 15, 23, 30]  # MllamaVisionConfig's default intermediate_layers_indices
MLLAMA_CROSS_LAYERS = [3, 8, 13, 18, 23, 28, 33, 38]  # MllamaTextConfig's default cross_attention_layers
# MllamaTextModel.embed_tokens = nn.Embedding(vocab_size + 8, ...): the image token, padded to 8 rows
# (vLLM's MllamaTextModel.embed_tokens is VocabParallelEmbedding(vocab_size + 8) too).
MLLAMA_EMBEDDING_EXTRA_ROWS = 8


def _mllama(cfg: _Tracked, name: str) -> dict[str, Any]:
    """MllamaForConditionalGeneration (Llama 3.2 Vision; transformers models/mllama/modeling_mllama.py).

    Text: a Llama decoder whose `cross_attention_layers` are cross-attention decoder layers (q/k/v/o
    of the same shapes, q/k RMSNorms, tanh gates; params.cross_attention_extra_weights), head_dim =
    hidden / heads, an embedding of vocab_size + 8 rows and an lm_head of vocab_size.
    Vision (MllamaVisionModel): a bias-free patch conv, a class vector, a gated position table of
    (patches + 1) rows with its gate and a tile table of (aspect ratios + 1) x (tiles x (patches + 1) x
    hidden), pre- and post-tile aspect-ratio embeddings of (aspect ratios + 1) x (tiles x hidden) with
    gates, layernorm_pre/post, a local transformer of num_hidden_layers and a global one of
    num_global_layers CLIP-style blocks (q/k/v/o without bias, fc1/fc2 with bias, two LayerNorms; the
    global ones with two scalar gates each). Projector: a biased Linear vision_output_dim -> text hidden."""
    d = hf_defaults()
    # MllamaConfig.sub_configs_defaults (hf_defaults.yaml `subconfigs`): the nested configs' model types
    text_type, vision_type = d.subconfig_type("mllama", "text_config"), d.subconfig_type("mllama", "vision_config")
    tcfg = cfg.child("text_config", d.defaults(text_type))
    v = cfg.child("vision_config", d.defaults(vision_type))
    for sub in (tcfg, v):
        sub._read.add("model_type")
    text = _common(tcfg, name, "mllama")
    layers = text["num_layers"]
    cross = tcfg.get("cross_attention_layers") or MLLAMA_CROSS_LAYERS
    if not isinstance(cross, list) or not all(isinstance(i, int) and 0 <= i < layers for i in cross):
        raise InputFileError(f"must list layer indices below {layers}, got {str(cross)[:60]}",
                             field="text_config.cross_attention_layers", hint="use the value from the model's config.json")
    text.update(head_dim=None, tie_word_embeddings=_flag(tcfg, "tie_word_embeddings"),
                layer_types=tuple(LayerType.CROSS if i in set(cross) else LayerType.FULL for i in range(layers)),
                attention_dropout=_number(tcfg, "dropout", tcfg.get("dropout") or 0.0), hidden_dropout=0.0)
    h, inter = _int(v, "hidden_size"), _int(v, "intermediate_size")
    tiles, patch = _int(v, "max_num_tiles"), _int(v, "patch_size")
    per_tile = _patches(v) + 1  # patches and the class token
    ratios = v.get("supported_aspect_ratios") or MLLAMA_ASPECT_RATIOS
    if not isinstance(ratios, list) or not ratios:
        raise InputFileError("must be a non-empty list of [width, height] tile counts",
                             field="vision_config.supported_aspect_ratios")
    ar_rows = len(ratios) + 1  # MllamaVisionConfig.max_aspect_ratio_id + 1
    local, num_global = _int(v, "num_hidden_layers"), _int(v, "num_global_layers")
    kept = v.get("intermediate_layers_indices") or MLLAMA_INTERMEDIATE_LAYERS
    extra = [("gated_positional_embedding.gate", (1,)),
             ("gated_positional_embedding.tile_embedding.weight", (ar_rows, tiles * per_tile * h)),
             ("pre_tile_positional_embedding.embedding.weight", (ar_rows, tiles * h)),
             ("pre_tile_positional_embedding.gate", (1,)),
             ("post_tile_positional_embedding.embedding.weight", (ar_rows, tiles * h)),
             ("post_tile_positional_embedding.gate", (1,)),
             ("global_transformer.layers.gate_attn", (num_global,)),
             ("global_transformer.layers.gate_ffn", (num_global,))]
    th = text["hidden_size"]
    proj = [("weight", (th, _int(v, "vision_output_dim"))), ("bias", (th,))]
    # The largest image runs max_num_tiles x ((image_size // 14)^2 + 1) tokens through the tower and the
    # cross-attention layers attend to all of them (vLLM model_executor/models/mllama.py
    # get_max_mllama_image_tokens at v0.6.3.post1 and v0.6.6.post1), while the decoder holds one <|image|>
    # token for it (dummy_decoder_seq_data): image_tokens_max is that one token. So the V0 profile's
    # clamp of its dummy sequences by the images' decoder tokens leaves max_num_seqs of them, one image
    # each, as vLLM's enc_dec_model_runner.profile_run builds them (no clamp; v0.6.3.post1-v0.7.3).
    vision = VisionSpec(
        model_type=vision_type, hidden_size=h, num_layers=local + num_global,
        num_attention_heads=_int(v, "attention_heads"), intermediate_size=inter, mlp_gated=False, mlp_bias=True,
        qkv_bias=False, o_bias=False, norm_type=NormType.LAYERNORM,
        patch_embedding_inputs=_int(v, "num_channels") * patch * patch, class_embedding=True,
        num_position_embeddings=per_tile, num_outer_norms=2,
        extra_tensors=tuple(NamedShape(name=n, shape=sh) for n, sh in extra),
        projector=tuple(NamedShape(name=n, shape=sh) for n, sh in proj),
        image_tokens_max=1, image_encoder_tokens_max=tiles * per_tile,
        text_embedding_extra_rows=MLLAMA_EMBEDDING_EXTRA_ROWS,
        num_kept_hidden_states=len(kept) if isinstance(kept, list) else 0, num_tiles_max=tiles)
    text.update(model_type="mllama", vision=vision)
    return text


# Families whose translation reads transformers' defaults (hf_defaults.yaml) and warns on unread keys.
DEFAULTED: dict[str, Callable[[Any, str], dict[str, Any]]] = {
    "gpt_oss": _gpt_oss,
    "phimoe": _phimoe,
    "gemma3_text": _gemma3_text,
    "gemma3": _gemma3,
    "llama4_text": _llama4_text,
    "llama4": _llama4,
    "qwen3_next": _qwen3_next,
    "llava": _llava,
    "llava_next": _llava,
    "mistral3": _mistral3,
    "qwen2_vl": _qwen_vl,
    "qwen2_5_vl": _qwen_vl,
    "mllama": _mllama,
}
ARCHITECTURES.update({
    "GptOssForCausalLM": "gpt_oss", "PhimoeForCausalLM": "phimoe", "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3", "Llama4ForCausalLM": "llama4_text",
    "Llama4ForConditionalGeneration": "llama4", "Qwen3NextForCausalLM": "qwen3_next",
    "LlavaForConditionalGeneration": "llava", "LlavaNextForConditionalGeneration": "llava_next",
    "Mistral3ForConditionalGeneration": "mistral3", "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "MllamaForConditionalGeneration": "mllama",
})
