"""Qwen3-Next in a plan: each layer's checkpoint tensors follow its type (Gated DeltaNet
`linear_attn.*` or gated full attention `self_attn.*`), the manifest's tp splits name the
linear-attention tensors, and what the ranks hold adds up to the model's weights. A small
Qwen3-Next config (tests/data/models/tiny-qwen3-next.yaml), planned through the real estimate."""

from __future__ import annotations

import math

import pytest
from conftest import REPO, build_plan

from shardplan.cost.layout import Layout
from shardplan.cost.params import count_params, layer_weights
from shardplan.cost.workload import InferenceWorkload
from shardplan.plan.placement import box_numel, bytes_per_element, model_tensors, rank_holdings
from shardplan.specs.loading import load_model

TINY_QWEN3_NEXT = str(REPO / "tests" / "data" / "models" / "tiny-qwen3-next.yaml")

LINEAR_TENSORS = {  # Qwen3NextGatedDeltaNet's parameters, h = 256: 4 key heads and 8 value heads of 32
    "linear_attn.in_proj_qkvz.weight": ((768, 256), "column"),
    "linear_attn.in_proj_ba.weight": ((16, 256), "column"),
    "linear_attn.conv1d.weight": ((512, 1, 4), "column"),
    "linear_attn.dt_bias": ((8,), "column"),
    "linear_attn.A_log": ((8,), "column"),
    "linear_attn.norm.weight": ((32,), "replicated"),
    "linear_attn.out_proj.weight": ((256, 256), "row"),
}


@pytest.fixture(scope="module")
def tiny():
    m, _ = build_plan(TINY_QWEN3_NEXT, 2, Layout(tp=2), InferenceWorkload(max_model_len=512, input_len=384, output_len=128))
    return m, load_model(TINY_QWEN3_NEXT).spec


def test_each_layer_lists_its_own_kinds_tensors(tiny):
    _, spec = tiny
    tensors = {t.name: t.shape for t in model_tensors(spec)}
    for layer in (0, 1, 2, 4, 5, 6):
        for name, (shape, _) in LINEAR_TENSORS.items():
            assert tensors[f"model.layers.{layer}.{name}"] == shape
        assert f"model.layers.{layer}.self_attn.q_proj.weight" not in tensors
    for layer in (3, 7):
        assert tensors[f"model.layers.{layer}.self_attn.q_proj.weight"] == (512, 256)  # query and its output gate
        assert tensors[f"model.layers.{layer}.self_attn.k_norm.weight"] == (64,)
        assert not any(n.startswith(f"model.layers.{layer}.linear_attn.") for n in tensors)
    assert tensors["model.layers.0.mlp.experts.7.down_proj.weight"] == (256, 128)
    assert tensors["model.layers.0.mlp.shared_expert.up_proj.weight"] == (128, 256)
    assert tensors["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 256)
    # The same tensors as the inventory, layer by layer, and every parameter once.
    for layer in range(8):
        mine = {n: s for n, s in tensors.items() if n.startswith(f"model.layers.{layer}.")}
        assert sum(map(math.prod, mine.values())) == sum(w.numel for w in layer_weights(spec, layer))
    assert sum(map(math.prod, tensors.values())) == count_params(spec).total == 9_759_520


def test_the_manifest_splits_the_linear_attention_tensors(tiny):
    m, _ = tiny
    splits = m.placement.tp_splits
    for name, (_, split) in LINEAR_TENSORS.items():
        assert splits[name] == split
    assert (splits["self_attn.q_proj.weight"], splits["self_attn.k_proj.weight"]) == ("column", "kv_column")
    assert splits["mlp.experts.gate_proj.weight"] == "column" and splits["mlp.gate.weight"] == "replicated"


def test_placed_bytes_add_up_to_the_model_weights(tiny):
    m, spec = tiny
    held = rank_holdings(m, spec)
    placed = [sum(box_numel(h.box) * bytes_per_element(m, h.tensor) for h in rank) for rank in held]
    total_bytes = count_params(spec).total * 2  # bf16
    # Replicated tensors sit on both tp ranks: the block norms (2 x 256 per layer) and the final
    # norm, the gated norm of 32 (6 linear layers), q_norm and k_norm of 64 (2 full layers), the
    # router (8 x 256) and the shared expert's gate (256) of every layer.
    replicated = 8 * 2 * 256 + 256 + 6 * 32 + 2 * 2 * 64 + 8 * (8 * 256 + 256)
    assert sum(placed) == total_bytes + replicated * 2
    assert placed[0] == placed[1] == (total_bytes + replicated * 2) / 2
    # Every linear-attention tensor of layer 0 is covered once over the two tp ranks (twice if replicated).
    for name, (shape, split) in LINEAR_TENSORS.items():
        full = f"model.layers.0.{name}"
        got = sum(box_numel(h.box) for rank in held for h in rank if h.tensor.name == full)
        assert got == math.prod(shape) * (2 if split == "replicated" else 1)
