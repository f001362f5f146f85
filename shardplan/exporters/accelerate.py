"""Hugging Face accelerate: a `device_map` for big-model inference, or an FSDP config for
`accelerate launch`.

- Serving plans (one node, no tensor parallelism): `device_map.json` maps each module of the
  Hugging Face model to the GPU of its pipeline stage (accelerate runs the stages one after
  another, as a pipeline without overlap), or to "cpu"/"disk" when the plan offloads parameters;
  `load_checkpoint_and_dispatch(model, ckpt, device_map=..., no_split_module_classes=[...])`
  takes it. Module names follow transformers' class for the spec's `model_type`.
- Training plans: `accelerate_fsdp.yaml` (FSDP2, `fsdp_reshard_after_forward` from the ZeRO
  stage, CPU offload, and accelerate's `parallelism_config` for tp/cp/hybrid sharding; plain
  data parallelism for ZeRO 0) and the launch line per node.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

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
    serving,
    training,
)
from shardplan.exporters.torchrun import RDZV_PORT

TARGET = "accelerate"

# model_type -> (embedding modules, "<prefix>.{i}" of block i, modules after the blocks, block class)
# (transformers' modeling_<type>.py: the submodule names of <Type>ForCausalLM)
_LLAMA_LIKE = (["model.embed_tokens", "model.rotary_emb"], "model.layers.{i}", ["model.norm", "lm_head"])
HF_MODULES: dict[str, tuple[list[str], str, list[str], str]] = {
    "llama": (*_LLAMA_LIKE, "LlamaDecoderLayer"),
    "mistral": (*_LLAMA_LIKE, "MistralDecoderLayer"),
    "mixtral": (*_LLAMA_LIKE, "MixtralDecoderLayer"),
    "qwen2": (*_LLAMA_LIKE, "Qwen2DecoderLayer"),
    "qwen2_moe": (*_LLAMA_LIKE, "Qwen2MoeDecoderLayer"),
    "qwen3": (*_LLAMA_LIKE, "Qwen3DecoderLayer"),
    "qwen3_moe": (*_LLAMA_LIKE, "Qwen3MoeDecoderLayer"),
    "gemma": (*_LLAMA_LIKE, "GemmaDecoderLayer"),
    "gemma2": (*_LLAMA_LIKE, "Gemma2DecoderLayer"),
    "deepseek_v3": (*_LLAMA_LIKE, "DeepseekV3DecoderLayer"),
    "phi3": (*_LLAMA_LIKE, "Phi3DecoderLayer"),
    "gpt_neox": (["gpt_neox.embed_in", "gpt_neox.rotary_emb"], "gpt_neox.layers.{i}",
                 ["gpt_neox.final_layer_norm", "embed_out"], "GPTNeoXLayer"),
    "gpt2": (["transformer.wte", "transformer.wpe"], "transformer.h.{i}", ["transformer.ln_f", "lm_head"], "GPT2Block"),
    "falcon": (["transformer.word_embeddings", "transformer.rotary_emb"], "transformer.h.{i}",
               ["transformer.ln_f", "lm_head"], "FalconDecoderLayer"),
}
_PLACE = {"cpu": "cpu", "nvme": "disk"}


def _hf_modules(ctx: ExportContext) -> tuple[list[str], str, list[str], str]:
    spec = ctx.spec
    if spec is None:
        raise cannot(TARGET, "model.source", "the plan's model spec could not be read back, and the device map "
                     "names its modules", "run the export where the spec file the plan names exists")
    names = HF_MODULES.get(spec.model_type)
    if names is None:
        raise cannot(TARGET, "model.source", f"no transformers module names known for model_type "
                     f"'{spec.model_type}'", f"use a model of type {', '.join(sorted(HF_MODULES))}")
    return names


def device_map(ctx: ExportContext) -> tuple[dict[str, int | str], list[str]]:
    """Module name -> GPU index (the stage's), "cpu" or "disk"; and no_split_module_classes."""
    m = ctx.manifest
    serving(ctx, TARGET)
    L = m.layout
    if L.tp > 1:
        raise cannot(TARGET, "layout.tp", f"a device_map places whole modules, so tensor parallelism (tp={L.tp}) "
                     "has no form in it", "re-plan with --tp 1, or export --to vllm")
    if m.hardware.num_nodes > 1:
        raise cannot(TARGET, "hardware.num_nodes", "big-model inference runs in one process on one node",
                     "re-plan on one node, or export --to vllm")
    first, block, last, cls = _hf_modules(ctx)
    blocks_at: Any = _PLACE.get(L.offload_params)
    out: dict[str, int | str] = {name: 0 for name in first}
    for st in m.placement.stages:
        for lo, hi in st.layer_ranges:
            for i in range(lo, hi + 1):
                out[block.format(i=i)] = blocks_at or st.stage  # replica 0 holds GPUs 0..pp-1
    out |= {name: L.pp - 1 for name in last}
    return out, [cls]


def export_accelerate(ctx: ExportContext) -> list[ExportFile]:
    if ctx.manifest.workload.kind == "inference":
        return _export_device_map(ctx)
    return _export_fsdp(ctx)


def _export_device_map(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    dmap, no_split = device_map(ctx)
    doc = {"device_map": dmap, "no_split_module_classes": no_split}
    notes = ["load with: model = accelerate.load_checkpoint_and_dispatch(model, CHECKPOINT, "
             "device_map=d['device_map'], no_split_module_classes=d['no_split_module_classes']"
             + (", offload_folder='offload')" if "disk" in dmap.values() else ")")]
    if m.layout.dp > 1:
        notes.append(f"this is one replica on GPUs 0..{m.layout.pp - 1}; the plan runs {m.layout.dp}: start each "
                     f"with CUDA_VISIBLE_DEVICES set to its {m.layout.pp} GPUs")
    return [ExportFile("device_map.json", json.dumps(doc, indent=2) + "\n"),
            ExportFile("README.txt", "\n".join([*plan_header(m, TARGET), *notes]) + "\n")]


def fsdp_config(ctx: ExportContext) -> dict[str, Any]:
    """An `accelerate launch --config_file` YAML (accelerate 1.x ClusterConfig keys)."""
    m = ctx.manifest
    wl = training(ctx, TARGET)
    L = m.layout
    if L.pp > 1:
        raise cannot(TARGET, "layout.pp", f"accelerate's FSDP has no pipeline stages (pp={L.pp})",
                     "re-plan with --pp 1, or export --to torchrun")
    if L.ep > 1:
        raise cannot(TARGET, "layout.ep", "accelerate's FSDP has no expert parallelism", "re-plan with --ep 1")
    if L.offload_optimizer != L.offload_params or L.offload_params == "nvme":
        raise cannot(TARGET, "layout.offload_optimizer", "FSDP offloads parameters, gradients and optimizer states "
                     "together and to CPU only", "re-plan with --offload all-cpu or none, or export --to deepspeed")
    _, _, _, cls = _hf_modules(ctx)
    n, g = m.hardware.num_nodes, gpus_per_node_used(m)
    mixed = {"bf16": "bf16", "fp16": "fp16"}.get(wl.param_dtype, "no")
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": mixed,
        "num_machines": n,
        "num_processes": m.hardware.num_gpus,
        "machine_rank": 0,
        "main_process_port": ctx.options.port or RDZV_PORT,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if L.zero_stage == 0:  # nothing sharded: plain data parallelism (DDP)
        if L.tp > 1 or L.cp > 1:
            raise cannot(TARGET, "layout.zero_stage", "accelerate runs tensor and context parallelism under FSDP, "
                         "and the plan shards nothing (ZeRO 0)", "re-plan with --zero-stage 2 or 3")
        cfg["distributed_type"] = "MULTI_GPU" if m.hardware.num_gpus > 1 else "NO"
    else:
        shard = L.dp if not L.hybrid_shard else max(1, g // (L.tp * L.cp))
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            # ZeRO-3 reshards the parameters after forward; ZeRO 1-2 keep them (FSDP2 has no
            # stage that shards optimizer states only: ZeRO-1 plans get ZeRO-2, which needs less memory)
            "fsdp_reshard_after_forward": L.zero_stage == 3,
            "fsdp_offload_params": L.offload_params == "cpu",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": cls,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": L.recompute == "full",
        }
        cfg["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": L.dp // shard,
            "parallelism_config_dp_shard_size": shard,
            "parallelism_config_tp_size": L.tp,
            "parallelism_config_cp_size": L.cp,
        }
    if n > 1:
        cfg["main_process_ip"] = "HEAD_ADDR"  # placeholder; the launch line passes the real one
    return cfg


def _export_fsdp(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    cfg = fsdp_config(ctx)
    L = m.layout
    n = m.hardware.num_nodes
    user = script_words(ctx, "train.py")
    args: list[Arg] = [("config_file", "accelerate_fsdp.yaml")]
    body: list[str] = []
    header = plan_header(m, TARGET)
    if n > 1:
        body += ['HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of node 0}"',
                 'NODE_RANK="${NODE_RANK:?set NODE_RANK to the index of this node, 0..' + str(n - 1) + '}"', ""]
        args += [("machine_rank", Raw("$NODE_RANK")), ("main_process_ip", Raw("$HEAD_ADDR"))]
        header.append(f"run on each of the {n} nodes: HEAD_ADDR=<node 0> NODE_RANK=<i> bash launch.sh")
    if L.sequence_parallel:
        header.append("the plan assumes sequence parallelism over the tp ranks (accelerate's tp plan applies it)")
    if L.recompute == "selective":
        header.append("the plan assumes selective recomputation (attention core); FSDP's activation "
                      "checkpointing is whole-layer, so enable selective recomputation in the model")
    if L.zero_stage == 1:
        header.append("ZeRO-1 becomes FSDP2 without resharding after forward (ZeRO-2 memory: no more than the plan's)")
    ft_files, ft_notes = finetune_files(training(ctx, TARGET))
    header += ft_notes
    body.append(command(None, ["accelerate", "launch"], args, tail=user))
    text = yaml.safe_dump(cfg, sort_keys=False)
    return [ExportFile("accelerate_fsdp.yaml", "\n".join(f"# {h}" for h in plan_header(m, TARGET)) + "\n" + text),
            ExportFile("launch.sh", script(body, header=header), executable=True), *ft_files]
