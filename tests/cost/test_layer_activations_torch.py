"""One decoder layer's saved activations counted against transformers' own Llama layer on CPU:
every tensor autograd saves for backward (torch.autograd.graph.saved_tensors_hooks), by storage,
without the parameters and the rotary tables (computed once per forward and shared by every
layer), against `activation_bytes_per_layer` for the Hugging Face stack without recomputation.

The weights are bf16 (a model loaded in bf16, or FSDP's mixed precision casting them), so each
RMSNorm's output is bf16 and the projections after it share one saved input. The layer keeps:
per norm its input's fp32 copy and its normalized bf16 output; the shared input of q/k/v; q, k
and v; the attention output (the output projection's input is a view of it) and its log-sum-exp;
the MLP's input; gate, up, silu(gate) and their product, the down projection's input."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardplan.cost.inputs import training_workload  # noqa: E402
from shardplan.cost.layout import Layout, Recompute  # noqa: E402
from shardplan.cost.memory_training import activation_bytes_per_layer, autocast_input_copies_per_layer  # noqa: E402
from shardplan.knowledge.load import stack_rules  # noqa: E402
from shardplan.specs.model import ModelSpec, NormType  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, BATCH, SEQ = 512, 1536, 8, 2, 2, 256


def _saved_bytes(fp32_weights_autocast: bool = False) -> float:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, num_hidden_layers=1, vocab_size=1000, attn_implementation="sdpa")
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0)
    if not fp32_weights_autocast:
        layer = layer.to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    shared = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    shared |= {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):  # type: ignore[no-untyped-def]
        st = t.untyped_storage()
        if st.data_ptr() not in shared:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=fp32_weights_autocast):
        layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
    return float(sum(saved.values()))


SPEC = ModelSpec(name="llama-like", model_type="llama", vocab_size=1000, hidden_size=HIDDEN, num_layers=1,
                 num_attention_heads=HEADS, num_kv_heads=KV_HEADS, intermediate_size=FFN, mlp_gated=True,
                 hidden_act="silu", norm_type=NormType.RMSNORM, max_position_embeddings=4096)


def _hf_workload():  # type: ignore[no-untyped-def]
    return training_workload(seq_len=SEQ, global_batch_size=BATCH, optimizer="adamw", framework=None,
                             flash_attention=None, dropout=False, stack=stack_rules("hf"), spec=SPEC)


def test_the_hf_stacks_layer_saves_what_transformers_llama_layer_saves():
    predicted = activation_bytes_per_layer(SPEC, Layout(micro_batch_size=BATCH, recompute=Recompute.NONE),
                                           _hf_workload(), False, BATCH)
    # the two norms' rsqrt (one fp32 per token each) is the only thing the model leaves out
    assert predicted == pytest.approx(_saved_bytes(), rel=0.005)


def test_under_autocast_over_fp32_weights_each_projection_saves_its_own_input_cast():
    """The Trainer's AMP with fp32 weights (one GPU, DDP): the RMSNorm's output is fp32, so q, k,
    v, gate and up each save their own bf16 cast of it, and autocast's bf16 copy of every weight is
    saved too (the model's `temporary.autocast_weight_copies`, 2 bytes a weight)."""
    wl = _hf_workload()
    layer = activation_bytes_per_layer(SPEC, Layout(micro_batch_size=BATCH, recompute=Recompute.NONE), wl, False, BATCH)
    copies = autocast_input_copies_per_layer(SPEC, wl, 1, BATCH, False, False)
    assert copies == 2 * BATCH * SEQ * HIDDEN * (2 + 1)  # two more for q/k/v, one more for gate/up
    weights = 2 * (HIDDEN * (HEADS + 2 * KV_HEADS) * (HIDDEN // HEADS) + HIDDEN * HIDDEN + 3 * HIDDEN * FFN)
    assert layer + copies + weights == pytest.approx(_saved_bytes(fp32_weights_autocast=True), rel=0.005)


def test_dropout_p0_keeps_nothing_and_the_configs_dropout_kinds_are_counted_apart():
    """torch's dropout at p=0 returns its input (no mask, no copy), so a model whose config sets
    attention_dropout 0.0 and dropout 0.1 (OPT) keeps masks on the residual branches only: the
    layer's activations lose the probabilities' mask (1 byte a score: under transformers' fp32 softmax
    the dropped copy takes the place of the bf16 copy the product with V saves without dropout)."""
    from dataclasses import replace as dc_replace

    from shardplan.cost.memory_training import dropout_kinds
    from shardplan.verify.measure import StorageTracker

    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    tracker = StorageTracker()
    with tracker:
        y = torch.nn.functional.dropout(x, p=0.0, training=True)
    assert tracker.peak_total == 0 and y.data_ptr() == x.data_ptr()

    both = SPEC.model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})
    hidden_only = SPEC.model_copy(update={"attention_dropout": 0.0, "hidden_dropout": 0.1})
    wl = dc_replace(_hf_workload(), dropout=True, flash_attention=False)
    assert dropout_kinds(both, wl) == (True, True) and dropout_kinds(hidden_only, wl) == (False, True)
    assert dropout_kinds(SPEC, wl) == (True, True)  # --dropout on a model whose config sets none: both
    layout = Layout(micro_batch_size=BATCH, recompute=Recompute.NONE)
    gap = (activation_bytes_per_layer(both, layout, wl, False, BATCH)
           - activation_bytes_per_layer(hidden_only, layout, wl, False, BATCH))
    # transformers' eager softmax output is fp32 and saved either way; without attention dropout the
    # product with V saves its bf16 copy, with it dropout's output and its 1-byte mask instead
    assert wl.eager_softmax_fp32
    assert gap == BATCH * HEADS * SEQ * SEQ * 1


def test_a_relu_mlp_keeps_one_tensor_where_gelu_keeps_two():
    """transformers' OPT decoder layer (bf16, SDPA) saves 2 bytes a token per intermediate unit
    fewer with ReLU than with GeLU: ReLU saves its output, which fc2 saves as its input; GeLU saves
    its input and fc2 its output. The plain-MLP count follows the activation."""
    from transformers import OPTConfig
    from transformers.models.opt.modeling_opt import OPTDecoderLayer

    batch, seq, hidden, ffn = 2, 128, 256, 1024

    def saved(act: str) -> int:
        cfg = OPTConfig(hidden_size=hidden, ffn_dim=ffn, num_attention_heads=4, activation_function=act, dropout=0.0,
                        attention_dropout=0.0, attn_implementation="sdpa")
        x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
        return _saved_by(OPTDecoderLayer(cfg, layer_idx=0).to(torch.bfloat16), x, {"attention_mask": None})

    measured = saved("gelu") - saved("relu")
    assert measured == 2 * batch * seq * ffn
    spec = ModelSpec(name="opt-like", model_type="opt", vocab_size=1000, hidden_size=hidden, num_layers=1,
                     num_attention_heads=4, intermediate_size=ffn, mlp_gated=False, hidden_act="gelu",
                     norm_type=NormType.LAYERNORM, max_position_embeddings=2048)
    wl = training_workload(seq_len=seq, global_batch_size=batch, optimizer="adamw", framework=None, flash_attention=None,
                           dropout=False, stack=stack_rules("hf"), spec=spec)
    layout = Layout(micro_batch_size=batch, recompute=Recompute.NONE)
    relu = spec.model_copy(update={"hidden_act": "relu"})
    predicted = (activation_bytes_per_layer(spec, layout, wl, False, batch)
                 - activation_bytes_per_layer(relu, layout, wl, False, batch))
    assert predicted == measured


def _layer_saved(family: str, attn: str, dropout: float) -> int:
    """Bytes autograd saves in one transformers decoder layer of `family` (bf16 weights, no autocast)
    with attention `attn` (eager or sdpa) and attention dropout `dropout`."""
    if family == "opt":
        from transformers import OPTConfig
        from transformers.models.opt.modeling_opt import OPTDecoderLayer

        cfg = OPTConfig(hidden_size=E_HIDDEN, ffn_dim=4 * E_HIDDEN, num_attention_heads=E_HEADS, dropout=0.0,
                        attention_dropout=dropout, attn_implementation=attn)
        layer, kwargs = OPTDecoderLayer(cfg, layer_idx=0), {"attention_mask": None}
    else:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        cfg = GPT2Config(n_embd=E_HIDDEN, n_head=E_HEADS, n_inner=4 * E_HIDDEN, attn_pdrop=dropout, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_implementation=attn)
        layer, kwargs = GPT2Block(cfg, layer_idx=0), {}
    x = torch.randn(E_BATCH, E_SEQ, E_HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    return _saved_by(layer.to(torch.bfloat16).train(), x, kwargs)


def _saved_by(layer, x, kwargs: dict) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the storages autograd saves for backward in `layer(x, **kwargs)`, its parameters and
    its input aside."""
    shared = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    kept: dict[int, int] = {}

    def pack(t):  # type: ignore[no-untyped-def]
        if t.untyped_storage().data_ptr() not in shared:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, **kwargs)
    return sum(kept.values())


E_BATCH, E_SEQ, E_HIDDEN, E_HEADS = 2, 128, 256, 4


@pytest.mark.parametrize("family", ["opt", "gpt2"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_eager_attention_core_by_family(family, dropout):
    """transformers' eager attention saves its softmax's output for backward: in fp32 for OPT (and
    every family on `eager_attention_forward`: softmax(dtype=float32).to(query.dtype)), beside the bf16
    copy that the product with V saves (with dropout: its 1-byte mask and its output instead); in bf16
    for GPT-2, whose softmax runs in the scores' dtype. Measured as the eager layer less the same layer
    with SDPA (which keeps the same q, k, v and attention output, and a log-sum-exp), against the
    model's eager layer less its flash-attention layer, under the DeepSpeed stack (no autocast)."""
    from shardplan.knowledge.model_support import hf_eager_softmax_fp32

    measured = _layer_saved(family, "eager", dropout) - _layer_saved(family, "sdpa", 0.0)
    spec = ModelSpec(name=family, model_type=family, vocab_size=1000, hidden_size=E_HIDDEN, num_layers=1,
                     num_attention_heads=E_HEADS, intermediate_size=4 * E_HIDDEN, mlp_gated=False,
                     hidden_act="relu" if family == "opt" else "gelu_new", norm_type=NormType.LAYERNORM,
                     max_position_embeddings=2048, attention_dropout=dropout, hidden_dropout=0.0)
    wl = training_workload(seq_len=E_SEQ, global_batch_size=E_BATCH, optimizer="adamw", framework=None,
                           flash_attention=False, dropout=dropout > 0, stack=stack_rules("deepspeed"), spec=spec)
    assert wl.eager_softmax_fp32 == hf_eager_softmax_fp32(spec, False) == (family == "opt")
    layout = Layout(micro_batch_size=E_BATCH, recompute=Recompute.NONE)
    predicted = (activation_bytes_per_layer(spec, layout, wl, False, E_BATCH)
                 - activation_bytes_per_layer(spec, layout, dataclasses.replace(wl, flash_attention=True), False,
                                              E_BATCH))
    scores = E_BATCH * E_HEADS * E_SEQ * E_SEQ
    # On CPU torch's dropout is `input * noise` with a noise tensor of the input's dtype (2 bytes a score,
    # aten/src/ATen/native/Dropout.cpp _dropout_impl); CUDA's fused native_dropout keeps a 1-byte mask, as
    # the model counts (is_fused_kernel_acceptable: CUDA, XPU, lazy and privateuse1 tensors only).
    cpu_mask_extra = scores * (2 - 1) if dropout else 0
    assert predicted == measured - cpu_mask_extra
    per_score = {("opt", 0.0): 4 + 2, ("opt", 0.1): 4 + 1 + 2, ("gpt2", 0.0): 2, ("gpt2", 0.1): 2 + 1 + 2}
    assert measured - cpu_mask_extra + 4 * E_BATCH * E_HEADS * E_SEQ == per_score[(family, dropout)] * scores


def test_under_the_trainers_autocast_every_family_keeps_an_fp32_softmax():
    """CUDA autocast runs softmax in fp32 (torch's AMP op list), so under the Hugging Face Trainer's AMP
    GPT-2's eager softmax is fp32 too; pure bf16 (no autocast) leaves it to the family's code."""
    gpt2 = ModelSpec(name="gpt2-like", model_type="gpt2", vocab_size=1000, hidden_size=256, num_layers=1,
                     num_attention_heads=4, intermediate_size=1024, mlp_gated=False, hidden_act="gelu_new",
                     norm_type=NormType.LAYERNORM, max_position_embeddings=1024)

    def wl(**kw):  # type: ignore[no-untyped-def]
        return training_workload(seq_len=128, global_batch_size=2, optimizer="adamw", framework=None,
                                 flash_attention=False, dropout=False, stack=stack_rules("hf"), spec=gpt2, **kw)

    assert wl().eager_softmax_fp32
    assert not wl(master_dtype="bf16", moment_dtype="bf16").eager_softmax_fp32
    megatron = training_workload(seq_len=128, global_batch_size=2, optimizer="adamw", framework=None,
                                 flash_attention=False, dropout=False, stack=stack_rules("megatron"), spec=SPEC)
    assert not megatron.eager_softmax_fp32  # Megatron's fused scale-mask-softmax writes 16 bits
