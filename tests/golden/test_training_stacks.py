"""Training per stack: the loss head, checkpointing, AMP and the caching allocator's headroom
(knowledge/stacks/*.yaml), held against what the stacks' code keeps and against the H100
out-of-memory that started this (issue: training per stack)."""

from __future__ import annotations

import pytest

from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, Recompute
from shardplan.knowledge.load import known_stacks, stack_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model
from shardplan.units import BYTES_PER_GIB


def _wl(stack: str, seq_len: int = 4096, gbs: int = 64):
    return training_workload(seq_len=seq_len, global_batch_size=gbs, optimizer="adamw", framework=None,
                             flash_attention=None, dropout=False, stack=stack_rules(stack))


def test_the_h100_oom_plan_no_longer_fits_and_names_the_fp32_logits():
    """Llama 3.2 1B, micro-batch 8 at 4096 tokens on one H100 under Hugging Face AMP: the real run
    failed allocating the fp32 logits, 8 x 4096 x 128256 x 4 bytes = 15.7 GiB."""
    spec = load_model("llama-3.2-1b").spec
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=1, nodes=None, gpus_per_node=None)
    rep = estimate(spec, hw, Layout(micro_batch_size=8), _wl("hf"))
    rank = rep.memory.per_rank[0]
    assert rank.largest_allocation == "the fp32 logits of the loss"
    assert rank.largest_allocation_bytes / BYTES_PER_GIB == pytest.approx(8 * 4096 * 128256 * 4 / BYTES_PER_GIB, rel=1e-9)
    assert rank.reserved_bytes == pytest.approx(rank.per_gpu_bytes["total"] + rank.largest_allocation_bytes)
    assert not rep.fits


def test_recommend_hf_never_picks_a_micro_batch_whose_fp32_logits_exceed_the_headroom(cli):
    r = cli("recommend", "llama-3.2-1b", "--workload", "training", "--gpus", "1", "--hardware", "h100-sxm-80gb",
            "--seq-len", "4096", "--global-batch-size", "64", "--stack", "hf", "--json")
    assert r.exit_code == 0, r.stderr
    capacity = load_hardware("h100-sxm-80gb").memory_capacity_bytes
    tops = r.json()["top"]
    assert tops
    for top in tops:
        rank = top["memory"]["per_rank"][0]
        logits = 4 * top["plan"]["micro_batch_size"] * 4096 * 128256  # the fp32 logits, bytes
        assert capacity - rank["per_gpu_bytes"]["total"] >= logits, top["plan"]
        assert rank["reserved_bytes"] <= capacity


@pytest.mark.parametrize("stack", known_stacks())
def test_loss_head_bytes_are_the_stacks(stack):
    """Bytes per logit at the loss head's peak (tests/cost/test_loss_head_bytes.py counts them
    against torch): at the log-softmax backward the saved fp32 log-softmax, nll_loss's fp32
    gradient and the new fp32 gradient (12, the Hugging Face Trainer, which drops the model's
    output before backward); DeepSpeed's own loops keep the bf16 logits beside them (14);
    torchtitan at tp = 2 runs loss_parallel()'s DTensor cross-entropy (16 a local logit);
    Megatron's vocab-parallel cross-entropy keeps the bf16 logits and one fp32 buffer it works in
    place (6), over tp."""
    spec = load_model("llama-3.2-1b").spec
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=2, nodes=None, gpus_per_node=None)
    rules = stack_rules(stack)
    rc = Recompute.FULL if "full" in rules.recompute else Recompute.NONE
    rep = estimate(spec, hw, Layout(tp=2, micro_batch_size=1, recompute=rc), _wl(stack, gbs=8))
    loss = rep.memory.per_rank[0].detail_bytes["activations.loss"]
    expected = {"hf": 12, "torchtitan": 16, "deepspeed": 14, "megatron": 6}[stack]
    per_rank = 4096 * spec.vocab_size / (2 if rules.loss_vocab_parallel else 1)
    assert loss == pytest.approx(expected * per_rank, rel=1e-12)


def test_op_level_selective_keeps_about_half_of_megatrons_selective():
    """torchtitan's op-level policy saves the layer input, q, v, the attention output, the gate
    projection and the MLP output; Megatron's selective keeps every input of every GEMM and the
    MLP intermediates and drops only the attention core."""
    spec = load_model("llama-3.1-8b").spec
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=8, nodes=None, gpus_per_node=None)
    layout = Layout(dp=8, zero_stage=3, micro_batch_size=1, recompute=Recompute.SELECTIVE)
    wl_tt = _wl("torchtitan", seq_len=8192, gbs=8)
    wl_mg = _wl("megatron", seq_len=8192, gbs=8)
    tt = estimate(spec, hw, layout, wl_tt).memory.per_rank[0].detail_bytes["activations.layers"]
    mg = estimate(spec, hw, layout, wl_mg).memory.per_rank[0].detail_bytes["activations.layers"]
    s, h, f, kv, layers = 8192, 4096, 14336, 8 * 128, 32
    saved = 2 * s * (h + h + kv + h + f + h) + 4 * 32 * s  # bf16 tensors and the fp32 log-sum-exp
    assert tt == pytest.approx(layers * saved, rel=1e-9)
    assert 0.4 < tt / mg < 0.7


def test_hf_amp_keeps_fp32_weights_and_bf16_copies():
    spec = load_model("llama-3.2-1b").spec
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=1, nodes=None, gpus_per_node=None)
    from shardplan.cost.params import count_params

    rank = estimate(spec, hw, Layout(micro_batch_size=1), _wl("hf", gbs=8)).memory.per_rank[0]
    n = count_params(spec).total  # Llama 3.2 1B ties its embeddings: 1.24B
    bytes_ = rank.per_gpu_bytes
    assert (bytes_["weights"], bytes_["gradients"], bytes_["optimizer_states"]) == pytest.approx((4 * n, 4 * n, 8 * n))
    assert rank.detail_bytes["temporary.autocast_weight_copies"] == pytest.approx(2 * n)


def test_a_stack_without_selective_recompute_is_not_searched_with_it(cli):
    r = cli("recommend", "llama-3.2-1b", "--workload", "training", "--gpus", "8", "--hardware", "h100-sxm-80gb",
            "--seq-len", "4096", "--global-batch-size", "64", "--stack", "hf", "--json")
    assert r.exit_code == 0, r.stderr
    assert all(t["plan"]["recompute"] in ("none", "full") for t in r.json()["top"])


def test_framework_is_a_deprecated_alias_of_stack(cli):
    base = ("estimate", "llama-3.2-1b", "--workload", "training", "--gpus", "1", "--hardware", "h100-sxm-80gb",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--json")
    old = cli(*base, "--framework", "megatron")
    new = cli(*base, "--stack", "megatron")
    assert "deprecated; use --stack megatron" in old.stderr
    assert old.json()["memory"] == new.json()["memory"]
    assert new.json()["workload"]["stack"] == "megatron"


def test_interleaved_without_virtual_stages_picks_and_prints_v(cli):
    base = ("estimate", "llama-3.1-70b", "--workload", "training", "--gpus", "64", "--tp", "8", "--pp", "4",
            "--pp-schedule", "interleaved", "--seq-len", "4096", "--global-batch-size", "512", "--sequence-parallel",
            "--recompute", "selective", "--zero-stage", "1")
    table = cli(*base)
    assert "interleaved schedule: v = " in table.stdout
    d = cli(*base, "--json").json()
    chosen = int(d["assumptions"][-1].split("v = ")[1].split(",")[0])
    assert chosen >= 2 and 80 % (4 * chosen) == 0
    # the v it chose is no slower than any other even split
    for v in (2, 4, 5, 10, 20):
        other = cli(*base, "--virtual-stages", str(v), "--json").json()
        assert d["time"]["step_seconds"] <= other["time"]["step_seconds"] + 1e-9


def test_interleaved_without_virtual_stages_counts_the_embedding_and_loss_as_units(cli):
    """Llama 3 405B's layout (Dubey et al. 2024, §3.3.2): 126 layers over 16 stages, the embedding
    and the loss each taking a layer's place, so 128 units split into 16 x 8 chunks. No v splits the
    126 layers alone evenly; with the two extra units v = 2, 4 and 8 do."""
    base = ("estimate", "llama-3.1-405b", "--workload", "training", "--gpus", "2048", "--tp", "8", "--pp", "16",
            "--pp-schedule", "interleaved", "--seq-len", "8192", "--global-batch-size", "256", "--sequence-parallel",
            "--zero-stage", "1", "--json")
    without = cli(*base)
    assert without.exit_code == 2 and "126 pipeline units" in without.stderr
    d = cli(*base, "--pp-embedding-as-layer", "--pp-loss-as-layer").json()
    note = d["assumptions"][-1]
    assert "the fastest of v = 2, 4, 8" in note, note
    assert len(d["plan"]["stage_layers"]) == 16


def test_interleaved_without_virtual_stages_says_why_no_v_runs(cli):
    base = ("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--pp-schedule", "interleaved")
    one = cli(*base, "--pp", "1")
    assert one.exit_code == 2 and "--pp-schedule" in one.stderr and "pp = 1" in one.stderr
    split = cli(*base, "--pp", "8", "--pp-first-stage-layers", "3")
    assert split.exit_code == 2 and "one chunk per stage" in split.stderr  # the split's own reason, not "no v"


def test_a_time_for_a_plan_that_does_not_fit_says_so(cli):
    args = ("estimate", "llama-3.2-1b", "--workload", "training", "--gpus", "1", "--hardware", "h100-sxm-80gb",
            "--micro-batch-size", "8", "--seq-len", "4096", "--global-batch-size", "64", "--stack", "hf")
    table, d = cli(*args), cli(*args, "--json").json()
    assert table.exit_code == 3 and "(if it fit: it does not)" in table.stdout
    assert d["time"]["plan_fits"] is False and d["fits"] is False
    fits = cli(*args[:-2], "--micro-batch-size", "1", "--json").json()
    assert fits["time"]["plan_fits"] is True


# torchtitan's own benchmark (shardplan/validation/corpus/training_stacks/torchtitan.yaml, each row with its source):
# Llama 3.1 8B, FSDP over 8 and 128 GPUs, op-level selective checkpointing, 2 x 8192 tokens, eager.
# The printed figure is the caching allocator's reserved peak. The H100s there are 96 GB parts;
# memory does not depend on the capacity, so the 80 GB profile stands in.
TORCHTITAN_MEMORY_ROWS = ("tt_2412_t1_8b_fsdp8_eager", "tt_2412_t3_8b_fsdp128_eager")


@pytest.mark.parametrize("row_id", TORCHTITAN_MEMORY_ROWS)
def test_torchtitan_reserved_peak_against_its_benchmark(row_id):
    import yaml
    from conftest import REPO

    rows = yaml.safe_load((REPO / "shardplan" / "validation" / "corpus" / "training_stacks" / "torchtitan.yaml").read_text())["rows"]
    row = next(r for r in rows if r["id"] == row_id)
    c = row["case"]
    spec = load_model(c["model"]).spec
    hw = cluster(load_hardware("h100-sxm-80gb"), gpus=c["gpus"], nodes=None, gpus_per_node=None)
    layout = Layout(dp=c["dp"], zero_stage=3, micro_batch_size=c["micro_batch"], recompute=Recompute(c["recompute"]))
    rep = estimate(spec, hw, layout, _wl("torchtitan", seq_len=c["seq_len"], gbs=c["dp"] * c["micro_batch"]))
    reserved = rep.memory.per_rank[0].reserved_bytes / BYTES_PER_GIB
    assert reserved == pytest.approx(row["measured"]["peak_memory_gib"], rel=0.05)
