"""ModelSpec: the architecture facts that every memory and time figure starts from.

One frozen, strict value object covers dense decoders (MHA/GQA/MQA, explicit head_dim,
QKV bias, q/k norms, tied embeddings, parallel residual, partial rotary, sliding-window and
alternating local/global layers), mixture-of-experts (top-k routing, shared experts, a
dense prefix, router bias) and multi-head latent attention (DeepSeek V2/V3), plus
multi-token-prediction layers, which are counted apart from the main total. A per-layer
attention pattern (`layer_types`: full, sliding-window, chunked and linear-attention layers)
covers Gemma 3, gpt-oss, Llama 4 and Qwen3-Next; `vision` adds a multimodal model's vision
tower and projector, counted in the total and reported apart.

Field conventions: sizes are element counts (`_size`, `num_`), never bytes; `None` means
"not used" where a field says so.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardplan.specs._base import StrictModel
from shardplan.units import DTYPE_ALIASES

# Upper bounds, far above any published model (Llama 3.1 405B: 126 layers, 53248-wide MLP;
# Gemma 3: 262k vocabulary; Kimi K2: 384 experts; Llama 4 Scout: 10M tokens of context), that
# keep every byte, FLOP and time figure a finite float and every per-layer loop short. A file
# past them is a mistake or an attack, and is refused with the field named.
MAX_WIDTH = 2**20  # hidden, MLP, head and latent dimensions (elements)
MAX_VOCAB = 2**24
MAX_LAYERS = 1024  # 8x the deepest released LLM (126), above DeepNet's 1,000 (Wang et al. 2022, arXiv:2203.00555)
MAX_HEADS = 2**16
MAX_EXPERTS = 2**16
MAX_TOKENS = 2**30  # context lengths and windows


class NormType(str, Enum):
    """RMSNorm stores one weight vector; LayerNorm a weight and a bias."""

    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"


class PositionEmbedding(str, Enum):
    ROPE = "rope"  # rotary: no parameters, a cos/sin cache buffer
    LEARNED = "learned"  # a (max_position_embeddings x hidden) table (GPT-2, GPT-3)
    ALIBI = "alibi"  # no parameters
    NONE = "none"


class QKNorm(str, Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # RMSNorm(head_dim) shared by all heads (Qwen3, Gemma 3)
    FULL = "full"  # RMSNorm over all heads (OLMo 2): num_heads*head_dim (q), num_kv_heads*head_dim (k)


class AttentionKind(str, Enum):
    MHA = "mha"
    GQA = "gqa"
    MQA = "mqa"
    MLA = "mla"


class LayerType(str, Enum):
    """What one layer's token mixer is (transformers' `config.layer_types` vocabulary)."""

    FULL = "full_attention"  # attends to every earlier token; KV grows with the sequence
    SLIDING = "sliding_attention"  # attends to the last `sliding_window` tokens
    CHUNKED = "chunked_attention"  # attends within its `attention_chunk_size` block (Llama 4)
    LINEAR = "linear_attention"  # a fixed-size recurrent state, no KV cache (Qwen3-Next Gated DeltaNet)
    # Attends to the vision encoder's tokens, not the sequence's own (Mllama's cross-attention decoder
    # layers: q/k/v/o with per-head q/k RMSNorms and tanh gates on the attention and MLP branches).
    CROSS = "cross_attention"


class LinearAttentionSpec(StrictModel):
    """Gated DeltaNet (Yang et al. 2024, "Gated Delta Networks", Sec. 3), as Qwen3-Next builds it
    (transformers models/qwen3_next/modeling_qwen3_next.py, Qwen3NextGatedDeltaNet): q and k
    of `num_key_heads` x `key_head_dim`, v and the output gate z of `num_value_heads` x
    `value_head_dim`, a depthwise causal conv of `conv_kernel_size` over q, k and v, and per
    value head a decay (A_log), a step bias (dt_bias) and the beta/alpha projections."""

    num_key_heads: int = Field(..., gt=0, le=MAX_HEADS, description="query/key heads")
    num_value_heads: int = Field(..., gt=0, le=MAX_HEADS, description="value heads (a multiple of num_key_heads)")
    key_head_dim: int = Field(..., gt=0, le=MAX_WIDTH, description="elements per query/key head")
    value_head_dim: int = Field(..., gt=0, le=MAX_WIDTH, description="elements per value head")
    conv_kernel_size: int = Field(..., gt=0, le=64, description="taps of the short causal convolution (tokens)")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_elements_per_sequence(self) -> int:
        """Recurrent state of one layer for one sequence, whatever its length: the delta-rule
        matrix (one key_head_dim x value_head_dim matrix per value head) plus the conv window
        (conv_kernel_size - 1 past inputs of conv_dim channels); the cache transformers and vLLM
        keep (Qwen3NextDynamicCache recurrent_states / conv_states)."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim + self.conv_dim * (self.conv_kernel_size - 1)


class NamedShape(StrictModel):
    """One stored tensor outside the repeated blocks: its name and shape (elements)."""

    name: str = Field(..., min_length=1)
    shape: tuple[int, ...] = Field(..., min_length=1, description="dimensions (elements)")

    @model_validator(mode="after")
    def _check(self) -> "NamedShape":
        if any(d <= 0 or d > MAX_VOCAB * MAX_WIDTH for d in self.shape):
            raise ValueError(f"every dimension of {self.name} must be positive and bounded")
        return self


class VisionSpec(StrictModel):
    """A multimodal model's vision tower (a ViT: patch embedding, `num_layers` identical
    pre-norm blocks, optional class token, learned position table and outer norms) and the
    projector that maps its features into the language model's embedding space. The tower's
    blocks are described by fields; the few tensors that differ between families (Llama 4's
    pixel-shuffle adapter, Qwen2-VL's patch merger, Gemma 3's soft-embedding norm) are listed
    in `extra_tensors` (tower) and `projector` with their shapes."""

    model_type: str = Field(..., description="the tower's HF model_type (clip_vision_model, siglip_vision_model, ...)")
    hidden_size: int = Field(..., gt=0, le=MAX_WIDTH)
    num_layers: int = Field(..., gt=0, le=MAX_LAYERS)
    num_attention_heads: int = Field(..., gt=0, le=MAX_HEADS)
    head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="None: hidden_size / num_attention_heads")
    intermediate_size: int = Field(..., gt=0, le=MAX_WIDTH, description="MLP width of a block")
    mlp_gated: bool = Field(False, description="gate/up/down (Pixtral, Qwen2.5-VL) vs fc1/fc2")
    mlp_bias: bool = True
    qkv_bias: bool = True
    o_bias: bool = True
    norm_type: NormType = NormType.LAYERNORM
    patch_embedding_inputs: int = Field(..., gt=0, le=MAX_WIDTH, description="channels x (temporal x) patch x patch")
    patch_embedding_bias: bool = False
    class_embedding: bool = Field(False, description="a learned [CLS] vector (CLIP, Llama 4)")
    num_position_embeddings: int = Field(0, ge=0, le=MAX_TOKENS, description="rows of a learned position table; 0: rotary or none")
    num_outer_norms: int = Field(0, ge=0, le=4, description="norms of hidden_size around the encoder (pre/post layernorm)")
    extra_tensors: tuple[NamedShape, ...] = Field((), description="tower tensors outside this pattern")
    projector: tuple[NamedShape, ...] = Field((), description="the multimodal projector's tensors")
    # The processor's largest image, as serving engines size their profiling pass by it (vLLM
    # `get_max_image_tokens`, `get_image_size_with_most_features`); None: not known for the family.
    image_tokens_max: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="language-model placeholder tokens of the largest image (tokens)")
    image_encoder_tokens_max: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="tokens the tower runs over for that image: patches (and class "
                                              "tokens) of every tile, before any merger or pooling (tokens)")
    # Mllama (transformers MllamaTextModel, vLLM MllamaTextModel): the language model's token embedding has
    # vocab_size + 8 rows (the image token, padded), the output layer vocab_size; the tower keeps the hidden
    # states of `intermediate_layers_indices` to the end and concatenates them to its output.
    text_embedding_extra_rows: int = Field(
        0, ge=0, le=MAX_VOCAB, description="rows of the language model's token embedding beyond vocab_size (rows)")
    num_kept_hidden_states: int = Field(
        0, ge=0, le=MAX_LAYERS, description="intermediate hidden states the tower holds until its output (tensors "
                                            "of tokens x hidden)")
    num_tiles_max: int = Field(1, gt=0, le=1024, description="tiles of the largest image that the tower attends "
                                                             "across at once (Mllama: max_num_tiles)")

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


class MLASpec(StrictModel):
    """Multi-head latent attention (DeepSeek-V2 Sec. 2.1): K and V are compressed into a
    shared latent of `kv_lora_rank` plus a decoupled rotary key of `qk_rope_head_dim`;
    the KV cache stores only those two per token per layer."""

    q_lora_rank: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="rank of the query compression; None: a direct hidden->heads projection"
    )
    kv_lora_rank: int = Field(..., gt=0, le=MAX_WIDTH, description="latent KV dimension (elements)")
    qk_rope_head_dim: int = Field(..., gt=0, le=MAX_WIDTH, description="decoupled rotary key/query dim per head")
    qk_nope_head_dim: int = Field(..., gt=0, le=MAX_WIDTH, description="non-rotary query/key dim per head")
    v_head_dim: int = Field(..., gt=0, le=MAX_WIDTH, description="value dim per head")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MoESpec(StrictModel):
    """Mixture-of-experts MLP (Mixtral, Qwen-MoE, DeepSeek-MoE)."""

    num_experts: int = Field(..., gt=0, le=MAX_EXPERTS, description="routed experts per MoE layer")
    num_experts_per_token: int = Field(..., gt=0, le=MAX_EXPERTS, description="top-k routed experts per token")
    expert_intermediate_size: int = Field(..., gt=0, le=MAX_WIDTH, description="MLP width of one routed expert")
    num_shared_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="always-active experts (DeepSeek, Qwen2-MoE)")
    shared_expert_intermediate_size: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="MLP width of one shared expert; None: same as a routed expert"
    )
    shared_expert_gate: bool = Field(False, description="a sigmoid gate (hidden->1) on the shared expert (Qwen2-MoE)")
    router_bias: bool = Field(
        False, description="a stored per-expert bias in the router (DeepSeek-V3 e_score_correction_bias)"
    )
    router_linear_bias: bool = Field(False, description="the router linear has a bias (gpt-oss)")
    first_dense_layers: int = Field(0, ge=0, le=MAX_LAYERS, description="leading layers with a dense MLP (DeepSeek first_k_dense_replace)")
    moe_layer_step: int = Field(1, gt=0, le=MAX_LAYERS, description="layer i (0-based) is MoE when (i+1) % step == 0 (Qwen decoder_sparse_step)")
    dense_layer_indices: tuple[int, ...] = Field((), description="0-based layers forced dense (Qwen mlp_only_layers)")

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"num_experts_per_token ({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})"
            )
        return self

    @property
    def shared_intermediate_size(self) -> int:
        return self.shared_expert_intermediate_size or self.expert_intermediate_size


# A quantized checkpoint's kind (ModelSpec.checkpoint_quantization) -> the weight format it is planned in
# (--quantization) and how a note names it.
CHECKPOINT_KINDS: dict[str, tuple[str, str]] = {
    "awq": ("awq", "4-bit AWQ"),
    "gptq": ("gptq", "4-bit GPTQ"),
    "ct-fp8": ("fp8", "FP8 (compressed-tensors)"),
    "ct-int8": ("int8", "INT8 W8A8 (compressed-tensors)"),
    "ct-w4a16": ("int4", "4-bit W4A16 (compressed-tensors)"),
}
# Kinds whose weights are 4-bit in groups along each input (ModelSpec.checkpoint_group_size).
GROUPED_CHECKPOINT_KINDS = ("awq", "gptq", "ct-w4a16")


class ModelSpec(StrictModel):
    """A decoder-only transformer, as its checkpoint stores it."""

    name: str = Field(..., min_length=1)
    model_type: str = Field("custom", description="the family label (HF model_type), informational")
    source: str | None = Field(None, description="where the numbers come from")

    vocab_size: int = Field(..., gt=0, le=MAX_VOCAB, description="rows of the embedding table (as stored, padding included)")
    hidden_size: int = Field(..., gt=0, le=MAX_WIDTH)
    num_layers: int = Field(..., gt=0, le=MAX_LAYERS, description="transformer blocks in the main stack (MTP layers excluded)")
    num_attention_heads: int = Field(..., gt=0, le=MAX_HEADS)
    num_kv_heads: int | None = Field(None, gt=0, le=MAX_HEADS, description="None: same as num_attention_heads (MHA)")
    head_dim: int | None = Field(None, gt=0, le=MAX_WIDTH, description="None: hidden_size / num_attention_heads")
    intermediate_size: int = Field(..., gt=0, le=MAX_WIDTH, description="dense MLP width (dense layers of MoE models too)")

    mlp_gated: bool = Field(True, description="gated MLP (SwiGLU/GeGLU: gate, up, down) vs plain (up, down)")
    hidden_act: str = Field("silu")
    mlp_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = Field(False, description="bias on the attention output projection")
    qk_norm: QKNorm = QKNorm.NONE
    norm_type: NormType = NormType.RMSNORM
    num_norms_per_layer: int = Field(2, ge=0, le=16, description="norms inside each block (Gemma 2: 4; Falcon-7B: 1)")
    final_norm: bool = True
    embedding_norm: bool = Field(False, description="a norm right after the token embeddings (BLOOM's "
                                                    "word_embeddings_layernorm), on the first stage")
    parallel_residual: bool = Field(False, description="attention and MLP read the same input (GPT-NeoX, Falcon)")
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    # The output head: the language-model head over the vocabulary, or a sequence-classification
    # head (transformers' *ForSequenceClassification: `score`, hidden x num_labels, no bias; a
    # reward model has one label) whose logits are pooled at each sequence's last token.
    head: Literal["lm", "sequence_classification"] = "lm"
    num_labels: int = Field(1, ge=1, le=MAX_WIDTH, description="outputs of a sequence-classification head")

    position_embedding: PositionEmbedding = PositionEmbedding.ROPE
    max_position_embeddings: int = Field(..., gt=0, le=MAX_TOKENS)
    word_embed_proj_dim: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="width of the word embeddings and lm_head where it differs from "
        "hidden_size, bridged by project_in/project_out (OPT-350m); None: hidden_size")
    position_embedding_offset: int = Field(
        0, ge=0, le=16, description="rows of a learned position table beyond max_position_embeddings (OPT: 2)")
    rotary_fraction: float = Field(1.0, gt=0, le=1, description="fraction of head_dim that is rotated (NeoX rotary_pct)")
    rope_theta: float | None = Field(None, gt=0)

    sliding_window: int | None = Field(None, gt=0, le=MAX_TOKENS, description="tokens a sliding-window layer attends to; None: none")
    global_layer_every: int = Field(
        0,
        ge=0,
        le=MAX_LAYERS,
        description="with sliding_window: 0 = every layer slides (Mistral); k = layer i is global when i % k == k-1 (Gemma 2: 2)",
    )

    layer_types: tuple[LayerType, ...] = Field(
        (), description="per-layer token mixer, one per layer; empty: derived from sliding_window/global_layer_every"
    )
    attention_chunk_size: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="tokens per block of a chunked-attention layer (Llama 4); None: none"
    )
    attention_sinks: bool = Field(False, description="a learned sink logit per attention head (gpt-oss): parameters, no KV")
    attention_output_gate: bool = Field(
        False, description="q_proj also emits a per-element output gate, doubling its rows (Qwen3-Next)"
    )
    linear_attention: LinearAttentionSpec | None = Field(None, description="the linear_attention layers' mixer")
    vision: VisionSpec | None = Field(None, description="vision tower and projector of a multimodal model")
    measured_num_params: int | None = Field(
        None, gt=0, description="stored parameters of the real module (a spec derived from transformers on the meta "
        "device); the count reports its difference to the analytic total as component 'other'"
    )
    expert_dtype: str | None = Field(
        None, description="storage format of the routed experts when it differs from dtype (gpt-oss: mxfp4); informational"
    )
    fp8_weight_block_size: tuple[int, int] | None = Field(
        None, description="the checkpoint's FP8 weights are quantized in blocks of this many (rows, columns) "
        "(HF quantization_config.weight_block_size: DeepSeek-V3, Qwen3 FP8 releases); engines run each such linear as "
        "activation quantization plus a block GEMM; null: not a block-quantized FP8 checkpoint"
    )
    checkpoint_quantization: Literal["awq", "gptq", "ct-fp8", "ct-int8", "ct-w4a16"] | None = Field(
        None, description="the checkpoint's linear weights are quantized as engines load them with no --quantization "
        "(CHECKPOINT_KINDS): 4-bit AWQ or GPTQ (HF quantization_config quant_method awq or gptq, bits 4), or an "
        "llm-compressor compressed-tensors scheme (FP8 weights, INT8 W8A8, 4-bit W4A16); null: not such a checkpoint"
    )
    checkpoint_group_size: int | None = Field(
        None, gt=0, le=1 << 20, description="such a checkpoint's quantization group along each weight's input "
        "(quantization_config group_size): a rank's share of a row-parallel input must be whole groups; null: "
        "per channel (group_size -1) or not stated"
    )

    mla: MLASpec | None = None
    moe: MoESpec | None = None
    num_mtp_layers: int = Field(0, ge=0, le=MAX_LAYERS, description="multi-token-prediction modules (DeepSeek-V3), counted apart")

    dtype: str = Field("bfloat16", description="the checkpoint's dtype (HF torch_dtype)")
    # Training-time dropout as the config sets it (transformers' default where it is silent):
    # masks kept for backward and elementwise work when either is above zero.
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the attention probabilities")
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the residual branches and embeddings")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        """A name units.DTYPE_ALIASES maps (bytes per weight, `checkpoint`'s safetensors dtype read it)."""
        if value.strip().lower() not in DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {value[:40]!r}; shardplan knows {', '.join(DTYPE_ALIASES)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.head_dim is None and self.mla is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}) and no head_dim is given; set head_dim"
            )
        kv = self.num_kv_heads
        if kv is not None and self.num_attention_heads % kv:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of num_kv_heads ({kv})"
            )
        if self.moe is not None:
            if self.moe.first_dense_layers > self.num_layers:
                raise ValueError("moe.first_dense_layers exceeds num_layers")
            bad = [i for i in self.moe.dense_layer_indices if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"moe.dense_layer_indices {bad} are outside 0..{self.num_layers - 1}")
        if self.head == "sequence_classification" and self.tie_word_embeddings:
            raise ValueError("a sequence-classification head (score) is never tied to the embedding; "
                             "set tie_word_embeddings: false")
        if self.global_layer_every and self.sliding_window is None:
            raise ValueError("global_layer_every is set but sliding_window is not")
        if self.layer_types:
            if LayerType.CROSS in self.layer_types and self.vision is None:
                raise ValueError("layer_types has cross_attention layers but the model has no vision tower")
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            kinds = set(self.layer_types)
            for kind, field, value in ((LayerType.SLIDING, "sliding_window", self.sliding_window),
                                       (LayerType.CHUNKED, "attention_chunk_size", self.attention_chunk_size),
                                       (LayerType.LINEAR, "linear_attention", self.linear_attention)):
                if kind in kinds and value is None:
                    raise ValueError(f"layer_types has {kind.value} layers but {field} is not set")
        return self

    def __hash__(self) -> int:
        # pydantic's generated hash re-hashes every field, the nested MoE/MLA/vision specs
        # included, on each call, and the cost model's caches look the spec up hundreds of
        # thousands of times a search: hash a few identifying fields instead. Equal specs share
        # them, so this stays consistent with __eq__ (which still decides on a collision).
        return hash((self.name, self.num_layers, self.hidden_size, self.vocab_size, self.intermediate_size))

    # ----- derived figures -------------------------------------------------------------
    @property
    def shipped_format(self) -> str | None:
        """The weight format the checkpoint ships in that an engine may run as it is (knowledge's
        `checkpoint_formats`): "mxfp4" (gpt-oss's routed experts), "fp8" (a block-quantized FP8
        checkpoint's linear weights), a CHECKPOINT_KINDS kind (AWQ, GPTQ, compressed-tensors), or None
        (the model's dtype)."""
        if self.expert_dtype == "mxfp4":
            return "mxfp4"
        if self.checkpoint_quantization is not None:
            return self.checkpoint_quantization
        return "fp8" if self.fp8_weight_block_size else None

    def ships(self, planned: str) -> bool:
        """Whether the checkpoint as shipped holds a plan's `planned` weight format: the shipped format
        itself, the format its kind is planned in (a compressed-tensors FP8 checkpoint: fp8), or int4
        for a 4-bit grouped one (int4 plans those formats' bytes)."""
        shipped = self.shipped_format
        if shipped is None:
            return False
        kind = CHECKPOINT_KINDS.get(shipped)
        return (shipped == planned or (kind is not None and kind[0] == planned)
                or (planned == "int4" and shipped in GROUPED_CHECKPOINT_KINDS))

    @property
    def embedding_width(self) -> int:
        """Columns of the word embeddings and of the lm_head."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def head_outputs(self) -> int:
        """Logits per position: the vocabulary, or a classification head's labels."""
        return self.vocab_size if self.head == "lm" else self.num_labels

    @property
    def lm_head(self) -> bool:
        return self.head == "lm"

    @property
    def trains_with_dropout(self) -> bool:
        return self.attention_dropout > 0 or self.hidden_dropout > 0

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        """Per-head dim of q/k/v for MHA/GQA/MQA (MLA has its own dims in `mla`)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def attention_kind(self) -> AttentionKind:
        if self.mla is not None:
            return AttentionKind.MLA
        if self.kv_heads == self.num_attention_heads:
            return AttentionKind.MHA
        if self.kv_heads == 1:
            return AttentionKind.MQA
        return AttentionKind.GQA

    @property
    def rotary_dim(self) -> int:
        """Elements per position in the rotary cos/sin cache (0 without RoPE)."""
        if self.position_embedding is not PositionEmbedding.ROPE:
            return 0
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.attention_head_dim * self.rotary_fraction)

    def is_moe_layer(self, layer_index: int) -> bool:
        m = self.moe
        if m is None:
            return False
        if layer_index < m.first_dense_layers or layer_index in m.dense_layer_indices:
            return False
        return (layer_index + 1) % m.moe_layer_step == 0

    def layer_type(self, layer_index: int) -> LayerType:
        if self.layer_types:
            return self.layer_types[layer_index]
        return LayerType.SLIDING if self.is_sliding_layer(layer_index) else LayerType.FULL

    def is_linear_attention_layer(self, layer_index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_index] is LayerType.LINEAR

    def is_cross_attention_layer(self, layer_index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_index] is LayerType.CROSS

    @property
    def num_cross_attention_layers(self) -> int:
        return sum(t is LayerType.CROSS for t in self.layer_types)

    def is_sliding_layer(self, layer_index: int) -> bool:
        if self.layer_types:
            return self.layer_types[layer_index] is LayerType.SLIDING
        if self.sliding_window is None:
            return False
        if self.global_layer_every == 0:
            return True
        return layer_index % self.global_layer_every != self.global_layer_every - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.is_sliding_layer(i) for i in range(self.num_layers))
