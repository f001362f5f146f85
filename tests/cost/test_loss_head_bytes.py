"""The loss head's bytes per logit at its peak, counted against torch: each stack's training loop
run for real on CPU under verify's storage tracker (every storage an op allocates, freed when its
last reference goes), with logits large enough that the loss head is all that grows.

- torchtitan (torchtitan/components/loss.py, train.py): cross_entropy(pred.flatten(0, 1).float(),
  labels), then `del pred` ("need to free to before bwd to avoid peaking memory"), then backward;
- Hugging Face Trainer (transformers >= 4.46 ForCausalLMLoss inside the model: logits.float(),
  cross_entropy(reduction="sum") / n): compute_loss returns the loss only, so the model's output,
  logits included, is dropped before `accelerator.backward(loss)`;
- DeepSpeed's own loops (DeepSpeed-Chat, DeepSpeedExamples: `outputs = model(**batch);
  model.backward(outputs.loss)`) keep the output, and with it the bf16 logits, through backward.

The fp32 copy feeds log_softmax, which saves its output, not its input; the peak is at the
log_softmax backward: the saved output, nll_loss's dense gradient and the new gradient, 3 x 4
bytes, plus the bf16 logits where the loop still holds them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shardplan.knowledge.load import stack_rules  # noqa: E402
from shardplan.verify.measure import StorageTracker  # noqa: E402

TOKENS, VOCAB, HIDDEN = 512, 16384, 32


def _peak_bytes_per_logit(keep_output: bool, style: str) -> float:
    torch.manual_seed(0)
    w = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (TOKENS,))
    tracker = StorageTracker()
    with tracker:
        start = tracker.live_total
        pred = x @ w.t()  # the lm_head's bf16 logits
        if style == "titan":
            loss = torch.nn.functional.cross_entropy(pred.float(), labels)
        elif style == "hf":
            loss = torch.nn.functional.cross_entropy(pred.float(), labels, reduction="sum") / TOKENS
        else:  # transformers 4.43: logits.float() in the model, then the shifted logits copied
            pred = pred.float()
            shifted = pred[:-1].contiguous()
            loss = torch.nn.CrossEntropyLoss()(shifted, labels[1:])
            del shifted
        if not keep_output:
            del pred
        loss.backward()
    # the weight's and the input's gradients are the head's own, not the loss's
    grads = (VOCAB + TOKENS) * HIDDEN * 2
    return (tracker.peak_total - start - grads) / (TOKENS * VOCAB)


@pytest.mark.parametrize("stack,keep_output,style", [
    ("torchtitan", False, "titan"),
    ("hf", False, "hf"),
    ("hf", False, "hf-4.43"),  # the older transformers code peaks at the same 12
    ("deepspeed", True, "hf"),
])
def test_loss_bytes_per_logit_is_what_torch_holds_at_the_peak(stack, keep_output, style):
    measured = _peak_bytes_per_logit(keep_output, style)
    assert stack_rules(stack).loss_bytes_per_logit == pytest.approx(measured, abs=0.25), measured


def _loss_parallel_rank(rank: int, world: int, port: int, out) -> None:  # type: ignore[no-untyped-def]
    """One rank of the loss-parallel cross-entropy (torchtitan under tensor parallelism): the
    lm_head sharded over the vocabulary, its logits Shard(-1), the loss inside loss_parallel()."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        w = distribute_tensor(torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16), mesh, [Shard(0)]).requires_grad_()
        x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
        labels = torch.randint(0, VOCAB, (TOKENS,))
        tracker = StorageTracker()
        with tracker:
            start = tracker.live_total
            pred = torch.nn.functional.linear(DTensor.from_local(x.requires_grad_(), mesh, [Replicate()]), w)
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(pred.float(), labels)
                del pred
                loss.backward()
        local_logits = TOKENS * VOCAB / world
        grads = (VOCAB / world + TOKENS) * HIDDEN * 2
        out.put((tracker.peak_total - start - grads) / local_logits)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_loss_parallel_bytes_per_local_logit_at_two_ranks():
    from conftest import gloo_ranks

    measured = gloo_ranks(_loss_parallel_rank)
    for m in measured:
        assert stack_rules("torchtitan").loss_parallel_bytes_per_logit == pytest.approx(m, abs=0.25), measured
