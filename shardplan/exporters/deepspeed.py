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

NVMe offload (ZeRO-Infinity) is sized from DeepSpeed 0.19's own code, not left at its defaults:
- `offload_param.buffer_size` (elements): each parameter partition swapped from NVMe lands in one
  pinned buffer, and `AsyncPartitionedParameterSwapper.get_buffer` asserts
  `numel <= self.elements_per_buffer` ("More elements ... than buffer size";
  deepspeed/runtime/swap_tensor/partitioned_param_swapper.py), where numel is the partition
  `_aligned_size(param) // _partition_world_size(param)` (deepspeed/runtime/zero/
  partition_parameters.py, `_partition_param`): the tensor padded to a multiple of the ZeRO-3
  group, split over it. The default 1e8 (deepspeed/runtime/zero/offload_config.py) is too small
  for e.g. a 70B model's 128256 x 8192 = 1.05e9-element embedding over 8 ranks (1.31e8 each).
- `offload_param.buffer_count`: one buffer per partition in use or in flight; `swap_in` asserts a
  module's partitions fit the free buffers ("Not enough buffers"), and the NVMe prefetcher takes
  only free ones. A Hugging Face decoder's leaf modules hold one or two swappable tensors
  (weight, bias), so DeepSpeed's default 5 covers them; it is written out so the pinned-memory
  cost (buffer_count x buffer_size x parameter bytes per rank) is visible beside it.
- `offload_optimizer.buffer_count`: "at least the number of states maintained per parameter by
  the optimizer" (offload_config.py); PartitionedOptimizerSwapper takes num_tensors() + 1 with
  gradients: fp32 parameter + exp_avg + exp_avg_sq + gradient = 4 for Adam(W), 3 for SGD.
- the `aio` block: the keys `get_aio_config` reads (deepspeed/runtime/swap_tensor/aio_config.py,
  defaults in swap_tensor/constants.py): block_size, queue_depth, intra_op_parallelism (formerly
  thread_count, a name 0.19 no longer reads), single_submit, overlap_events,
  use_gds. We write DeepSpeed's defaults, which its docs suggest tuning per drive with
  `ds_nvme_tune`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from shardplan.exporters.base import (
    GIB,
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
from shardplan.exporters.targets import check
from shardplan.exporters.torchrun import RDZV_PORT
from shardplan.cost.params import block_weights, embedding_weights, head_weights, layer_kinds, vision_weights
from shardplan.specs.model import ModelSpec
from shardplan.units import bytes_per_element, parse_dtype

TARGET = "deepspeed"
_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
# DeepSpeed 0.19, deepspeed/runtime/zero/offload_config.py: DeepSpeedZeroOffloadParamConfig defaults.
PARAM_BUFFER_SIZE_DEFAULT = 100_000_000  # elements
PARAM_BUFFER_COUNT = 5
# Tensors the optimizer swapper holds per parameter: num_tensors() + 1 for the gradient
# (deepspeed/runtime/swap_tensor/partitioned_optimizer_swapper.py); fp32 master + states + gradient.
OPTIMIZER_SWAP_TENSORS = {"adamw": 4, "adam": 4, "sgd": 3}
# deepspeed/runtime/swap_tensor/constants.py (AIO_*_DEFAULT), the keys aio_config.get_aio_config reads.
AIO = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True, "use_gds": False}


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
        if wl.zero_reduce_bucket_elements:  # the bucket the plan's memory counted (temporary.zero_reduce_buckets)
            zero["reduce_bucket_size"] = wl.zero_reduce_bucket_elements
    if L.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(L.offload_optimizer, ctx)
        if L.offload_optimizer == "nvme":
            zero["offload_optimizer"]["buffer_count"] = OPTIMIZER_SWAP_TENSORS.get(wl.optimizer, 4)
    if L.offload_params != "none":
        zero["offload_param"] = _offload(L.offload_params, ctx)
        if L.offload_params == "nvme":
            zero["offload_param"] |= {"buffer_count": PARAM_BUFFER_COUNT, "buffer_size": param_buffer_size(ctx)}
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
        # DeepSpeed PR #7700: the master weights with the gradient partition, and Adam's moments, in bf16
        if wl.master_dtype == "bf16":
            cfg["bf16"]["bf16_master_weights_and_grads"] = True
        if wl.moment_dtype == "bf16":
            cfg["bf16"]["bf16_optimizer_states"] = True
    elif wl.param_dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if wl.optimizer in _OPTIMIZER:  # its states are what the plan's memory counted
        cfg["optimizer"] = {"type": _OPTIMIZER[wl.optimizer], "params": {"lr": 3e-4}}
    if L.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": L.tp}
    if L.recompute == "full":
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    if "nvme" in (L.offload_optimizer, L.offload_params):
        cfg["aio"] = dict(AIO)
    return cfg


def largest_tensor_numel(spec: ModelSpec) -> int:
    """Elements of the model's largest stored tensor. Routed experts count as one fused tensor
    of every expert's gate and up projections (transformers 5 stores them so: e.g.
    MixtralExperts.gate_up_proj is num_experts x 2 x intermediate x hidden)."""
    kinds = [*embedding_weights(spec), *head_weights(spec), *vision_weights(spec)]
    for moe, linear in layer_kinds(spec):
        kinds += block_weights(spec, moe, linear)
    return max(w.numel_per_copy * (2 * w.copies if w.routed_expert else 1) for w in kinds)


def param_buffer_size(ctx: ExportContext) -> int:
    """offload_param.buffer_size: at least the largest ZeRO-3 partition DeepSpeed swaps, i.e. the
    largest tensor padded to a multiple of dp and split dp ways (partition_parameters.py
    `_partition_param`; the assert in partitioned_param_swapper.py `get_buffer`), and never
    below DeepSpeed's default. The tensor is counted whole (before any tensor-parallel split),
    so the bound holds with AutoTP too."""
    if ctx.spec is None:
        raise cannot(TARGET, "model.source", "NVMe parameter offload needs the largest tensor's size to set "
                     "offload_param.buffer_size, and the plan's model spec could not be read back",
                     "export where the plan's model spec (model.source) can be read")
    dp = ctx.manifest.layout.dp
    return max(PARAM_BUFFER_SIZE_DEFAULT, math.ceil(largest_tensor_numel(ctx.spec) / dp))


def _offload(where: str, ctx: ExportContext) -> dict[str, Any]:
    if where == "cpu":
        return {"device": "cpu", "pin_memory": True}
    return {"device": "nvme", "nvme_path": ctx.options.nvme_path, "pin_memory": True}


def _expressible(ctx: ExportContext) -> None:
    """No context or expert parallelism, hybrid sharding or sequence parallelism; offload and the
    pipeline engine only with the ZeRO stages they take (knowledge/targets.yaml)."""
    check(ctx, TARGET)


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
    if L.zero_stage > 0 and not training(ctx, TARGET).zero_reduce_bucket_elements:
        notes.append("the plan did not count DeepSpeed's contiguous gradient bucket (reduce_bucket_size, 5e8 elements "
                     "by default: 0.93 GiB in bf16 per rank, twice at stages 1-2 with overlap_comm): plan with "
                     "--stack deepspeed to count it, or lower reduce_bucket_size in ds_config.json")
    if L.offload_optimizer == "nvme" or L.offload_params == "nvme":
        notes.append(f"NVMe offload writes under {ctx.options.nvme_path}: point nvme_path at a local NVMe mount; "
                     "the aio block holds DeepSpeed's defaults: tune it per drive with ds_nvme_tune")
    if L.offload_params == "nvme":
        size = cfg["zero_optimization"]["offload_param"]["buffer_size"]
        pinned = PARAM_BUFFER_COUNT * size * bytes_per_element(parse_dtype(training(ctx, TARGET).param_dtype))
        notes.append(f"offload_param.buffer_size {size:,} elements: the largest parameter partition "
                     f"(largest tensor / dp={L.dp}); its {PARAM_BUFFER_COUNT} buffers pin "
                     f"{pinned / GIB:.2f} GiB of host memory per rank")
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
