"""torch's DistributedDataParallel keeps a bucket copy of every gradient: its reducer allocates
flat buckets covering all the parameters at construction and keeps them, and with
gradient_as_bucket_view False (the default, as the Hugging Face Trainer and accelerate run it)
the gradients live apart from them. Measured with verify's storage tracker on two gloo ranks
over a transformers Llama in bf16, against the hf stack's `temporary.ddp_gradient_buckets`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from shardplan.cost.inputs import training_workload  # noqa: E402
from shardplan.cost.layout import Layout, Recompute  # noqa: E402
from shardplan.cost.memory_training import training_memory  # noqa: E402
from shardplan.knowledge.load import stack_rules  # noqa: E402
from shardplan.search.space import topology  # noqa: E402
from shardplan.specs.hf import spec_from_hf_config  # noqa: E402
from shardplan.specs.loading import load_hardware  # noqa: E402

CONFIG = dict(model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
              torch_dtype="bfloat16")


def _rank(rank: int, world: int, port: int, out) -> None:  # type: ignore[no-untyped-def]
    import os
    import time

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardplan.verify.measure import StorageTracker

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "torch_dtype")},
                          attn_implementation="sdpa")
        tracker = StorageTracker()
        with tracker:  # from the model's own creation: DDP() re-broadcasts the parameters into new storages
            model = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            # DDP() broadcasts rank 0's parameters through one flat copy of them, which gloo's thread may
            # let go a little after DDP() returns (a CI run read 2x the parameters here): wait for that
            # copy to go, at most 5 s, before reading what DDP keeps.
            deadline = time.monotonic() + 5.0
            while tracker.live_total - params > 1.5 * params and time.monotonic() < deadline:
                time.sleep(0.01)
            built = tracker.live_total - params
            ids = torch.randint(0, CONFIG["vocab_size"], (1, 32))
            ddp(input_ids=ids, labels=ids).loss.backward()
            grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
            after = tracker.live_total - params
        out.put((params, built, grads, after))
        del ddp  # the reducer before its process group, and both ranks done before either tears down
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_ddp_keeps_a_bucket_copy_of_every_gradient():
    from conftest import gloo_ranks

    params, built, grads, after = gloo_ranks(_rank)[0]
    assert built == pytest.approx(params, rel=1e-3)  # DDP() allocated buckets the size of the parameters
    assert after - built == pytest.approx(grads, rel=0.01)  # the gradients apart from them

    spec = spec_from_hf_config(CONFIG, "tiny-llama")
    wl = training_workload(seq_len=32, global_batch_size=2, optimizer="adamw", framework=None, flash_attention=None,
                           dropout=False, stack=stack_rules("hf"), spec=spec, master_dtype="bf16", moment_dtype="bf16")
    hw = topology(load_hardware("h100-sxm-80gb"), 2)
    rank = training_memory(spec, hw, Layout(dp=2, micro_batch_size=1, recompute=Recompute.NONE), wl).ranks[0]
    assert rank.detail["temporary.ddp_gradient_buckets"] == params == rank.breakdown.gradients
    one = training_memory(spec, topology(load_hardware("h100-sxm-80gb"), 1),
                          Layout(dp=1, micro_batch_size=1, recompute=Recompute.NONE), wl).ranks[0]
    assert "temporary.ddp_gradient_buckets" not in one.detail  # one GPU runs no DDP
