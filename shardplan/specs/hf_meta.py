"""A ModelSpec for a model_type shardplan has no translation for, read off the model transformers
builds on the meta device (shapes only: no memory, no weights).

torch and transformers are imported inside `translate_with_transformers` only, so that planning
never loads them (tests/test_architecture.py allows this one file to, in functions). The spec
keeps the config's sizes (layers, hidden, heads, KV heads, head_dim, MLP width, vocabulary) with
a Llama-shaped block, and `measured_num_params` the parameters the module really has: the count
reports the difference to its analytic figure as component "other", so the total is exact while
the per-layer split is an approximation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardplan.errors import UnsupportedModelError
from shardplan.specs.model import MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH

if TYPE_CHECKING:
    from shardplan.specs.hf import Translation

INSTALL_HINT = "pip install 'shardplan[hf]'"


def _stored_numel(module: Any) -> int:
    """Parameters (tied ones once) and persistent floating-point buffers, as a checkpoint stores them."""
    n = sum(p.numel() for p in module.parameters())
    for mod in module.modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is not None and bname not in mod._non_persistent_buffers_set and buf.is_floating_point():
                n += buf.numel()
    return n


def _first(cfg: Any, *names: str) -> Any:
    for n in names:
        value = getattr(cfg, n, None)
        if value is not None:
            return value
    return None


def translate_with_transformers(cfg: Mapping[str, Any], name: str) -> Translation:
    """Build `cfg` with transformers on the meta device and describe it as ModelSpec fields."""
    from shardplan.specs.hf import HARMLESS_KEYS, SPEC_FIELDS_HINT, Translation, config_dtype

    label = cfg.get("model_type")
    dtype = config_dtype(cfg, "bfloat16")  # the file's error before any build
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError:
        raise UnsupportedModelError(
            f"unsupported model_type {label!r} and transformers is not installed to build it",
            field="model_type", hint=f"{INSTALL_HINT}, or {SPEC_FIELDS_HINT}") from None
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "auto_map")}
    try:
        config = AutoConfig.for_model(label, **kwargs)
    except Exception as e:  # noqa: BLE001 - a foreign config class may raise anything (transformers >= 5's strict
        # dataclass validation raises huggingface_hub errors that are neither ValueError nor TypeError)
        raise UnsupportedModelError(f"unsupported model_type {label!r}; transformers "
                                    f"{transformers.__version__} cannot read it either ({str(e)[:120]})",
                                    field="model_type", hint=SPEC_FIELDS_HINT) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(text, "num_attention_heads", "n_head")
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    vocab = _first(text, "vocab_size")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (layers, heads, hidden, vocab)):
        raise UnsupportedModelError(
            f"unsupported model_type {label!r}: its config gives no attention decoder shape "
            "(num_hidden_layers, num_attention_heads, hidden_size, vocab_size)",
            field="model_type", hint=SPEC_FIELDS_HINT)
    # Building walks every layer even on the meta device: bound the work before it starts.
    for what, value, most in (("num_hidden_layers", layers, MAX_LAYERS), ("hidden_size", hidden, MAX_WIDTH),
                              ("num_attention_heads", heads, MAX_HEADS), ("vocab_size", vocab, MAX_VOCAB)):
        if value > most:
            raise UnsupportedModelError(f"{what} {value} is more than shardplan plans for ({most})", field=what,
                                        hint="check the config")
    try:
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(config)
            except ValueError:
                model = AutoModel.from_config(config)
    except Exception as e:  # noqa: BLE001 - any failure of a foreign model's constructor
        raise UnsupportedModelError(f"unsupported model_type {label!r}; transformers {transformers.__version__} "
                                    f"could not build it ({type(e).__name__}: {str(e)[:120]})",
                                    field="model_type", hint=SPEC_FIELDS_HINT) from None
    if not any("attn" in n or "attention" in n for n, _ in model.named_modules()):
        raise UnsupportedModelError(
            f"unsupported model_type {label!r}: transformers builds it, but it has no attention layers "
            "and shardplan plans attention decoders", field="model_type", hint=SPEC_FIELDS_HINT)
    kv = _first(text, "num_key_value_heads", "num_kv_heads")
    kv = heads if kv is None else kv  # ModelSpec refuses 0 and non-divisors with the key named
    head_dim = _first(text, "head_dim")
    if not isinstance(head_dim, int):
        head_dim = hidden // heads
    inter = _first(text, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    fields: dict[str, Any] = dict(
        name=name, model_type=str(label), vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_attention_heads=heads, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        max_position_embeddings=_first(text, "max_position_embeddings", "n_positions") or 2048,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        dtype=dtype,
    )
    fields["measured_num_params"] = _stored_numel(model)
    note = (f"spec derived from transformers {transformers.__version__} on the meta device "
            f"({type(model).__name__}); per-layer shapes are Llama-like, the total is the module's")
    warnings = tuple(f"config key '{key}' is not understood by shardplan and was ignored, as {type(config).__name__} "
                     f"does not define it either; check that it changes no parameter count or cache size"
                     for key in sorted(set(cfg) - _defined_keys(config) - HARMLESS_KEYS))
    return Translation(fields, warnings, (note,))


def _defined_keys(config: Any) -> set[str]:
    """The keys `config`'s class defines (its defaults' keys and attribute_map aliases): transformers
    builds the model from these, and keeps any other key as an attribute no modelling code reads."""
    try:
        defaults = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a foreign config class may refuse its own defaults: name nothing then
        return set(config.to_dict())
    return set(defaults) | set(getattr(config, "attribute_map", None) or {})
