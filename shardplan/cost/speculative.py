"""Speculative decoding in serving memory: a draft model, or the target's own multi-token-prediction
(MTP) layers, or n-gram lookup (no memory).

What a rank holds, following vLLM V1 (sources at the tags named):

- The draft runs with the target's tensor-parallel size: `draft_tensor_parallel_size` defaults
  to `tensor_parallel_size` (vllm/config/speculative.py `_verify_and_get_draft_tp` at v0.11.0)
  and a separate draft model must use it (vllm/v1/spec_decode/draft_model.py
  `_raise_if_draft_tp_mismatch` at v0.22.0). It lives on the last pipeline rank only
  (vllm/v1/worker/gpu_model_runner.py at v0.11.0: the drafter is built `if ... is_last_rank`).
- A draft model keeps all its own weights, embedding and lm_head included (draft_model.py
  `_maybe_share_embeddings` / `_maybe_share_lm_head` do nothing), unquantized (`quant_config=None`)
  in the target's dtype, and must have the target's vocabulary size
  (vllm/config/speculative.py `verify_equal_vocab_size_if_draft_model` at v0.22.0).
- MTP: each of the model's `num_mtp_layers` modules is loaded (DeepSeekMultiTokenPredictor
  builds one per `num_nextn_predict_layers`, vllm/model_executor/models/deepseek_mtp.py at
  v0.11.0) with the target's quantization (speculative.py: "Align the quantization of draft
  model"): enorm, hnorm, the replicated 2h->h eh_proj, one decoder block, and its SharedHead:
  a norm and its own vocabulary-parallel `head`, loaded from the checkpoint. The embedding is
  shared with the target when pp = 1 (vllm/v1/spec_decode/eagle.py `load_model` at v0.11.0)
  and loaded again otherwise.
- KV: the draft's attention layers join the target's in one KV cache group of uniform type
  (vllm/v1/core/kv_cache_utils.py `UniformTypeKVCacheSpecs`, `get_kv_cache_config_from_groups`
  at v0.11.0): a block's page is the sum of every layer's page, so each token costs the
  target's bytes plus the draft's and the block count falls in that ratio.
- The scheduler allocates `num_speculative_tokens` lookahead slots per running request
  (vllm/v1/core/sched/scheduler.py `num_lookahead_tokens` at v0.11.0); the start-up check
  (`check_enough_kv_cache_memory`) still counts max_model_len tokens only.
- The profiling pass runs the drafter after the target (`self.drafter.dummy_run(num_tokens)`
  in gpu_model_runner.py `_dummy_run` at v0.11.0), with the target's hidden states still held.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shardplan.cost.kv import num_kv_layers
from shardplan.cost.layout import Layout
from shardplan.cost.params import mtp_weights
from shardplan.cost.weights import bytes_per_weight_element, numel_per_rank, stage_weights
from shardplan.cost.workload import Quantization
from shardplan.specs.model import ModelSpec
from shardplan.units import DType, bytes_per_element


class SpeculativeMethod(str, Enum):
    """vLLM's `--speculative-config` method names."""

    DRAFT_MODEL = "draft_model"  # a smaller model of the same vocabulary
    MTP = "mtp"  # the target's multi-token-prediction layers (DeepSeek-V3's NextN)
    NGRAM = "ngram"  # prompt lookup: no weights, no KV


@dataclass(frozen=True)
class Speculative:
    """The speculative setup of a serving workload."""

    method: SpeculativeMethod
    num_speculative_tokens: int  # K: tokens proposed per step (lookahead slots per sequence)
    draft: ModelSpec | None = None  # the draft model (draft_model only)
    draft_source: str | None = None  # where it was loaded from, as given (a bundled name or a path)
    draft_hf_id: str | None = None  # its Hugging Face id, when known (what an engine loads)

    @property
    def draft_name(self) -> str | None:
        return self.draft.name if self.draft is not None else None


def _draft_layout(layout: Layout) -> Layout:
    """The draft's own layout: the target's tensor-parallel size, one stage, no experts split."""
    return Layout(tp=layout.tp)


def draft_weight_bytes_per_rank(spec: ModelSpec, sp: Speculative, layout: Layout, quantization: Quantization,
                                dense_dtype: DType) -> float:
    """Bytes of the drafter's weights on one rank of the last pipeline stage.

    draft_model: every tensor of the draft at tp = the target's, in `dense_dtype`, unquantized,
    plus its rotary cos/sin cache (max_position_embeddings x rotary_dim, as the target's).
    mtp: num_mtp_layers x (mtp_weights split as the target's layers, at the target's
    quantization, + the SharedHead's vocab x hidden / tp head) + the embedding when pp > 1."""
    if sp.method is SpeculativeMethod.DRAFT_MODEL and sp.draft is not None:
        d = sp.draft
        w = stage_weights(d, _draft_layout(layout), 0, quantization=Quantization.NONE, dense_dtype=dense_dtype)
        return w.bytes + d.max_position_embeddings * d.rotary_dim * bytes_per_element(dense_dtype)
    if sp.method is SpeculativeMethod.MTP:
        a = bytes_per_element(dense_dtype)
        per_layer = sum(numel_per_rank(w, spec, layout) * bytes_per_weight_element(w, quantization, dense_dtype)
                        for w in mtp_weights(spec))
        head = spec.vocab_size * spec.hidden_size / layout.tp * a  # SharedHead.head: ParallelLMHead
        embedding = spec.vocab_size * spec.hidden_size / layout.tp * a if layout.pp > 1 else 0.0
        return spec.num_mtp_layers * (per_layer + head) + embedding
    return 0.0


def draft_kv_bytes_per_token_per_rank(spec: ModelSpec, sp: Speculative, tp: int, kv_bytes_per_element: float) -> float:
    """KV bytes one token adds to the drafter's layers on one last-stage rank: the draft's KV
    layers x its per-layer bytes (heads over tp, replicated past its KV heads), or one MTP
    layer's (the target's attention) per MTP module."""
    from shardplan.cost.memory_serving import kv_bytes_per_token_per_layer_per_rank

    if sp.method is SpeculativeMethod.DRAFT_MODEL and sp.draft is not None:
        d = sp.draft
        return kv_bytes_per_token_per_layer_per_rank(d, tp, kv_bytes_per_element) * num_kv_layers(d)
    if sp.method is SpeculativeMethod.MTP:
        return kv_bytes_per_token_per_layer_per_rank(spec, tp, kv_bytes_per_element) * spec.num_mtp_layers
    return 0.0


def lookahead_tokens(sp: Speculative | None) -> int:
    """Slots the scheduler adds to each running request: K (0 without speculation)."""
    return sp.num_speculative_tokens if sp is not None else 0


def draft_split_problem(sp: Speculative | None, tp: int) -> str | None:
    """Why the draft cannot run at this tensor-parallel size (its query heads must divide over
    tp, as vLLM's column-parallel q projection requires), or None."""
    if sp is None or sp.draft is None:
        return None
    heads = sp.draft.num_attention_heads
    if heads % tp:
        return f"the draft {sp.draft.name}'s {heads} attention heads do not divide over tp = {tp} (vLLM runs the draft at the target's tp)"
    return None


def assumption(sp: Speculative) -> str:
    """The line printed beside the figures: what was counted, with its source."""
    k = sp.num_speculative_tokens
    if sp.method is SpeculativeMethod.NGRAM:
        return (f"speculative decoding: ngram, K = {k}: no draft weights or KV; {k} lookahead slots per sequence "
                f"(vllm/v1/core/sched/scheduler.py at v0.11.0)")
    if sp.method is SpeculativeMethod.MTP:
        what = ("the model's MTP module(s) (enorm, hnorm, eh_proj, one decoder block, SharedHead norm and its own "
                "lm_head; the embedding shared at pp = 1) at the target's quantization, their attention's KV in "
                "the same pool")
    else:
        what = (f"the draft {sp.draft_name}'s weights (all of them, unquantized, split over the target's tp) and "
                f"its layers' KV in the same pool")
    return (f"speculative decoding: {sp.method.value}, K = {k}: {what} on the last pipeline stage (one KV cache "
            f"group: vllm/v1/core/kv_cache_utils.py at v0.11.0; draft tp = target tp: vllm/config/speculative.py); "
            f"{k} lookahead slots per sequence; the drafter's forward in the profiling pass")


__all__ = ["SpeculativeMethod", "Speculative", "draft_weight_bytes_per_rank", "draft_kv_bytes_per_token_per_rank",
           "lookahead_tokens", "draft_split_problem", "assumption"]
