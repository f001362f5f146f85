"""A DeepSpeed `ds_config.json` and its launch line.

What DeepSpeed's config can say, and so what this target accepts (DeepSpeed 0.19, the version
the tests parse the config with):
- ZeRO stages 0-3 (`zero_optimization.stage`); optimizer offload to CPU or NVMe (stages 1-3),
  parameter offload (stage 3 only) (docs: deepspeed.ai/docs/config-json/#zero-optimizations);
- tensor parallelism through AutoTP training (`tensor_parallel.autotp_size`), without Megatron
  sequence parallelism;
- pipeline parallelism through `deepspeed.pipe.PipelineModule` (its own 1F1B schedule, one
  model chunk per stage), which works with ZeRO stage 0 or 1 only.
Context parallelism, hybrid (within-node) sharding, interleaved or GPipe schedules and Megatron
sequence parallelism are not expressible here: export those plans --to torchrun.
"""

from __future__ import annotations

import json
from typing import Any

from shardplan.exporters.base import (
    Arg,
    ExportContext,
    ExportFile,
    Raw,
    cannot,
    command,
    finetune_files,
    gpus_per_node_used,
    plan_header,
    script,
    script_words,
    training,
)
from shardplan.exporters.torchrun import RDZV_PORT

TARGET = "deepspeed"
_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


def ds_config(ctx: ExportContext) -> dict[str, Any]:
    m = ctx.manifest
    wl = training(ctx, TARGET)
    L = m.layout
    _expressible(ctx)
    mbs = L.micro_batch_size
    accum, rest = divmod(wl.global_batch_size, mbs * L.dp)
    if rest:  # the manifest's own checks make this impossible; keep DeepSpeed's invariant visible
        raise cannot(TARGET, "workload.global_batch_size", f"{wl.global_batch_size} sequences are not a multiple of "
                     f"micro_batch_size x dp = {mbs * L.dp}", "re-plan with a divisible --global-batch-size")
    zero: dict[str, Any] = {"stage": L.zero_stage}
    if L.zero_stage > 0:
        zero |= {"overlap_comm": wl.overlap_grad_reduce, "contiguous_gradients": True}
    if L.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(L.offload_optimizer, ctx)
    if L.offload_params != "none":
        zero["offload_param"] = _offload(L.offload_params, ctx)
    cfg: dict[str, Any] = {
        "train_batch_size": wl.global_batch_size,
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if wl.param_dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif wl.param_dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if wl.optimizer in _OPTIMIZER:  # its states are what the plan's memory counted
        cfg["optimizer"] = {"type": _OPTIMIZER[wl.optimizer], "params": {"lr": 3e-4}}
    if L.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": L.tp}
    if L.recompute == "full":
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return cfg


def _offload(where: str, ctx: ExportContext) -> dict[str, Any]:
    if where == "cpu":
        return {"device": "cpu", "pin_memory": True}
    return {"device": "nvme", "nvme_path": ctx.options.nvme_path, "pin_memory": True}


def _expressible(ctx: ExportContext) -> None:
    L = ctx.manifest.layout
    torchrun = "export it --to torchrun (Megatron-style frameworks take these layouts)"
    if L.cp > 1:
        raise cannot(TARGET, "layout.cp", f"context parallelism (cp={L.cp}) has no ds_config setting", torchrun)
    if L.hybrid_shard:
        raise cannot(TARGET, "layout.hybrid_shard", "within-node (hybrid) sharding: DeepSpeed removed MiCS in 0.19",
                     "re-plan with --no-hybrid-shard, or export --to accelerate (FSDP HYBRID_SHARD)")
    if L.sequence_parallel:
        raise cannot(TARGET, "layout.sequence_parallel", "AutoTP has no Megatron sequence parallelism",
                     "re-plan with --no-sequence-parallel, or export --to torchrun")
    if L.offload_params != "none" and L.zero_stage != 3:
        raise cannot(TARGET, "layout.offload_params", f"parameter offload needs ZeRO stage 3 (plan: {L.zero_stage})",
                     "re-plan with --zero-stage 3")
    if L.offload_optimizer != "none" and L.zero_stage == 0:
        raise cannot(TARGET, "layout.offload_optimizer", "optimizer offload needs ZeRO stage 1-3", "re-plan with --zero-stage 1")
    if L.pp > 1:
        if L.zero_stage > 1:
            raise cannot(TARGET, "layout.zero_stage", f"DeepSpeed's pipeline engine works with ZeRO 0-1, not {L.zero_stage}",
                         "re-plan with --zero-stage 1")
        if L.virtual_stages > 1 or L.pp_schedule != "1f1b":
            raise cannot(TARGET, "layout.pp_schedule", f"DeepSpeed pipelines run 1F1B with one chunk per stage "
                         f"(plan: {L.pp_schedule}, {L.virtual_stages} virtual stages)",
                         "re-plan with --pp-schedule 1f1b --virtual-stages 1, or export --to torchrun")
        if L.tp > 1:
            raise cannot(TARGET, "layout.tp", "AutoTP does not combine with the pipeline engine", torchrun)
    if L.ep > 1:
        raise cannot(TARGET, "layout.ep", "expert parallelism is set in model code (deepspeed.moe.layer.MoE(ep_size=...)), "
                     "not in ds_config", torchrun)


def launch_command(ctx: ExportContext) -> str:
    """The `deepspeed` launcher line: one node runs locally; several read a hostfile."""
    m = ctx.manifest
    n, g = m.hardware.num_nodes, gpus_per_node_used(m)
    args: list[Arg] = [("num_nodes", n), ("num_gpus", g)]
    if n > 1:
        args = [("hostfile", "hostfile"), *args, ("master_addr", Raw("$HEAD_ADDR")),
                ("master_port", ctx.options.port or RDZV_PORT)]
    user = script_words(ctx, "train.py")
    return command(None, ["deepspeed"], args, tail=[*user, "--deepspeed", "--deepspeed_config", "ds_config.json"])


def export_deepspeed(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    cfg = ds_config(ctx)
    L = m.layout
    header = plan_header(m, TARGET)
    notes = []
    if L.pp > 1:
        notes.append(f"wrap the model in deepspeed.pipe.PipelineModule(num_stages={L.pp}) with layers split as in "
                     "the plan's placement.stages")
    if L.recompute != "none":
        notes.append(f"the plan assumes {L.recompute} activation recomputation: enable it in the model "
                     "(e.g. model.gradient_checkpointing_enable())")
    if L.offload_optimizer == "nvme" or L.offload_params == "nvme":
        notes.append(f"NVMe offload writes under {ctx.options.nvme_path}: point nvme_path at a local NVMe mount")
    if ctx.options.script is None:
        notes.append("train.py stands for your training script: it must call deepspeed.initialize and accept "
                     "--deepspeed_config (deepspeed.add_config_arguments)")
    ft_files, ft_notes = finetune_files(training(ctx, TARGET))
    notes += ft_notes
    body = []
    if m.hardware.num_nodes > 1:
        body += ['HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of the first host in ./hostfile}"', ""]
    body.append(launch_command(ctx))
    files = [
        ExportFile("ds_config.json", json.dumps(cfg, indent=2) + "\n"),
        ExportFile("launch.sh", script(body, header=[*header, *notes]), executable=True),
        *ft_files,
    ]
    if m.hardware.num_nodes > 1:
        hosts = "".join(f"node{i} slots={gpus_per_node_used(m)}\n" for i in range(m.hardware.num_nodes))
        files.append(ExportFile("hostfile", f"# one line per node: replace node<i> with its hostname\n{hosts}"))
    return files
