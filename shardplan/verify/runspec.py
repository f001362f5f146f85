"""What `verify` runs for a plan: the model (the spec itself, or a proxy that keeps every
divisibility the layout relies on), the layout, and the work (steps, batch, sequence). It
also refuses, before anything starts, what verify cannot run. Pure: no torch, no I/O.

The proxy keeps the head counts (tensor parallelism splits heads and KV heads), the expert
count's divisibility by ep, and the pipeline split (pp x virtual stages chunks); it shrinks
head_dim, the MLP width, the vocabulary and the layers per chunk so a CPU runs it in
seconds.

The run uses the plan's number format (`run_dtype`): bf16 for a bf16, fp16 or fp8 plan (fp16
needs loss scaling and fp8 kernels a GPU that has them, so both run bf16, which has the same
bytes as fp16 and is said in the report), fp32 for an fp32 plan or under `--dtype fp32`. The
prediction measured memory is compared with is the cost model applied to the format that ran.
gloo reduces bf16 on CPUs (all_reduce, reduce_scatter, all_gather: torch 2.13), so a CPU runs
bf16 too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from shardplan.cost.layout import Layout, Offload, PipelineSchedule, Recompute
from shardplan.cost.workload import (
    Framework,
    InferenceWorkload,
    Optimizer,
    TrainingWorkload,
)
from shardplan.errors import CannotVerify
from shardplan.knowledge import model_support
from shardplan.knowledge.load import targets_file
from shardplan.knowledge.targets import Rule
from shardplan.plan.readback import plan_layout, plan_setting
from shardplan.search.targets import Setting, refusal
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs.model import ModelSpec
from shardplan.units import DType, bytes_per_element, gib_to_bytes

# The folder the launcher gives each rank for its result file (launch writes it, worker reads it).
RUN_DIR_ENV = "SHARDPLAN_VERIFY_RUN_DIR"

PROXY_HIDDEN_SIZE = 512  # at most this many hidden elements: heads x head_dim
PROXY_MAX_VOCAB = 1024
PROXY_LAYERS_PER_CHUNK = 4
PROXY_MAX_EXPERTS = 8
PROXY_SEQ_LEN = 64
PROXY_MAX_MICRO_BATCH = 2
SERVING_MAX_BATCH = 4
SERVING_MAX_PROMPT = 32
SERVING_MAX_DECODE = 4
DEFAULT_STEPS = 3
DTYPE_CHOICES = ("plan", "fp32")  # --dtype: the plan's format, or fp32 (bit-comparable, tighter numerics)
# The loss upcasts the logits to fp32 (torchtitan's `pred.float()`); log_softmax's fp32 output is
# its largest tensor, 4 bytes a logit: the block the caching allocator must find at the peak.
LOSS_LARGEST_BYTES_PER_LOGIT = 4.0
TORCH_DTYPE_NAMES = {DType.FP32: "float32", DType.BF16: "bfloat16"}  # ModelSpec.dtype, read by verify.model
BF16_MOE_NOTE = ("bf16 with MoE blocks: tokens are routed round-robin over the experts (torchtitan's "
                 "moe_force_load_balance), here and in the reference: bf16 rounds the sharded run's router inputs "
                 "differently from the reference's, which flips top-k choices that nearly tie (a whole expert's output "
                 "apart, not a rounding error); the prediction spreads tokens evenly either way")
# Where an offloaded serving plan goes instead of a torchrun launch (cli/cmd_verify.py routes it).
OFFLOAD_SERVING_HINT = "give the model's checkpoint folder: shardplan verify PLAN --checkpoint DIR"
CP_CHUNKS_PER_RANK = 2  # context parallelism: a head and a tail chunk per rank (context.CHUNKS_PER_RANK)


@dataclass(frozen=True)
class RunSpec:
    """One verify run. Training: `steps` optimizer steps of `num_microbatches` micro-batches
    of `micro_batch_size` sequences of `seq_len` tokens per data-parallel rank. Serving: one
    prefill of `batch_size` prompts of `prompt_len` tokens, then `decode_steps` decode steps."""

    kind: str  # "training" or "inference"
    scale: str  # "proxy" or "full"
    spec: ModelSpec
    layout: Layout
    steps: int = DEFAULT_STEPS
    seq_len: int = PROXY_SEQ_LEN
    num_microbatches: int = 1
    optimizer: Optimizer = Optimizer.ADAMW
    batch_size: int = 1
    prompt_len: int = 1
    decode_steps: int = 1
    force_load_balance: bool = False  # MoE routing round-robin over experts (model.route), here and in the reference
    dtype: DType = DType.FP32  # the format weights, gradients, activations and the KV cache run in (fp32 or bf16)
    plan_dtype: DType = DType.FP32  # the plan's format (training: its activation dtype; serving: its activation dtype)
    # The optimizer's master weights and moments (training, 16-bit runs): fp32, or bf16 for a plan's
    # --master-dtype bf16 --moment-dtype bf16: the bf16 weights are their own master, stepped by
    # torch's optimizer with bf16 moments (the `verify` rules refuse the two apart).
    optimizer_dtype: DType = DType.FP32
    # The device memory the run may use, bytes (a GPU's total, as the profile's memory_capacity_gib):
    # --device-memory-gib, else the plan's GPU at --scale full; None: no limit but the device's own.
    device_memory_bytes: int | None = None
    device_memory_from_option: bool = False  # --device-memory-gib set it (else the plan's GPU)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def training(self) -> bool:
        return self.kind == "training"

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def training_workload(self) -> TrainingWorkload:
        """The workload the cost model is applied to: what ran, batch for batch and in its format.
        The ZeRO paper's states (bf16: 2-byte weights and gradients, fp32 master and moments in
        the optimizer; fp32: the weights are their own master); the logits alive when the
        forward ends are in the run's format (the loss upcasts them after), and the loss's fp32
        log-softmax is the largest single tensor."""
        L = self.layout
        return TrainingWorkload(
            seq_len=self.seq_len, global_batch_size=self.num_microbatches * L.micro_batch_size * L.dp,
            optimizer=self.optimizer, framework=Framework.ZERO, param_dtype=self.dtype,
            activation_dtype=self.dtype, flash_attention=True, dropout=False, loss_fp32_logits=self.dtype is DType.FP32,
            largest_allocation_bytes_per_logit=LOSS_LARGEST_BYTES_PER_LOGIT,
            pp_holds_stage_outputs=True,  # the run's pipeline is torch.distributed.pipelining (worker.py)
            master_dtype=self.optimizer_dtype, moment_dtype=self.optimizer_dtype,
        )

    def inference_workload(self) -> InferenceWorkload:
        """vLLM-style figures for the run's one prefill: every prompt token in one forward, the
        sampler over `batch_size` rows."""
        return InferenceWorkload(
            max_model_len=self.prompt_len + self.decode_steps, max_num_seqs=self.batch_size,
            max_num_batched_tokens=self.batch_size * self.prompt_len, activation_dtype=self.dtype,
            kv_cache_dtype=self.dtype, enforce_eager=True, input_len=self.prompt_len,
            output_len=self.decode_steps, batch_size=self.batch_size,
        )

    def as_dict(self) -> dict[str, Any]:
        s = self.spec
        out: dict[str, Any] = {
            "kind": self.kind,
            "scale": self.scale,
            "dtype": self.dtype.value,
            "plan_dtype": self.plan_dtype.value,
            "device_memory_bytes": self.device_memory_bytes,
            "model": {
                "hidden_size": s.hidden_size, "num_layers": s.num_layers, "num_attention_heads": s.num_attention_heads,
                "num_kv_heads": s.kv_heads, "head_dim": s.attention_head_dim, "intermediate_size": s.intermediate_size,
                "vocab_size": s.vocab_size, "num_experts": s.moe.num_experts if s.moe else None,
            },
            "notes": list(self.notes),
        }
        if self.training:
            out["work"] = {"steps": self.steps, "seq_len": self.seq_len, "micro_batch_size": self.layout.micro_batch_size,
                           "num_microbatches": self.num_microbatches, "optimizer": self.optimizer.value,
                           "optimizer_dtype": self.optimizer_dtype.value,
                           "moe_routing": "round-robin" if self.force_load_balance else "top-k"}
        else:
            out["work"] = {"batch_size": self.batch_size, "prompt_len": self.prompt_len, "decode_steps": self.decode_steps,
                           "moe_routing": "round-robin" if self.force_load_balance else "top-k"}
        return out


def _refuse(field: str, what: str, hint: str) -> CannotVerify:
    return CannotVerify(f"verify does not run {what} yet", field=field, hint=hint)


def check_model(spec: ModelSpec) -> None:
    """Refuse a model the verify model cannot build, whatever the layout (knowledge/model_support.py)."""
    refused = model_support.verify(spec)
    if refused is not None:
        raise CannotVerify(refused.says, field=refused.field, hint=refused.hint)


def check_runnable(spec: ModelSpec, layout: Layout, *, training: bool = True, setting: Setting | None = None) -> None:
    """Refuse, before any process starts, what the verify model or its parallel set-up does not run:
    the model (`check_model`), then the layout by the `verify` rules of knowledge/targets.yaml,
    the rules `recommend --target` keeps to. `setting`: the plan's workload and cluster
    (`readback.plan_setting`); without it, the model's with a full fine-tune."""
    check_model(spec)
    s = setting or _setting(spec, training)
    if not training and layout.offload_params is not Offload.NONE:
        # Offloaded serving runs in one process, from the model's own weights, with accelerate's
        # offload hooks (verify.offload_serving): `verify PLAN --checkpoint DIR` takes it there.
        raise CannotVerify("an offloaded serving plan is verified by loading its checkpoint with accelerate, not "
                           "by a torchrun launch", field="layout.offload_params", hint=OFFLOAD_SERVING_HINT)
    _refuse_by_rules(targets_file().rule_sets["verify"], layout, s)


def _setting(spec: ModelSpec, training: bool) -> Setting:
    model = dict(gpus_per_node=1, num_nodes=1, num_layers=spec.num_layers, moe=spec.moe is not None,
                 kv_heads=spec.num_attention_heads if spec.mla is not None else spec.kv_heads,
                 tied_embeddings=spec.tie_word_embeddings)
    if training:
        return Setting(workload="training", finetune="full", optimizer="adamw", master_dtype="fp32",
                       moment_dtype="fp32", grad_reduce_dtype="fp32", **model)
    return Setting(workload="inference", **model)


def _refuse_by_rules(rules: Sequence[Rule], layout: Layout, s: Setting) -> None:
    found = refusal([("", r) for r in rules], layout, s)
    if found is not None:
        _, rule, fact = found
        raise CannotVerify(rule.words(fact), field=rule.field, hint=rule.fix(fact))


def _round_up(x: float, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


def proxy_spec(spec: ModelSpec, layout: Layout) -> ModelSpec:
    """A small model with the same layout constraints: heads and KV heads kept (tp splits
    them), head_dim shrunk to fit PROXY_HIDDEN_SIZE, the MLP width scaled with the hidden size
    and divisible by tp, a vocabulary of at most PROXY_MAX_VOCAB divisible by tp, and at most
    PROXY_LAYERS_PER_CHUNK layers per pipeline chunk (two, so every
    chunk has a layer-to-layer boundary)."""
    heads = spec.num_attention_heads
    head_dim = min(spec.attention_head_dim, max(4, PROXY_HIDDEN_SIZE // heads))
    head_dim -= head_dim % 2  # rotary pairs
    hidden = heads * head_dim
    tp = layout.tp
    ratio = spec.intermediate_size / spec.hidden_size
    intermediate = _round_up(hidden * ratio, 8 * tp)
    vocab = _round_up(min(spec.vocab_size, PROXY_MAX_VOCAB), 8 * tp)
    chunks = layout.pp * layout.virtual_stages
    per_chunk = PROXY_LAYERS_PER_CHUNK
    moe = spec.moe
    if moe is not None:
        experts = min(moe.num_experts, max(PROXY_MAX_EXPERTS, layout.ep))
        experts -= experts % layout.ep
        width = _round_up(hidden * moe.expert_intermediate_size / spec.hidden_size, 8 * layout.expert_tp)
        moe = moe.model_copy(update=dict(
            num_experts=experts, num_experts_per_token=min(moe.num_experts_per_token, experts),
            expert_intermediate_size=width, first_dense_layers=min(moe.first_dense_layers, 1),
            dense_layer_indices=(), moe_layer_step=1 if moe.moe_layer_step > per_chunk * chunks else moe.moe_layer_step,
        ))
    return spec.model_copy(update=dict(
        name=f"{spec.name}-proxy", source=f"proxy of {spec.name}", vocab_size=vocab, hidden_size=hidden,
        num_layers=per_chunk * chunks, head_dim=head_dim, intermediate_size=intermediate, moe=moe, num_mtp_layers=0,
    ))


def _context_parallel_seq_len(seq: int, cp: int, *, shrink: bool) -> int:
    """The sequence cut into CP_CHUNKS_PER_RANK x cp equal chunks (the proxy's shortened to a
    multiple); CannotVerify when it cannot be."""
    chunks = CP_CHUNKS_PER_RANK * cp
    fitted = seq - seq % chunks if shrink else seq
    if fitted == 0 or fitted % chunks:
        raise _refuse("layout.cp", f"a sequence of {seq} tokens over cp={cp} (it must split into {chunks} equal chunks)",
                      f"use a seq_len that is a multiple of {chunks}")
    return fitted


def plan_dtype(m: DeploymentManifest) -> DType:
    """The format the plan's math runs in: training, its activation dtype (bf16 weights under
    fp32 ones are AMP, whose matmuls run bf16); serving, its activation dtype (the format of
    the unquantized weights and, by default, the KV cache)."""
    return DType(m.workload.activation_dtype)


def run_dtype(m: DeploymentManifest, choice: str) -> tuple[DType, DType, list[str]]:
    """(the format the run uses, the plan's, notes saying where they differ). `choice` is
    --dtype: "plan" or "fp32"."""
    planned = plan_dtype(m)
    notes: list[str] = []
    if choice not in DTYPE_CHOICES:
        raise CannotVerify(f"--dtype {choice!r} is not one of {', '.join(DTYPE_CHOICES)}", field="--dtype",
                           hint="use --dtype plan (the plan's format) or --dtype fp32")
    if choice == "fp32":
        if planned is not DType.FP32:
            notes.append(f"--dtype fp32: the plan is {planned.value}; ran fp32 and compared with the cost model applied "
                         f"to fp32 (weights, gradients, activations and KV cache at 4 bytes an element, "
                         f"{4 / bytes_per_element(planned):g}x the plan's)")
        return DType.FP32, planned, notes
    if planned in (DType.FP32, DType.TF32):
        return DType.FP32, planned, notes
    if planned is not DType.BF16:
        notes.append(f"the plan is {planned.value}; verify runs it in bf16 (fp16 would need loss scaling, fp8 kernels "
                     f"verify does not run) and compares with the cost model applied to bf16")
    wl = m.workload
    if wl.kind == "inference":
        if wl.quantization != "none":
            notes.append(f"the plan's {wl.quantization} weight quantization is not run: the weights are bf16, and so "
                         "is their prediction")
        if wl.kv_cache_dtype not in (None, "bf16"):
            notes.append(f"the plan's {wl.kv_cache_dtype} KV cache runs bf16, and so does its prediction")
    elif DType(wl.param_dtype) is not planned:
        notes.append(f"the plan keeps {wl.param_dtype} weights; verify keeps bf16 weights with fp32 masters in the "
                     "optimizer (the ZeRO paper's count), and so does its prediction")
    return DType.BF16, planned, notes


def plan_run(m: DeploymentManifest, spec: ModelSpec, *, scale: str, steps: int = DEFAULT_STEPS, dtype: str = "plan",
             device_memory_gib: float | None = None) -> RunSpec:
    """The run for plan `m` of model `spec`. Raises CannotVerify for what verify does not run.
    `dtype` is --dtype; `device_memory_gib` is --device-memory-gib (None: the plan's GPU at
    --scale full, no limit but the device's own for a proxy)."""
    layout = plan_layout(m)
    training = m.workload.kind == "training"
    # The model, the layout, fine-tuning and the optimizer by the `verify` rules; a 1F1B pipeline
    # by torch's (Schedule1F1B wants as many micro-batches as stages) (knowledge/targets.yaml).
    setting = plan_setting(m, spec)
    check_runnable(spec, layout, training=training, setting=setting)
    if training:
        _refuse_by_rules(targets_file().rule_sets["torch_pipelining"], layout, setting)
    fmt, planned, notes = run_dtype(m, dtype)
    if device_memory_gib is not None and device_memory_gib <= 0:
        raise CannotVerify(f"--device-memory-gib {device_memory_gib:g} is not a memory size", field="--device-memory-gib",
                           hint="give the device's memory in GiB, e.g. 80")
    device_memory = (gib_to_bytes(device_memory_gib) if device_memory_gib is not None
                     else m.hardware.memory_capacity_bytes if scale == "full" else None)
    limits = {"dtype": fmt, "plan_dtype": planned, "device_memory_bytes": device_memory,
              "device_memory_from_option": device_memory_gib is not None}
    run_spec = proxy_spec(spec, layout) if scale == "proxy" else spec
    run_spec = run_spec.model_copy(update={"dtype": TORCH_DTYPE_NAMES[fmt]})
    batch_ranks = layout.dp * layout.cp  # ZeRO shards over the data and context ranks (torchtitan's dp_shard_cp)
    if layout.zero_stage and batch_ranks == 1 and layout.offload_params is Offload.NONE:
        layout = replace(layout, zero_stage=0)
        notes.append("ZeRO over one data-parallel rank shards nothing: it runs, and is predicted, as stage 0")
    if layout.zero_stage == 1 and batch_ranks > 1:
        layout = replace(layout, zero_stage=2)
        notes.append("ZeRO-1 runs as FSDP2 without resharding after forward (ZeRO-2): gradients are sharded too; "
                     "the prediction is for stage 2")
    if layout.recompute is Recompute.SELECTIVE:
        layout = replace(layout, recompute=Recompute.NONE)
        modules = [x for x in getattr(m.workload, "recompute_modules", []) if x != "core_attn"]
        if modules:
            notes.append(f"selective recomputation of {', '.join(modules)} runs as none: verify's model checkpoints "
                         "no submodules; the prediction is for none")
        else:
            notes.append("selective recomputation runs as none: flash attention already recomputes the scores; "
                         "the prediction is for none")
    if not training:
        wl = m.workload
        batch = min(m.predicted.time.batch_size, SERVING_MAX_BATCH)
        prompt = min(wl.input_len, SERVING_MAX_PROMPT) if scale == "proxy" else wl.input_len
        decode = min(wl.output_len, SERVING_MAX_DECODE)
        run_spec = run_spec.model_copy(update=dict(max_position_embeddings=max(prompt + decode, 1)))
        balanced = spec.moe is not None and fmt is DType.BF16
        if balanced:
            notes.append(BF16_MOE_NOTE)
        return RunSpec(kind="inference", scale=scale, spec=run_spec, layout=layout, batch_size=batch,
                       prompt_len=prompt, decode_steps=decode, notes=tuple(notes), steps=1,
                       force_load_balance=balanced, **limits)
    wl = m.workload
    num_micro = max(1, wl.global_batch_size // (layout.dp * layout.micro_batch_size))
    seq = wl.seq_len
    if scale == "proxy":
        seq = min(seq, PROXY_SEQ_LEN)
        layout = replace(layout, micro_batch_size=min(layout.micro_batch_size, PROXY_MAX_MICRO_BATCH))
        num_micro = min(num_micro, 2 * layout.pp) if layout.pp > 1 else min(num_micro, 2)
    if layout.pp_schedule is PipelineSchedule.INTERLEAVED:
        num_micro = _round_up(num_micro, layout.pp)
    if layout.cp > 1:
        seq = _context_parallel_seq_len(seq, layout.cp, shrink=scale == "proxy")
        notes.append(f"context parallelism: each cp rank runs {seq // layout.cp} of the {seq} tokens of every sequence "
                     f"(load-balanced head and tail chunks), attention all-gathers K and V")
    balanced = layout.ep > 1 and spec.moe is not None
    if balanced:
        notes.append("expert parallelism: tokens are routed round-robin over the experts (torchtitan's "
                     "moe_force_load_balance), as the prediction spreads them evenly; top-k routing on an untrained "
                     "model sent one expert-parallel rank 0.4x to 1.6x its share of tokens")
    if spec.moe is not None and fmt is DType.BF16 and not balanced:
        balanced = True
        notes.append(BF16_MOE_NOTE)
    run_spec = run_spec.model_copy(update=dict(max_position_embeddings=max(seq, 1)))
    optimizer_dtype = DType(wl.master_dtype)
    if optimizer_dtype is not DType.FP32 and fmt is DType.FP32:
        notes.append(f"the plan keeps {wl.master_dtype} master weights and moments; an fp32 run's weights are their "
                     "own master with fp32 moments, and so is its prediction")
        optimizer_dtype = DType.FP32
    return RunSpec(kind="training", scale=scale, spec=run_spec, layout=layout, steps=steps, seq_len=seq,
                   num_microbatches=num_micro, optimizer=Optimizer(wl.optimizer), force_load_balance=balanced,
                   optimizer_dtype=optimizer_dtype, notes=tuple(notes), **limits)
