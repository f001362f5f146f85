"""Megatron-LM: `pretrain.sh`, torchrun per node starting Megatron-LM's `pretrain_gpt.py` with the
plan's parallel layout, batch, recomputation and the model's shape as flags.

Every flag is checked against `flags/megatron-<version>.yaml`, dumped from Megatron-LM's own
argument parser at the pinned tag by tools/megatron_flags.py. What the plan says, as Megatron
(core_v0.19.0, megatron/training/arguments.py `validate_args`) reads it:
- tp, pp, cp, ep, etp: --tensor-/--pipeline-/--context-/--expert-model-parallel-size,
  --expert-tensor-parallel-size; dp is what is left of the world size (Megatron derives it);
- sequence parallelism: --sequence-parallel (Megatron drops it itself at tp = 1);
- virtual stages: --num-layers-per-virtual-pipeline-stage, (layers + the embedding and loss when
  they count as layers) / (pp x v), which is how validate_args derives the interleaving; with an
  uneven first or last stage Megatron takes --num-virtual-stages-per-pipeline-rank instead;
- the uneven split: --account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split,
  --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers;
- ZeRO-1: --use-distributed-optimizer (optimizer states sharded over the data-parallel ranks);
- recompute: selective -> --recompute-granularity selective (Megatron's default modules, the
  core attention: what the plan's `attention_core` policy keeps); full -> granularity full,
  method uniform, 1 layer per group (each layer keeps only its input).
Megatron cannot express, and so this target refuses: ZeRO-2/3 and FSDP (its distributed optimizer
keeps whole gradient buffers; FSDP is another code path this plan's memory does not follow),
hybrid sharding, offload, GPipe, LoRA/QLoRA, and model features its GPT model has no flag for.
"""

from __future__ import annotations

from shardplan.exporters.base import (
    Arg,
    ExportContext,
    ExportFile,
    Raw,
    Words,
    cannot,
    command,
    flag_table,
    model_ref,
    plan_header,
    script,
    script_words,
    training,
)
from shardplan.cost.memory_training import megatron_fp8_recipe
from shardplan.exporters.targets import check
from shardplan.knowledge import model_support
from shardplan.exporters.torchrun import script_launcher_args, script_rdzv_lines
from shardplan.specs.model import ModelSpec, NormType, PositionEmbedding, QKNorm

TARGET = "megatron"
FLAGS = "megatron-0.19.0"
_OPTIMIZER = {"adamw": "adam", "adam": "adam", "sgd": "sgd"}  # Megatron's adam is AdamW (decoupled decay)
_POSITION = model_support.MEGATRON_POSITIONS


def _expressible(ctx: ExportContext) -> None:
    training(ctx, TARGET)
    check(ctx, TARGET)  # ZeRO 2-3, hybrid sharding, offload, GPipe, adapters, optimizers (knowledge/targets.yaml)
    if ctx.spec is None:
        raise cannot(TARGET, "model.source", "Megatron builds the model from shape flags and the plan's model spec "
                     "could not be read back", "export where the plan's model spec (model.source) can be read")


def model_args(spec: ModelSpec) -> list[Arg]:
    """The model's shape as Megatron's GPT model flags; a feature it has no flag for is refused
    (knowledge/model_support.py)."""
    refused = model_support.megatron(spec)
    if refused is not None:
        raise cannot(TARGET, refused.field, refused.says, refused.hint)
    heads, kv = spec.num_attention_heads, spec.num_kv_heads or spec.num_attention_heads
    args: list[Arg] = [("num-layers", spec.num_layers), ("hidden-size", spec.hidden_size),
                       ("ffn-hidden-size", spec.intermediate_size), ("num-attention-heads", heads)]
    if spec.head_dim is not None and spec.head_dim * heads != spec.hidden_size:
        args.append(("kv-channels", spec.head_dim))
    if kv != heads:
        args += [("group-query-attention", None), ("num-query-groups", kv)]
    args.append(("max-position-embeddings", spec.max_position_embeddings))
    if spec.mlp_gated:
        args.append(("swiglu", None))
    args += [("normalization", "RMSNorm" if spec.norm_type == NormType.RMSNORM else "LayerNorm"),
             ("position-embedding-type", _POSITION[spec.position_embedding])]
    if spec.position_embedding == PositionEmbedding.ROPE:
        if spec.rope_theta is not None:
            args.append(("rotary-base", int(spec.rope_theta) if spec.rope_theta.is_integer() else spec.rope_theta))
        if spec.rotary_fraction != 1.0:
            args.append(("rotary-percent", spec.rotary_fraction))
    if spec.qk_norm == QKNorm.PER_HEAD:
        args.append(("qk-layernorm", None))
    if not spec.mlp_bias:
        args.append(("disable-bias-linear", None))
    if spec.qkv_bias and not spec.mlp_bias:
        args.append(("add-qkv-bias", None))
    if not spec.tie_word_embeddings:
        args.append(("untie-embeddings-and-output-weights", None))
    if spec.attention_dropout == 0.0 and spec.hidden_dropout == 0.0:
        args += [("attention-dropout", 0), ("hidden-dropout", 0)]  # Megatron defaults to 0.1 for both
    if spec.moe is not None:
        moe = spec.moe
        args += [("num-experts", moe.num_experts), ("moe-router-topk", moe.num_experts_per_token),
                 ("moe-ffn-hidden-size", moe.expert_intermediate_size), ("moe-grouped-gemm", None)]
        if moe.num_shared_experts:
            size = moe.shared_expert_intermediate_size or moe.expert_intermediate_size
            args.append(("moe-shared-expert-intermediate-size", moe.num_shared_experts * size))
        if moe.first_dense_layers:
            k = moe.first_dense_layers
            args.append(("moe-layer-freq", f"([0]*{k}+[1]*{spec.num_layers - k})"))
    return args


def parallel_args(ctx: ExportContext) -> list[Arg]:
    """The layout: degrees, interleaving, the uneven split, ZeRO-1, recomputation, batch."""
    m = ctx.manifest
    L, wl = m.layout, training(ctx, TARGET)
    args: list[Arg] = [("tensor-model-parallel-size", L.tp), ("pipeline-model-parallel-size", L.pp)]
    if L.virtual_stages > 1:
        if L.pp_first_stage_layers is not None or L.pp_last_stage_layers is not None:
            args.append(("num-virtual-stages-per-pipeline-rank", L.virtual_stages))
        else:
            units = m.model.num_layers + int(L.pp_embedding_as_layer) + int(L.pp_loss_as_layer)
            args.append(("num-layers-per-virtual-pipeline-stage", units // (L.pp * L.virtual_stages)))
    if L.pp_embedding_as_layer:
        args.append(("account-for-embedding-in-pipeline-split", None))
    if L.pp_loss_as_layer:
        args.append(("account-for-loss-in-pipeline-split", None))
    if L.pp_first_stage_layers is not None:
        args.append(("decoder-first-pipeline-num-layers", L.pp_first_stage_layers))
    if L.pp_last_stage_layers is not None:
        args.append(("decoder-last-pipeline-num-layers", L.pp_last_stage_layers))
    if L.sequence_parallel and L.tp > 1:
        args.append(("sequence-parallel", None))
    if L.cp > 1:
        args.append(("context-parallel-size", L.cp))
    if L.ep > 1:
        args += [("expert-model-parallel-size", L.ep), ("expert-tensor-parallel-size", L.etp)]
    # The distributed optimizer and the gradient reduction span the data-parallel ranks with the
    # context-parallel ones (megatron/core/optimizer/__init__.py: get_data_parallel_group(
    # with_context_parallel=True)), as the plan's ZeRO-1 shards over dp x cp.
    if L.zero_stage >= 1 and L.dp * L.cp > 1:
        args.append(("use-distributed-optimizer", None))
    if wl.overlap_grad_reduce and L.dp * L.cp > 1:
        args.append(("overlap-grad-reduce", None))
    if L.recompute == "selective":
        args.append(("recompute-granularity", "selective"))
        if wl.recompute_modules and wl.recompute_modules != ["core_attn"]:  # Megatron's default: core_attn
            args.append(("recompute-modules", Words(wl.recompute_modules)))
    elif L.recompute == "full":
        args += [("recompute-granularity", "full"), ("recompute-method", "uniform"), ("recompute-num-layers", 1)]
    args += [("micro-batch-size", L.micro_batch_size), ("global-batch-size", wl.global_batch_size),
             ("seq-length", wl.seq_len)]
    if wl.param_dtype == "bf16":
        args.append(("bf16", None))
    elif wl.param_dtype == "fp16":
        args.append(("fp16", None))
    if wl.matmul_dtype == "fp8":
        args.append(("fp8-format", "hybrid"))  # E4M3 forward, E5M2 gradients, delayed scaling (Transformer Engine)
        recomputed = wl.recompute_modules if L.recompute == "selective" else []
        if megatron_fp8_recipe(recomputed) != "delayed":  # recomputed moe_act / layernorm need current scaling
            args.append(("fp8-recipe", megatron_fp8_recipe(recomputed)))
    if wl.grad_reduce_dtype == "bf16":  # bf16 gradient buffers (arguments.py: accumulate_allreduce_grads_in_fp32 off)
        args.append(("grad-reduce-in-bf16", None))
    if wl.moment_dtype == "bf16":  # Transformer Engine's FusedAdam (megatron/core/optimizer/optimizer_config.py)
        args += [("use-precision-aware-optimizer", None), ("exp-avg-dtype", "bf16"), ("exp-avg-sq-dtype", "bf16")]
    return args


def run_args(ctx: ExportContext) -> list[Arg]:
    """What a run needs beyond the plan: tokenizer, optimizer, iterations, checkpoints (editable)."""
    wl = training(ctx, TARGET)
    return [("tokenizer-type", "HuggingFaceTokenizer"), ("tokenizer-model", model_ref(ctx)),
            ("optimizer", _OPTIMIZER[wl.optimizer]), ("lr", "3e-4"), ("clip-grad", 1.0),
            ("train-iters", Raw("$TRAIN_ITERS")), ("save", Raw("$CHECKPOINT_DIR")), ("save-interval", 500), ("load", Raw("$CHECKPOINT_DIR")),
            ("log-interval", 10)]


def pretrain_command(ctx: ExportContext) -> str:
    """torchrun (standalone on one node, c10d rendezvous over several) then pretrain_gpt.py's flags."""
    launcher: list[Arg] = script_launcher_args(ctx)
    if ctx.options.script is None:
        program: list[str] = [Raw("$MEGATRON_LM/pretrain_gpt.py")]
    else:
        program = script_words(ctx, "pretrain_gpt.py")
        if not program[0].endswith(".py"):
            launcher.append(("no-python", None))
    table = flag_table(FLAGS)
    megatron_args = [*parallel_args(ctx), *model_args(ctx.spec), *run_args(ctx)]  # type: ignore[arg-type]
    return (command(None, ["torchrun"], launcher) + " \\\n    "
            + command(table, program, megatron_args, tail=[Raw("${DATA[@]}")]))


def export_megatron(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    _expressible(ctx)
    table = flag_table(FLAGS)
    header = [*plan_header(m, TARGET, table),
              f"MEGATRON_LM: a Megatron-LM checkout at core_v{table.version} (pip install its requirements and "
              "transformer_engine); DATA_PATH: an indexed dataset prefix (tools/preprocess_data.py), empty: --mock-data"]
    if m.hardware.num_nodes > 1:
        header += [f"run on each of the {m.hardware.num_nodes} nodes with HEAD_ADDR set to node 0's address:",
                   "  HEAD_ADDR=10.0.0.1 bash pretrain.sh"]
    else:
        header.append("run: bash pretrain.sh")
    body = ['MEGATRON_LM="${MEGATRON_LM:-/opt/Megatron-LM}"', 'DATA_PATH="${DATA_PATH:-}"',
            'TRAIN_ITERS="${TRAIN_ITERS:-1000}"', 'CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints}"']
    if m.layout.tp > 1 or m.layout.cp > 1:  # validate_args asserts it below Blackwell (get_device_arch_version() < 10)
        body.append("export CUDA_DEVICE_MAX_CONNECTIONS=1  # tensor/context parallel kernels issue in order")
    if m.hardware.num_nodes > 1:
        body += script_rdzv_lines(ctx)
    body += ['if [ -n "$DATA_PATH" ]; then DATA=(--data-path "$DATA_PATH" --split 99,1,0); else DATA=(--mock-data); fi',
             "", pretrain_command(ctx)]
    return [ExportFile("pretrain.sh", script(body, header=header), executable=True)]
