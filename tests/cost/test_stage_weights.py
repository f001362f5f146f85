"""Per-rank weights (cost/weights.py) against the parameter count (cost/params.py): summed over
the pipeline stages of a tp = 1 layout, what the stages store is every parameter the model has,
for every bundled and corpus model (dense, MoE, MLA, Qwen3-Next's linear-attention layers, vision
towers). Both read the same weight inventory, so a per-layer kind one of them ignores shows here."""

from __future__ import annotations

import pytest

from shardplan.cost.layout import Layout
from shardplan.cost.params import count_params
from shardplan.cost.weights import stage_weights
from shardplan.cost.workload import Quantization
from shardplan.specs.loading import load_model, model_specs_dir
from shardplan.units import DType
from shardplan.validation.shipped import CORPUS_DIR

MODELS = sorted(model_specs_dir().glob("*.yaml")) + sorted((CORPUS_DIR / "models").glob("*.yaml"))


@pytest.mark.parametrize("path", MODELS, ids=[p.stem for p in MODELS])
@pytest.mark.parametrize("pp", [1, 2])
def test_stage_weights_sum_to_the_parameter_count(path, pp):
    spec = load_model(str(path)).spec
    pp = min(pp, spec.num_layers)  # a one-layer model has one stage
    counts = count_params(spec)
    analytic = counts.total - counts.by_component.get("other", 0)  # `other`: measured minus analytic, no tensor
    layout = Layout(pp=pp)
    stored = sum(stage_weights(spec, layout, s, quantization=Quantization.NONE, dense_dtype=DType.BF16).numel
                 for s in range(pp))
    # with tied embeddings the last of several stages keeps its own copy of the embedding as lm_head
    tied_copy = spec.vocab_size * spec.hidden_size if (spec.tie_word_embeddings and pp > 1) else 0
    assert stored == analytic + tied_copy


def test_qwen3_next_stage_weights_follow_each_layers_type():
    spec = load_model(str(CORPUS_DIR / "models" / "qwen3-next-80b-a3b-thinking.yaml")).spec
    assert {spec.is_linear_attention_layer(i) for i in range(spec.num_layers)} == {True, False}
    w = stage_weights(spec, Layout(), 0, quantization=Quantization.NONE, dense_dtype=DType.BF16)
    assert w.numel == count_params(spec).total  # 79.674B; 79.442B when every layer counted softmax attention


GGUF_MIXTURES = [Quantization.Q4_K_M, Quantization.Q3_K_M, Quantization.Q2_K]


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-30b-a3b", "llama-3.1-8b"])
@pytest.mark.parametrize("mixture", GGUF_MIXTURES, ids=[m.value for m in GGUF_MIXTURES])
def test_gguf_stage_bytes_sum_to_the_whole_model(name, mixture):
    """llama.cpp picks attn_v's and ffn_down's type by layer index (gguf.py): each stage's bytes are
    its own layers' types, so the stages of any split sum to the unsplit model's bytes. DeepSeek-V3's
    first three layers are dense: averaging a kind over every layer of a stage, including those
    without it, read 0.2% under the whole at pp 7."""
    spec = load_model(name).spec
    whole = stage_weights(spec, Layout(), 0, quantization=mixture, dense_dtype=DType.BF16).bytes
    for pp in (2, 3, 4, 7):
        parts = sum(stage_weights(spec, Layout(pp=pp), s, quantization=mixture, dense_dtype=DType.BF16).bytes
                    for s in range(pp))
        assert parts == pytest.approx(whole, rel=1e-12), pp


def test_gguf_dense_mlp_of_a_moe_model_takes_its_own_layers_types():
    """DeepSeek-V3's dense MLP lives in layers 0-2 only, all in the first eighth of 61 layers, where
    Q4_K_M stores ffn_down in Q6_K (llama-quant.cpp, use_more_bits): 210 bytes per 256 weights. Its
    routed experts' ffn_down, in layers 3-60, mix Q6_K and Q4_K (144 bytes per 256)."""
    from shardplan.cost.params import block_weights
    from shardplan.cost.weights import bytes_per_weight_element

    spec = load_model("deepseek-v3").spec
    dense_down = next(w for w in block_weights(spec, False) if w.name.endswith("down_proj.weight"))
    assert bytes_per_weight_element(dense_down, Quantization.Q4_K_M, DType.BF16, spec) == 210 / 256
    expert_down = next(w for w in block_weights(spec, True) if w.routed_expert and w.name.endswith("down_proj.weight"))
    more = [i for i in range(3, 61) if i < 61 // 8 or i >= 7 * 61 // 8 or (i - 61 // 8) % 3 == 2]
    expected = (len(more) * 210 + (58 - len(more)) * 144) / 256 / 58
    assert bytes_per_weight_element(expert_down, Quantization.Q4_K_M, DType.BF16, spec) == pytest.approx(expected, rel=1e-12)
