"""Step time per training stack: the attention kernel the stack runs on this GPU, its eager
elementwise traffic, torch.compile, the loss head's traffic, op-level recomputation, fp8 GEMMs,
and FSDP's unsharded stages under pipeline parallelism (issue: training per stack). Every
expected figure is recomputed here from the model's shapes and the stacks' files."""

from __future__ import annotations

import dataclasses

import pytest

from shardplan.cost.compute import FUSED, Work, elementwise_bytes, layer_forward
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, Recompute
from shardplan.cost.memory_training import training_memory
from shardplan.cost.time_training import _cached_stage_time, _groups, attention_kernel, elementwise_traffic, training_time
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import stack_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model
from shardplan.units import DType

LLAMA8B = load_model("llama-3.1-8b").spec


def _wl(stack: str, **kw):
    return training_workload(seq_len=8192, global_batch_size=16, optimizer="adamw", framework=None,
                             flash_attention=None, dropout=False, stack=stack_rules(stack), **kw)


def _hw(name: str, gpus: int = 8):
    return cluster(load_hardware(name), gpus=gpus, nodes=None, gpus_per_node=None)


@pytest.mark.parametrize(("stack", "profile", "kernel"), [
    ("torchtitan", "h100-sxm-80gb", ("fa2", 0.35, 0.32)),  # SDPA's flash backend: FlashAttention-2
    ("megatron", "h100-sxm-80gb", ("cudnn", 0.607, 0.524)),  # Transformer Engine's cuDNN attention
    ("megatron", "a100-sxm-80gb", ("fa2", 0.70, 0.60)),  # no cuDNN figure on the A100: its next choice
    ("hf", "l40s-48gb", None),  # no kernel measured on the L40S: the profile's attention efficiency
])
def test_the_stacks_attention_kernel_is_the_first_the_gpu_has_measured(stack, profile, kernel):
    assert attention_kernel(_hw(profile), _wl(stack)) == kernel


def test_attention_kernel_override_and_eager():
    hw = _hw("h100-sxm-80gb")
    assert attention_kernel(hw, _wl("torchtitan", attention_kernel="fa3")) == ("fa3", 0.65, 0.565)
    eager = _wl("torchtitan", attention_kernel="eager")
    assert not eager.flash_attention and attention_kernel(hw, eager) is None


def test_the_attention_backward_runs_at_the_kernels_backward_efficiency():
    """FlashAttention-2 on an H100 runs its backward (2.5x the forward's FLOPs) at 32% of the peak
    against 35% forward: backward / forward attention seconds = 2.5 x 0.35 / 0.32."""
    hw, wl = _hw("h100-sxm-80gb"), _wl("torchtitan")
    layout = Layout(dp=8, zero_stage=3, micro_batch_size=2)
    g = _groups(layout, hw)
    st = _cached_stage_time(LLAMA8B, hw, layout, wl, g.tp, g.cp, g.ep, (1,), False, False)
    assert st.backward.attention_seconds / st.forward.attention_seconds == pytest.approx(2.5 * 0.35 / 0.32, rel=1e-9)


def _layer_work(wl, hw, tokens=8192.0):
    return Work(tokens=tokens, num_seqs=1, q_len=tokens, kv_len=tokens, decode=False,
                elementwise=elementwise_traffic(wl))


def test_eager_elementwise_traffic_is_the_stacks_count():
    """torchtitan's eager ops on Llama 3.1 8B (h 4096, 32 query and 8 KV heads of 128, ffn
    14336), per token: two norms at 36 bytes per hidden element, RoPE at 20 bytes per rotated
    element of q and k, SwiGLU at 10 bytes per intermediate element, two residual adds at 6."""
    wl = _wl("torchtitan")
    tokens = 8192.0
    got, _ = elementwise_bytes(LLAMA8B, Layout(), _layer_work(wl, None, tokens), moe_layer=False)
    h, f = 4096, 14336
    want = tokens * (2 * 36 * h + 20 * (32 * 128 + 8 * 128) + 10 * f + 2 * 6 * h)
    assert got == pytest.approx(want, rel=1e-12)
    fused, _ = elementwise_bytes(LLAMA8B, Layout(), Work(tokens=tokens, num_seqs=1, q_len=tokens, kv_len=tokens,
                                                         decode=False), moe_layer=False)
    assert fused == pytest.approx(tokens * (2 * 4 * h + 4 * (32 * 128 + 8 * 128) + 6 * f + 2 * 6 * h), rel=1e-12)


def test_compile_fuses_the_elementwise_ops_and_drops_the_fp32_norm_copies():
    eager, compiled = _wl("torchtitan"), _wl("torchtitan", compile=True)
    assert elementwise_traffic(compiled) is FUSED and not compiled.norms_fp32
    assert eager.norms_fp32 and elementwise_traffic(eager) is not FUSED
    hw, layout = _hw("h100-sxm-80gb"), Layout(dp=8, zero_stage=3, micro_batch_size=2, recompute=Recompute.SELECTIVE)
    t_eager = training_time(LLAMA8B, hw, layout, eager, 1).step_seconds
    t_compiled = training_time(LLAMA8B, hw, layout, compiled, 1).step_seconds
    assert t_compiled < t_eager


def test_compile_on_a_stack_without_it_is_an_error():
    with pytest.raises(ShardplanError) as e:
        _wl("megatron", compile=True)
    assert e.value.field == "--compile"


def test_the_loss_heads_traffic_is_timed_on_the_last_stage():
    """cross_entropy(logits.float()) over 128256 logits a token: 22 bytes a logit forward and
    26 backward at the profile's bandwidth, on the last stage only."""
    hw, wl = _hw("h100-sxm-80gb"), _wl("hf")
    silent = dataclasses.replace(wl, loss_forward_bytes_per_logit=0.0, loss_backward_bytes_per_logit=0.0)
    layout = Layout(dp=8, zero_stage=3, micro_batch_size=1)
    g = _groups(layout, hw)
    args = (LLAMA8B, hw, layout)
    with_loss = _cached_stage_time(*args, wl, g.tp, g.cp, g.ep, (0,), False, True)
    without = _cached_stage_time(*args, silent, g.tp, g.cp, g.ep, (0,), False, True)
    bw = hw.memory_bandwidth_bytes_per_second * hw.memory_bandwidth_efficiency
    logits = 8192 * 128256
    assert with_loss.forward.memory_seconds - without.forward.memory_seconds == pytest.approx(logits * 22 / bw, rel=1e-9)
    assert with_loss.backward.memory_seconds - without.backward.memory_seconds == pytest.approx(logits * 26 / bw, rel=1e-9)
    middle = _cached_stage_time(*args, wl, g.tp, g.cp, g.ep, (0,), False, False)
    assert middle == _cached_stage_time(*args, silent, g.tp, g.cp, g.ep, (0,), False, False)


def test_op_level_selective_recomputes_every_second_matmul_and_the_elementwise_work():
    """torchtitan's 'op' policy drops the 2nd, 4th and 6th matmuls of a Llama block (k, o and up
    projections) and recomputes them, with every elementwise op, in backward."""
    hw, wl = _hw("h100-sxm-80gb"), _wl("torchtitan")
    tokens = 2 * 8192.0
    fwd = layer_forward(LLAMA8B, hw, Layout(), _layer_work(wl, hw, tokens), 1)
    h = 4096
    dropped = 2 * tokens * (h * 8 * 128 + h * h + h * 14336)  # k, o and up projections
    assert fwd.dropped_matmul_flops == pytest.approx(dropped, rel=1e-12)
    layout = Layout(dp=8, zero_stage=3, micro_batch_size=2)
    g = _groups(layout, hw)
    plain = _cached_stage_time(LLAMA8B, hw, layout, wl, g.tp, g.cp, g.ep, (1,), False, False)
    sel = dataclasses.replace(layout, recompute=Recompute.SELECTIVE)
    g = _groups(sel, hw)
    st = _cached_stage_time(LLAMA8B, hw, sel, wl, g.tp, g.cp, g.ep, (1,), False, False)
    extra = st.backward.seconds - plain.backward.seconds
    assert extra == pytest.approx(fwd.dropped_matmul_seconds + fwd.memory_seconds + fwd.kernel_seconds, rel=1e-9)
    assert st.backward.flops - plain.backward.flops == pytest.approx(dropped, rel=1e-9)


def test_fp8_gemms_are_faster_and_pay_for_their_input_casts():
    hw = _hw("h100-sxm-80gb")
    bf16, fp8 = _wl("torchtitan", compile=True), _wl("torchtitan", compile=True, matmul_dtype="fp8")
    assert fp8.matmul_dtype is DType.FP8
    layout = Layout(dp=8, zero_stage=3, micro_batch_size=2)
    assert training_time(LLAMA8B, hw, layout, fp8, 1).step_seconds < training_time(LLAMA8B, hw, layout, bf16, 1).step_seconds
    tokens = 8192.0
    base = Work(tokens=tokens, num_seqs=1, q_len=tokens, kv_len=tokens, decode=False)
    casts, _ = elementwise_bytes(LLAMA8B, Layout(), dataclasses.replace(base, fp8_casts=True), moe_layer=False)
    plain, _ = elementwise_bytes(LLAMA8B, Layout(), base, moe_layer=False)
    h, f = 4096, 14336
    assert casts - plain == pytest.approx(5 * tokens * (h + 32 * 128 + h + f), rel=1e-12)
    with pytest.raises(ShardplanError):
        _wl("torchtitan", matmul_dtype="int4")


def test_fsdp_under_pipeline_parallelism_keeps_the_stage_unsharded():
    """torchtitan's FSDP under a pipeline schedule: each stage's bf16 parameters stay gathered and
    its gradients accumulate unsharded in fp32 until the last micro-batch."""
    spec = load_model("llama-3.1-405b").spec
    hw = _hw("h100-sxm-80gb", gpus=512)
    layout = Layout(tp=8, pp=8, dp=8, zero_stage=3, micro_batch_size=1, recompute=Recompute.FULL, sequence_parallel=True)
    wl = _wl("torchtitan")
    on = training_memory(spec, hw, layout, wl).ranks[3]
    off = training_memory(spec, hw, layout, dataclasses.replace(wl, fsdp_unsharded_under_pp=False)).ranks[3]
    numel = on.detail["gradients.unsharded_fp32_accumulation"] / 4
    assert on.detail["temporary.unsharded_stage_parameters"] == pytest.approx(2 * numel)
    assert on.breakdown.gradients - off.breakdown.gradients == pytest.approx(4 * numel)
    assert on.breakdown.temporary == pytest.approx(max(off.breakdown.temporary, 2 * numel))
    # 126 layers of ~3.2e9 parameters a stage... 405e9 / (8 stages x 8 tp ranks) within 15%
    assert numel == pytest.approx(405e9 / 64, rel=0.15)


def test_estimate_prints_the_kernel_it_assumed(cli):
    r = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--hardware", "h100-sxm-80gb",
            "--dp", "8", "--zero-stage", "3", "--micro-batch-size", "1", "--seq-len", "8192", "--global-batch-size", "8",
            "--json")
    assert r.exit_code in (0, 3), r.stderr
    lines = r.json()["assumptions"]
    assert any("FlashAttention-2 at 35% of the 16-bit peak forward, 32% backward" in x for x in lines), lines
    r = cli("estimate", "llama-3.1-8b", "--workload", "training", "--gpus", "8", "--hardware", "h100-sxm-80gb",
            "--dp", "8", "--zero-stage", "3", "--micro-batch-size", "1", "--seq-len", "8192", "--global-batch-size", "8",
            "--stack", "megatron", "--attention-kernel", "bogus")
    assert r.exit_code == 2 and "--attention-kernel" in r.stderr and "Traceback" not in r.stderr


def test_tp_comm_overlap_exposes_only_what_the_gemms_cannot_hide():
    """Megatron with --tp-comm-overlap (TE userbuffers): each pass's TP collectives run beside that
    pass's GEMMs; exposed = overlapped(GEMMs, comm) - GEMMs, with the profile's overlap share."""
    from shardplan.cost.comm import overlapped

    hw = _hw("h100-sxm-80gb")
    wl = _wl("megatron")
    on = _wl("megatron", tp_comm_overlap=True)
    layout = Layout(tp=8, sequence_parallel=True, micro_batch_size=1)
    g = _groups(layout, hw)
    plain = _cached_stage_time(LLAMA8B, hw, layout, wl, g.tp, g.cp, g.ep, (1,), False, False)
    over = _cached_stage_time(LLAMA8B, hw, layout, on, g.tp, g.cp, g.ep, (1,), False, False)
    tp_pass = plain.tp_seconds / 2
    gemm = plain.forward.matmul_seconds
    want = overlapped(gemm, tp_pass, hw) - gemm + overlapped(2 * gemm, tp_pass, hw) - 2 * gemm
    assert over.tp_seconds == pytest.approx(want, rel=1e-9)
    assert 0 < over.tp_seconds < plain.tp_seconds
    with pytest.raises(ShardplanError) as e:
        _wl("hf", tp_comm_overlap=True)
    assert e.value.field == "--tp-comm-overlap"


def test_megatron_overlaps_pipeline_sends_only_when_interleaved():
    spec = load_model("llama-3.1-70b").spec
    hw = _hw("h100-sxm-80gb", gpus=64)
    wl = training_workload(seq_len=8192, global_batch_size=128, optimizer="adamw", framework=None,
                           flash_attention=None, dropout=False, stack=stack_rules("megatron"))
    assert wl.pp_p2p_overlap
    inter = Layout(tp=4, pp=8, dp=2, zero_stage=1, sequence_parallel=True, virtual_stages=5,
                   pp_schedule="interleaved")
    blocking = dataclasses.replace(wl, pp_p2p_overlap=False)
    p2p = training_time(spec, hw, inter, wl, 64).breakdown.pipeline_p2p
    p2p_blocking = training_time(spec, hw, inter, blocking, 64).breakdown.pipeline_p2p
    assert 0 < p2p < 0.5 * p2p_blocking
    one_f_one_b = Layout(tp=4, pp=8, dp=2, zero_stage=1, sequence_parallel=True)
    assert training_time(spec, hw, one_f_one_b, wl, 64).breakdown.pipeline_p2p == pytest.approx(
        training_time(spec, hw, one_f_one_b, blocking, 64).breakdown.pipeline_p2p)


def test_dropout_comes_from_the_config_with_transformers_defaults():
    from shardplan.specs.hf import spec_from_hf_config

    gpt2, llama = load_model("gpt2").spec, LLAMA8B
    assert (gpt2.attention_dropout, gpt2.hidden_dropout) == (0.1, 0.1) and gpt2.trains_with_dropout
    assert not llama.trains_with_dropout
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 128,
           "attention_dropout": 0.2}
    assert spec_from_hf_config(cfg, "tiny").attention_dropout == 0.2
    silent_gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 256, "n_layer": 2, "n_head": 4,
                   "vocab_size": 1000, "n_positions": 128}
    assert spec_from_hf_config(silent_gpt2, "tiny").hidden_dropout == 0.1  # GPT2Config's default


def test_training_dropout_defaults_to_the_models(cli):
    args = ("estimate", "gpt2", "--workload", "training", "--gpus", "1", "--seq-len", "1024", "--global-batch-size", "8",
            "--micro-batch-size", "8", "--json")
    assert cli(*args).json()["workload"]["dropout"] is True
    assert cli(*args, "--no-dropout").json()["workload"]["dropout"] is False
    args_llama = ("estimate", "llama-3.2-1b", *args[2:])
    assert cli(*args_llama).json()["workload"]["dropout"] is False


def test_layernorm_and_plain_gelu_are_single_kernels_even_in_an_eager_stack():
    """F.layer_norm and F.gelu are native fused kernels: the eager counts (RMSNorm written as ops,
    SwiGLU) do not apply to GPT-2's block, so its traffic is the fused one."""
    gpt2 = load_model("gpt2").spec
    tokens = 1024.0
    eager = Work(tokens=tokens, num_seqs=1, q_len=tokens, kv_len=tokens, decode=False,
                 elementwise=elementwise_traffic(_wl("torchtitan")))
    fused = dataclasses.replace(eager, elementwise=FUSED)
    assert elementwise_bytes(gpt2, Layout(), eager, moe_layer=False) == elementwise_bytes(gpt2, Layout(), fused, moe_layer=False)


@pytest.mark.parametrize(("stack", "per_score"), [("megatron", 13), ("hf", 42), ("deepspeed", 26), ("torchtitan", 21)])
def test_unfused_attention_pays_the_stacks_traffic_per_score(stack, per_score):
    """Without flash attention the score matrix is written and read by every eager op: Megatron's
    fused softmax 13 bytes a score with dropout, HF's eager GPT-2 attention under autocast 42, the
    same under DeepSpeed's 16-bit engine 26; without dropout, 5 fewer."""
    from shardplan.cost.compute import attention_time

    hw = _hw("a100-sxm-80gb", gpus=1)
    gpt2 = load_model("gpt2").spec
    wl = _wl(stack, attention_kernel="eager")
    s = 1024.0
    scores = 12 * s * s
    base = Work(tokens=s, num_seqs=1, q_len=s, kv_len=s, decode=False, flash_attention=False, dropout=True,
                eager_attention_bytes_per_score=wl.eager_attention_bytes_per_score)
    none = dataclasses.replace(base, eager_attention_bytes_per_score=1e-9, dropout=True)
    bw = hw.memory_bandwidth_bytes_per_second * hw.memory_bandwidth_efficiency
    t, _, _ = attention_time(gpt2, hw, Layout(), base, 0)
    t0, _, _ = attention_time(gpt2, hw, Layout(), none, 0)
    assert t - t0 == pytest.approx(scores * per_score / bw, rel=1e-6)
    t_nodrop, _, _ = attention_time(gpt2, hw, Layout(), dataclasses.replace(base, dropout=False), 0)
    assert t - t_nodrop == pytest.approx(scores * 5 / bw, rel=1e-6)


@pytest.mark.parametrize("stack", ["hf", "torchtitan"])
def test_compile_fuses_the_loss_unless_the_run_compiled_only_the_layers(stack):
    """A whole-model compile (HF Trainer torch_compile; torchtitan since 2025-04) fuses the loss:
    4 bytes a logit instead of 12; regional compilation (compile_loss=False) keeps the eager loss,
    and with it torchtitan's loss-parallel figure under tensor parallelism."""
    eager = stack_rules(stack)
    assert _wl(stack).loss_bytes_per_logit == eager.loss_bytes_per_logit == 12
    assert _wl(stack, compile=True).loss_bytes_per_logit == 4
    assert _wl(stack, compile=True).loss_parallel_bytes_per_logit is None
    assert _wl(stack, compile=True).largest_allocation_bytes_per_logit == 2
    regional = _wl(stack, compile=True, compile_loss=False)
    assert regional.loss_bytes_per_logit == 12
    assert regional.loss_parallel_bytes_per_logit == eager.loss_parallel_bytes_per_logit
