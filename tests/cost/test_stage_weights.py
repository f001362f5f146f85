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
