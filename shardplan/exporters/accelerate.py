"""Hugging Face accelerate: a `device_map` for big-model inference, or an FSDP config for
`accelerate launch`.

- Serving plans (one node, no tensor parallelism): `device_map.json` maps each module of the
  Hugging Face model to the GPU of its pipeline stage (accelerate runs the stages one after
  another, as a pipeline without overlap), or to "cpu"/"disk" when the plan offloads parameters;
  `load_checkpoint_and_dispatch(model, ckpt, device_map=..., no_split_module_classes=[...])`
  takes it. Module names follow transformers' class for the spec's `model_type`.
  Offloaded serving plans (`layout.offload_layers` = k): GPU 0 holds the embedding, the first
  num_layers - k decoder layers, the final norm and lm_head; the last k layers are "cpu" or "disk".
  That is the split accelerate's own `infer_auto_device_map` makes for the decoder layers (it fills
  GPU 0 in module order, then cpu, then disk: accelerate/utils/modeling.py); the head stays on the
  GPU as the plan counts it (an "auto" map would put it on the offload device too, being last in
  module order). `device_map.json` then also carries `max_memory` and `offload_folder`.
  A plan that quantizes with bitsandbytes (int8: LLM.int8, nf4: 4-bit NormalFloat) or offloads
  also gets `load.py` (transformers `from_pretrained` with all of it) and, for bitsandbytes,
  `quantization_config.json`: `BitsAndBytesConfig(...).to_dict()` as transformers 5.24.0 writes it.
- Training plans: `accelerate_fsdp.yaml` (FSDP2, `fsdp_reshard_after_forward` from the ZeRO
  stage, CPU offload, and accelerate's `parallelism_config` for tp/cp/hybrid sharding; plain
  data parallelism for ZeRO 0) and the launch line per node.
"""

from __future__ import annotations

import json
import math
from string import Template
from typing import Any

import yaml

from shardplan.cost.params import block_weights, layer_kind
from shardplan.cost.weights import bytes_per_weight_element
from shardplan.cost.workload import Quantization
from shardplan.exporters.base import (
    GIB,
    Arg,
    ExportContext,
    ExportFile,
    Raw,
    cannot,
    command,
    comment,
    finetune_files,
    gpus_per_node_used,
    model_ref,
    plan_header,
    script,
    script_words,
    serving,
    torch_dtype,
    training,
)
from shardplan.exporters.targets import check
from shardplan.knowledge import model_support
from shardplan.exporters.torchrun import RDZV_PORT
from shardplan.specs.model import ModelSpec
from shardplan.units import parse_dtype

TARGET = "accelerate"

HF_MODULES = model_support.HF_MODULES  # model_type -> (embedding modules, block i's name, modules after, block class)
_PLACE = {"cpu": "cpu", "nvme": "disk"}

# Weight formats transformers quantizes a 16-bit checkpoint into at load time (bitsandbytes);
# the other non-GGUF formats come as pre-quantized checkpoints whose config.json names the method.
BNB_FORMATS = ("int8", "nf4")
PREQUANTIZED_FORMATS = ("fp8", "int4", "awq", "gptq")
# max_memory is the plan's bytes plus this share: the must-hold tolerance of the plan's weight bytes
# (a plan within 5% of what accelerate measures never has a planned module refused by the cap).
MAX_MEMORY_MARGIN = 0.05
# transformers' bitsandbytes quantizers shrink every max_memory entry to 90% for quantization buffers
# when they infer a map (quantizers/quantizer_bnb_8bit.py and quantizer_bnb_4bit.py, adjust_max_memory,
# at 5.24.0): the export divides by it, so that an inferred map gets the room the plan counts.
BNB_MAX_MEMORY_FACTOR = 0.90
DEFAULT_OFFLOAD_FOLDER = "offload"  # relative to the directory load.py runs in


def _hf_modules(ctx: ExportContext) -> tuple[list[str], str, list[str], str]:
    if ctx.spec is None:
        raise cannot(TARGET, "model.source", "the plan's model spec could not be read back, and the device map "
                     "names its modules", "run the export where the spec file the plan names exists")
    return hf_modules(ctx.spec)


def hf_modules(spec: ModelSpec) -> tuple[list[str], str, list[str], str]:
    """transformers' module names for the spec's model_type; a type without them is refused."""
    refused = model_support.accelerate(spec)
    if refused is not None:
        raise cannot(TARGET, refused.field, refused.says, refused.hint)
    return HF_MODULES[spec.model_type]


def offloaded_layers(ctx: ExportContext) -> tuple[int, ...]:
    """The decoder layers accelerate keeps off the GPU: the last `layout.offload_layers` (GPU 0 is
    filled first, in module order); every layer when a plan offloads parameters without saying how
    many (`offload_layers` 0: plans written before the field existed)."""
    L, n = ctx.manifest.layout, ctx.manifest.model.num_layers
    if L.offload_params == "none":
        return ()
    check(ctx, TARGET)  # offloaded layers with pipeline stages (knowledge/targets.yaml)
    return tuple(range(n - L.offload_layers if L.offload_layers else 0, n))


def device_map(ctx: ExportContext) -> tuple[dict[str, int | str], list[str]]:
    """Module name -> GPU index (the stage's), "cpu" or "disk"; and no_split_module_classes."""
    m = ctx.manifest
    serving(ctx, TARGET)
    check(ctx, TARGET)  # tp, several nodes, offload with stages, GGUF (knowledge/targets.yaml)
    L = m.layout
    first, block, last, cls = _hf_modules(ctx)
    off = set(offloaded_layers(ctx))
    out: dict[str, int | str] = {name: 0 for name in first}
    for st in m.placement.stages:
        for lo, hi in st.layer_ranges:
            for i in range(lo, hi + 1):  # replica 0 holds GPUs 0..pp-1
                out[block.format(i=i)] = _PLACE[L.offload_params] if i in off else st.stage
    out |= {name: L.pp - 1 for name in last}
    return out, [cls]


def quantization_config(ctx: ExportContext) -> dict[str, Any] | None:
    """transformers' `BitsAndBytesConfig(...).to_dict()` for a plan transformers quantizes at load
    (int8: LLM.int8, int8 weights and an fp32 scale per output row; nf4: 4-bit NormalFloat with an
    fp32 absmax per 64 weights, no double quantization, as shardplan counts it, computing in the
    plan's activation dtype); None for a 16-bit or pre-quantized plan; GGUF refused. With offload,
    `llm_int8_enable_fp32_cpu_offload`: transformers refuses bitsandbytes modules on cpu/disk
    without it (quantizers/quantizer_bnb_8bit.py validate_environment, 5.24.0), and with it leaves
    the offloaded modules unquantized, in the load dtype (`_process_model_before_weight_loading`:
    modules_to_not_convert += the map's cpu and disk keys)."""
    wl = serving(ctx, TARGET)
    check(ctx, TARGET)  # GGUF mixtures (knowledge/targets.yaml)
    q = wl.quantization
    if q not in BNB_FORMATS:
        return None
    four = q == "nf4"
    return {  # the keys and defaults of BitsAndBytesConfig.to_dict() (transformers 5.24.0), in its order
        "quant_method": "bitsandbytes", "_load_in_8bit": not four, "_load_in_4bit": four,
        "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None,
        "llm_int8_enable_fp32_cpu_offload": bool(offloaded_layers(ctx)), "llm_int8_has_fp16_weight": False,
        "bnb_4bit_quant_type": "nf4" if four else "fp4", "bnb_4bit_use_double_quant": False,
        "bnb_4bit_compute_dtype": torch_dtype(wl.activation_dtype) if four else "float32",
        "bnb_4bit_quant_storage": "uint8", "load_in_4bit": four, "load_in_8bit": not four,
    }


def layer_bytes_held(ctx: ExportContext, layer: int) -> float:
    """Bytes of decoder layer `layer` as accelerate keeps it off the GPU: in the plan's format, but
    16-bit (the activation dtype) under bitsandbytes, which leaves offloaded modules unquantized."""
    wl = serving(ctx, TARGET)
    spec = ctx.spec
    assert spec is not None  # _hf_modules refused the plan otherwise
    q = Quantization.NONE if wl.quantization in BNB_FORMATS else Quantization(wl.quantization)
    dense = parse_dtype(wl.activation_dtype)
    return sum(w.numel * bytes_per_weight_element(w, q, dense, spec, (layer,))
               for w in block_weights(spec, *layer_kind(spec, layer)))


def gib_text(nbytes: float) -> str:
    """A max_memory entry in GiB (2^30 bytes, accelerate's `convert_file_size_to_int` reads "GiB"
    that way), rounded up to 0.001 GiB."""
    return f"{math.ceil(nbytes / GIB * 1000) / 1000:.3f}GiB"


def max_memory(ctx: ExportContext) -> dict[str, str]:
    """accelerate's max_memory for an offloaded plan: GPU 0 gets the plan's weights per GPU (the
    one offloaded layer in flight included, accelerate's own reserve on its main device) and the
    host the offloaded bytes (cpu), or the largest disk layer, which passes through host memory on
    its way to the GPU (nvme: accelerate's rule for disk offload), each plus MAX_MEMORY_MARGIN;
    under bitsandbytes divided by BNB_MAX_MEMORY_FACTOR, and the host's bytes counted 16-bit."""
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    layers = offloaded_layers(ctx)
    stage = m.predicted.memory.stages[0]
    factor = (1 + MAX_MEMORY_MARGIN) / (BNB_MAX_MEMORY_FACTOR if wl.quantization in BNB_FORMATS else 1.0)
    held = [layer_bytes_held(ctx, i) for i in layers]
    if m.layout.offload_params == "cpu":
        host = sum(held) if wl.quantization in BNB_FORMATS else stage.host_offload_bytes
    else:
        host = max(held)
    return {"0": gib_text(stage.per_gpu_bytes["weights"] * factor), "cpu": gib_text(host * factor)}


def export_accelerate(ctx: ExportContext) -> list[ExportFile]:
    if ctx.manifest.workload.kind == "inference":
        return _export_device_map(ctx)
    return _export_fsdp(ctx)


def _export_device_map(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    dmap, no_split = device_map(ctx)
    qcfg = quantization_config(ctx)
    doc: dict[str, Any] = {"device_map": dmap, "no_split_module_classes": no_split}
    planned_offload = m.layout.offload_layers > 0 and bool(offloaded_layers(ctx))
    if planned_offload:
        doc["max_memory"] = max_memory(ctx)
        if "disk" in dmap.values():
            doc["offload_folder"] = DEFAULT_OFFLOAD_FOLDER
    disk = ", offload_folder='offload', offload_state_dict=True" if "disk" in dmap.values() else ""
    dispatch = ("model = accelerate.load_checkpoint_and_dispatch(model, CHECKPOINT, device_map=d['device_map'], "
                "no_split_module_classes=d['no_split_module_classes']" + disk + ")")
    if qcfg is not None:  # accelerate alone does not quantize: transformers does, at load
        notes = ["load with: python load.py --model CHECKPOINT (transformers from_pretrained with the device_map, "
                 "max_memory, offload_folder and quantization_config; or load.load(...) from Python)"]
    elif planned_offload:
        notes = ["load with: python load.py --model CHECKPOINT (transformers from_pretrained with the device_map, "
                 f"max_memory and offload_folder), or {dispatch}"]
    else:
        notes = [f"load with: {dispatch}"]
    notes += _offload_notes(ctx, dmap) if planned_offload else []
    notes += _quantization_notes(ctx, qcfg)
    if m.layout.dp > 1:
        notes.append(f"this is one replica on GPUs 0..{m.layout.pp - 1}; the plan runs {m.layout.dp}: start each "
                     f"with CUDA_VISIBLE_DEVICES set to its {m.layout.pp} GPUs")
    out = [ExportFile("device_map.json", json.dumps(doc, indent=2) + "\n")]
    if qcfg is not None:
        out.append(ExportFile("quantization_config.json", json.dumps(qcfg, indent=2) + "\n"))
    if qcfg is not None or planned_offload:
        out.append(ExportFile("load.py", load_script(ctx, doc, qcfg, wl.activation_dtype)))
    return [*out, ExportFile("README.txt", "\n".join([*plan_header(m, TARGET), *notes]) + "\n")]


def _offload_notes(ctx: ExportContext, dmap: dict[str, int | str]) -> list[str]:
    m = ctx.manifest
    layers = offloaded_layers(ctx)
    where = "in host RAM" if m.layout.offload_params == "cpu" else "on disk (offload_folder)"
    mm = max_memory(ctx)
    out = [f"offload: decoder layers {layers[0]}..{layers[-1]} (the last {len(layers)}) live {where}; "
           "accelerate copies each offloaded module's weights to GPU 0 for its forward and drops them after "
           "(accelerate/hooks.py AlignDevicesHook), so every forward pass moves them over the host link",
           f"max_memory {mm}: the plan's weights per GPU (one offloaded layer in flight included) and the host's "
           f"share, plus {MAX_MEMORY_MARGIN:.0%}, the tolerance the plan's bytes are held to. from_pretrained reads "
           "it only with device_map='auto', which fills GPU 0 in module order and would also move the final norm "
           "and lm_head off the GPU: pass the exported device_map, as load.py does"]
    if "disk" in dmap.values():
        out.append(f"offload_folder '{DEFAULT_OFFLOAD_FOLDER}' (relative to where load.py runs; "
                   "`python load.py --offload-folder DIR` for a local NVMe): accelerate's load_checkpoint_and_dispatch "
                   "writes the disk layers there (offload_state_dict=True keeps the CPU copy out of RAM while it does); "
                   "transformers >= 5 reads a safetensors checkpoint's disk layers in place and writes into the folder "
                   "only weights it converts at load (other formats, most MoE models: "
                   "integrations/accelerate.py accelerate_disk_offload)")
    wl = m.workload
    if getattr(wl, "offload_gpu_layers", "first") != "first":
        out.append(f"the plan was sized for {wl.engine}, which offloads the first layers; accelerate offloads the "
                   "last ones (the same bytes for a model whose layers are alike)")
    return out


def _quantization_notes(ctx: ExportContext, qcfg: dict[str, Any] | None) -> list[str]:
    q = serving(ctx, TARGET).quantization
    if q in PREQUANTIZED_FORMATS:
        return [f"{q} weights: load a pre-quantized {q} checkpoint (AWQ/GPTQ/compressed-tensors/FP8); its config.json "
                "carries its quantization_config, which transformers reads: none is exported"]
    if qcfg is None:
        return []
    kind = "LLM.int8 (int8 weights, an fp32 scale per output row)" if q == "int8" else "4-bit NF4"
    out = [f"{q}: transformers quantizes the 16-bit checkpoint at load with bitsandbytes {kind}: "
           "quantization_config=BitsAndBytesConfig.from_dict(quantization_config.json), as load.py does"]
    if qcfg["llm_int8_enable_fp32_cpu_offload"]:
        layers = offloaded_layers(ctx)
        planned = ctx.manifest.predicted.memory.stages[0]
        held = sum(layer_bytes_held(ctx, i) for i in layers)
        plan_off = planned.host_offload_bytes + planned.nvme_offload_bytes
        out.append(f"llm_int8_enable_fp32_cpu_offload: the {len(layers)} offloaded layers stay unquantized, in the "
                   f"load dtype ({held / GIB:.3f} GiB off the GPU, where the plan counts {plan_off / GIB:.3f} GiB "
                   f"{q}); only the GPU's modules are {q}")
    return out


def load_script(ctx: ExportContext, doc: dict[str, Any], qcfg: dict[str, Any] | None, dtype: str) -> str:
    """load.py: `AutoModelForCausalLM.from_pretrained` with the exported device_map, max_memory,
    offload_folder and quantization config. It checks the offload folder before it loads: a folder
    it cannot create or write into, or without room for the disk layers, is a one-line error, exit 2."""
    m = ctx.manifest
    disk_bytes = m.predicted.memory.stages[0].nvme_offload_bytes if "disk" in doc["device_map"].values() else 0.0
    bnb = qcfg is not None
    return _LOAD_PY.substitute(
        header="\n".join(f"# {comment(line)}" for line in plan_header(m, TARGET)),
        model=repr(model_ref(ctx)), dtype=repr(torch_dtype(dtype)), disk_bytes=int(disk_bytes),
        bnb_import=", BitsAndBytesConfig" if bnb else "",
        bnb_kwargs=('    cfg = json.loads((HERE / "quantization_config.json").read_text())\n'
                    '    kwargs["quantization_config"] = BitsAndBytesConfig.from_dict(cfg)\n') if bnb else "")


_LOAD_PY = Template('''$header
"""Load the model as the shardplan plan places it, with transformers and accelerate.

usage: python load.py [--model PATH_OR_ID] [--offload-folder DIR]
from Python: model = load.load(model=..., device_map=..., offload_folder=...)
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = $model
DTYPE = $dtype  # the plan's activation dtype: the checkpoint's 16-bit weights load in it
DISK_BYTES = $disk_bytes  # the plan's bytes on disk (0: no disk offload)


def fail(message):
    print(f"load.py: {message}", file=sys.stderr)
    sys.exit(2)


def exported():
    """device_map.json as accelerate takes it: GPU indices as ints."""
    doc = json.loads((HERE / "device_map.json").read_text())
    if "max_memory" in doc:
        doc["max_memory"] = {int(k) if k.isdigit() else k: v for k, v in doc["max_memory"].items()}
    return doc


def check_offload_folder(folder):
    """The folder the disk layers go to: created, writable and with room for them; else exit 2."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        fail(f"offload folder {str(path)!r} is not writable ({e.strerror or e}): pass --offload-folder DIR on a local disk")
    free = shutil.disk_usage(path).free
    if free < DISK_BYTES:
        fail(f"offload folder {str(path)!r} has {free / 2**30:.2f} GiB free and the disk layers need "
             f"{DISK_BYTES / 2**30:.2f} GiB: pass --offload-folder DIR with room")
    return str(path)


def load(model=MODEL, device_map=None, offload_folder=None):
    import torch
    from transformers import AutoModelForCausalLM$bnb_import

    doc = exported()
    kwargs = {"device_map": doc["device_map"] if device_map is None else device_map}
    if "max_memory" in doc:
        kwargs["max_memory"] = doc["max_memory"]
    if "disk" in kwargs["device_map"].values():
        kwargs["offload_folder"] = check_offload_folder(offload_folder or doc["offload_folder"])
$bnb_kwargs    return AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, DTYPE), **kwargs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Load the model as the shardplan plan places it.")
    parser.add_argument("--model", default=MODEL, help="checkpoint folder or Hugging Face id")
    parser.add_argument("--offload-folder", default=None, help="where the disk-offloaded layers go")
    args = parser.parse_args()
    if "disk" in exported()["device_map"].values():  # before minutes of loading
        args.offload_folder = check_offload_folder(args.offload_folder or exported()["offload_folder"])
    loaded = load(args.model, offload_folder=args.offload_folder)
    print(json.dumps({name: str(device) for name, device in loaded.hf_device_map.items()}, indent=2))
''')


def fsdp_config(ctx: ExportContext) -> dict[str, Any]:
    """An `accelerate launch --config_file` YAML (accelerate 1.x ClusterConfig keys)."""
    m = ctx.manifest
    wl = training(ctx, TARGET)
    L = m.layout
    check(ctx, TARGET)  # pp, ep, offload other than FSDP's, tp or cp without FSDP (knowledge/targets.yaml)
    _, _, _, cls = _hf_modules(ctx)
    n, g = m.hardware.num_nodes, gpus_per_node_used(m)
    mixed = {"bf16": "bf16", "fp16": "fp16"}.get(wl.param_dtype, "no")
    if wl.master_dtype == "bf16":  # pure bf16: the script loads the model in bf16 and trains it without AMP
        mixed = "no"
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
