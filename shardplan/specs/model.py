"""ModelSpec: the architecture facts that every memory and time figure starts from.

One frozen, strict value object covers dense decoders (MHA/GQA/MQA, explicit head_dim,
QKV bias, q/k norms, tied embeddings, parallel residual, partial rotary, sliding-window and
alternating local/global layers), mixture-of-experts (top-k routing, shared experts, a
dense prefix, router bias) and multi-head latent attention (DeepSeek V2/V3), plus
multi-token-prediction layers, which are counted apart from the main total.

Field conventions: sizes are element counts (`_size`, `num_`), never bytes; `None` means
"not used" where a field says so.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from shardplan.specs._base import StrictModel

# Upper bounds, far above any published model (Llama 3.1 405B: 126 layers, 53248-wide MLP;
# Gemma 3: 262k vocabulary; Kimi K2: 384 experts; Llama 4 Scout: 10M tokens of context), that
# keep every byte, FLOP and time figure a finite float and every per-layer loop short. A file
# past them is a mistake or an attack, and is refused with the field named.
MAX_WIDTH = 2**20  # hidden, MLP, head and latent dimensions (elements)
MAX_VOCAB = 2**24
MAX_LAYERS = 16_384
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
    parallel_residual: bool = Field(False, description="attention and MLP read the same input (GPT-NeoX, Falcon)")
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False

    position_embedding: PositionEmbedding = PositionEmbedding.ROPE
    max_position_embeddings: int = Field(..., gt=0, le=MAX_TOKENS)
    rotary_fraction: float = Field(1.0, gt=0, le=1, description="fraction of head_dim that is rotated (NeoX rotary_pct)")
    rope_theta: float | None = Field(None, gt=0)

    sliding_window: int | None = Field(None, gt=0, le=MAX_TOKENS, description="tokens a sliding-window layer attends to; None: none")
    global_layer_every: int = Field(
        0,
        ge=0,
        le=MAX_LAYERS,
        description="with sliding_window: 0 = every layer slides (Mistral); k = layer i is global when i % k == k-1 (Gemma 2: 2)",
    )

    mla: MLASpec | None = None
    moe: MoESpec | None = None
    num_mtp_layers: int = Field(0, ge=0, le=MAX_LAYERS, description="multi-token-prediction modules (DeepSeek-V3), counted apart")

    dtype: str = Field("bfloat16", description="the checkpoint's dtype (HF torch_dtype)")
    # Training-time dropout as the config sets it (transformers' default where it is silent):
    # masks kept for backward and elementwise work when either is above zero.
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the attention probabilities")
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the residual branches and embeddings")

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
        if self.global_layer_every and self.sliding_window is None:
            raise ValueError("global_layer_every is set but sliding_window is not")
        return self

    # ----- derived figures -------------------------------------------------------------
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

    def is_sliding_layer(self, layer_index: int) -> bool:
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
