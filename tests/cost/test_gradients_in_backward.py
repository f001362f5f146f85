"""Gradients set to None after each step (torch's zero_grad(set_to_none=True), the Trainer's
model.zero_grad() and torchtitan's optimizers.zero_grad()) are allocated by backward as it frees
the activations: a step of one micro-batch never holds both whole. Measured on CPU with verify's
storage tracker over a transformers Llama's forward, loss and backward, once with the gradients
None and once kept from an earlier step (zeroed in place): the difference is what the hf stack's
model counts as `activations.freed_before_their_gradients`."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardplan.cost.inputs import training_workload  # noqa: E402
from shardplan.cost.layout import Layout, Recompute  # noqa: E402
from shardplan.cost.memory_training import FREED_BEFORE_GRADIENTS, training_memory  # noqa: E402
from shardplan.knowledge.load import stack_rules  # noqa: E402
from shardplan.search.space import topology  # noqa: E402
from shardplan.specs.hf import spec_from_hf_config  # noqa: E402
from shardplan.specs.loading import load_hardware  # noqa: E402

CONFIG = dict(model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
              torch_dtype="bfloat16")
def _peak(grads_kept: bool, batch: int, seq: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardplan.verify.measure import StorageTracker

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "torch_dtype")},
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq))
    if grads_kept:  # an earlier step's gradients, zeroed in place (set_to_none=False)
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=False)
    # the tracker counts what the block allocates; kept gradients were allocated before it
    held = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    tracker = StorageTracker()
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    return tracker.peak_total + held


def test_backward_frees_activations_before_the_gradients_that_replace_them(bf16_matmuls_as_fp32):
    """More activations than gradients: every gradient fits in what backward frees, so the step peaks
    at backward's start without them (the measured peaks differ by exactly the gradients' bytes)."""
    batch, seq = 2, 256
    measured = _peak(True, batch, seq) - _peak(False, batch, seq)
    spec = spec_from_hf_config(CONFIG, "tiny-llama")
    wl = training_workload(seq_len=seq, global_batch_size=batch, optimizer="adamw", framework=None,
                           flash_attention=None, dropout=False, stack=stack_rules("hf"), spec=spec,
                           master_dtype="bf16", moment_dtype="bf16")  # a bf16 model without autocast
    assert wl.grads_allocated_in_backward
    hw = topology(load_hardware("h100-sxm-80gb"), 1)
    layout = Layout(micro_batch_size=batch, recompute=Recompute.NONE)
    rank = training_memory(spec, hw, layout, wl).ranks[0]
    predicted = rank.detail[FREED_BEFORE_GRADIENTS]
    assert measured == rank.breakdown.gradients  # the whole of the bf16 gradients, 2 bytes a parameter
    assert predicted == pytest.approx(measured, rel=0.01)
    # kept gradients (gradient accumulation, or a stack that keeps them) take no such credit
    kept = training_memory(spec, hw, layout, replace(wl, grads_allocated_in_backward=False)).ranks[0]
    assert FREED_BEFORE_GRADIENTS not in kept.detail
    assert kept.breakdown.total - rank.breakdown.total == pytest.approx(predicted)
    accum = training_memory(spec, hw, layout, replace(wl, global_batch_size=2 * batch)).ranks[0]
    assert FREED_BEFORE_GRADIENTS not in accum.detail
