"""torchtitan: a job TOML (`train.toml`) and `run.sh`, torchrun per node starting
`python -m torchtitan.train --job.config_file train.toml`.

Pinned to torchtitan 0.2.2, the last release that reads job TOML files (0.3 moved to Python config
registries); every key written is checked against `flags/torchtitan-0.2.2.yaml`, the JobConfig
fields dumped by tools/torchtitan_keys.py. What the plan says, as torchtitan 0.2.2 reads it
(torchtitan/config/job_config.py, models/llama3/infra/parallelize.py, distributed/parallel_dims.py):
- dp with ZeRO-3: FSDP2, `data_parallel_shard_degree`; with hybrid sharding, the shard group is a
  node's data-parallel ranks and `data_parallel_replicate_degree` the rest (HSDP); dp with ZeRO-0:
  DDP (`data_parallel_replicate_degree`), which torchtitan runs only as the one parallelism;
  ZeRO-1/2 have no FSDP2 form and are refused;
- tp, pp, cp, ep, etp: the `*_degree` keys; torchtitan's tensor parallelism always shards the norms
  over the sequence (sequence parallelism), so a plan without it overestimates activation memory;
- the pipeline split: `module_fqns_per_model_part`, the plan's own chunks (embedding on the
  first, norm and output on the last), in torchtitan's looped stage order (chunk k of stage s is
  model part s + k x pp, as the plan places it); the schedule by torch's name (1F1B, GPipe,
  Interleaved1F1B; torch/distributed/pipelining/schedules.py `get_schedule_class`);
  `pipeline_parallel_microbatch_size` the plan's micro-batch, `local_batch_size` each data-parallel
  rank's share of the global batch;
- FSDP under pipeline parallelism: torchtitan keeps stage parameters unsharded between forward
  and backward ("default"); a plan that counts them resharded asks for "always";
- recompute: `[activation_checkpoint] mode` none/selective/full; selective is op-level
  (`selective_ac_option = "op"`, torchtitan's per-op policy that keeps matmul outputs);
- `[compile]` on when the plan counts fused norms/RoPE/SwiGLU; fp8 GEMMs: the float8 converter.
The model is torchtitan's own definition of the same shape (a pinned table of flavors); a model it
has none for is refused.
"""

from __future__ import annotations

import json
from typing import Any

from shardplan.exporters.base import (
    Arg,
    ExportContext,
    ExportFile,
    cannot,
    command,
    comment,
    flag_table,
    gpus_per_node_used,
    plan_header,
    script,
    script_words,
    training,
)
from shardplan.exporters.targets import check
from shardplan.knowledge import model_support
from shardplan.exporters.torchrun import script_launcher_args, script_rdzv_lines
from shardplan.specs.model import ModelSpec

TARGET = "torchtitan"
KEYS = "torchtitan-0.2.2"
FLAVORS = model_support.TORCHTITAN_FLAVORS  # (family, layers, hidden, heads, kv heads) -> (name, flavor)
SCHEDULES = {("1f1b", False): "1F1B", ("gpipe", False): "GPipe", ("interleaved", True): "Interleaved1F1B",
             ("1f1b", True): "Interleaved1F1B"}
_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam"}


def flavor(spec: ModelSpec | None) -> tuple[str, str]:
    if spec is None:
        raise cannot(TARGET, "model.source", "torchtitan picks its model by shape and the plan's model spec could "
                     "not be read back", "export where the plan's model spec (model.source) can be read")
    refused = model_support.torchtitan(spec)
    if refused is not None:
        raise cannot(TARGET, refused.field, refused.says, refused.hint)
    return FLAVORS[model_support.torchtitan_key(spec)]


def _data_parallel(ctx: ExportContext) -> dict[str, int]:
    m = ctx.manifest
    L = m.layout
    if L.dp == 1:
        return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 1}
    if L.zero_stage == 0:  # DDP, alone (knowledge/targets.yaml refuses it with tp, pp or cp, and ZeRO 1-2)
        return {"data_parallel_replicate_degree": L.dp, "data_parallel_shard_degree": 1}
    if not L.hybrid_shard:
        return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": L.dp}
    shard = max(1, min(L.dp, gpus_per_node_used(m) // (L.tp * L.cp)))
    return {"data_parallel_replicate_degree": L.dp // shard, "data_parallel_shard_degree": shard}


def model_parts(ctx: ExportContext) -> list[list[str]]:
    """The plan's pipeline chunks as torchtitan module names, model part by model part."""
    stages = ctx.manifest.placement.stages
    pp = len(stages)
    parts: dict[int, list[str]] = {}
    for st in stages:
        for k, (first, last) in enumerate(st.layer_ranges):
            parts[st.stage + k * pp] = [f"layers.{i}" for i in range(first, last + 1)]
    ordered = [parts[i] for i in sorted(parts)]
    ordered[0].insert(0, "tok_embeddings")
    ordered[-1] += ["norm", "output"]
    return ordered


def job_config(ctx: ExportContext) -> dict[str, dict[str, Any]]:
    m = ctx.manifest
    L, wl = m.layout, training(ctx, TARGET)
    name, flav = flavor(ctx.spec)
    # adapters, optimizers, offload, schedules, DDP with model parallelism, ZeRO 1-2, weight formats
    check(ctx, TARGET)
    schedule = SCHEDULES.get((L.pp_schedule, L.virtual_stages > 1))
    par: dict[str, Any] = {**_data_parallel(ctx), "tensor_parallel_degree": L.tp, "pipeline_parallel_degree": L.pp,
                           "context_parallel_degree": L.cp}
    if L.ep > 1:
        par |= {"expert_parallel_degree": L.ep, "expert_tensor_parallel_degree": L.etp}
    dp = L.dp
    if L.pp > 1:
        par |= {"pipeline_parallel_schedule": schedule, "pipeline_parallel_microbatch_size": L.micro_batch_size,
                "module_fqns_per_model_part": model_parts(ctx)}
        if L.zero_stage == 3 and dp > 1 and not wl.fsdp_unsharded_under_pp:
            par["fsdp_reshard_after_forward"] = "always"
        local = wl.global_batch_size // dp  # the pipeline splits it into micro-batches
    else:
        local = L.micro_batch_size  # torchtitan accumulates gradients up to global_batch_size
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[wl.param_dtype]
    model: dict[str, Any] = {"name": name, "flavor": flav, "hf_assets_path": _assets(ctx)}
    cfg: dict[str, dict[str, Any]] = {
        "job": {"dump_folder": "./outputs", "description": f"shardplan plan for {m.model.name}"},
        "model": model,
        "optimizer": {"name": _OPTIMIZER[wl.optimizer], "lr": 3e-4},
        "training": {"local_batch_size": local, "global_batch_size": wl.global_batch_size, "seq_len": wl.seq_len,
                     "steps": 1000, "max_norm": 1.0, "mixed_precision_param": dtype,
                     "enable_cpu_offload": L.offload_params == "cpu"},
        "parallelism": par,
        "activation_checkpoint": {"mode": L.recompute},
        "compile": {"enable": wl.elementwise_fused, "components": ["model", "loss"]},
        "checkpoint": {"enable": True, "folder": "checkpoint", "interval": 500},
    }
    if L.recompute == "selective":
        cfg["activation_checkpoint"]["selective_ac_option"] = "op"
    if wl.matmul_dtype == "fp8":
        model["converters"] = ["quantize.linear.float8"]
        fsdp = L.zero_stage == 3 and dp > 1
        cfg["quantize.linear.float8"] = {"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": fsdp,
                                         "precompute_float8_dynamic_scale_for_fsdp": fsdp}
    table = flag_table(KEYS)
    for section, keys in cfg.items():
        for key, value in keys.items():
            table.check(f"{section}.{key}", value if isinstance(value, str) else _toml(value))
    return cfg


def _assets(ctx: ExportContext) -> str:
    """Where torchtitan reads the tokenizer (and HF weights): --model-path, else the folder its
    scripts/download_hf_assets.py writes for the plan's HF id."""
    if ctx.options.model_path is not None:
        return ctx.options.model_path
    hf = ctx.manifest.model.hf_id
    return f"./assets/hf/{hf.rstrip('/').split('/')[-1]}" if hf else "./assets/hf/model"


def _toml(value: Any) -> str:
    """A TOML value: strings as JSON strings (valid TOML basic strings: every control character and
    non-ASCII character escaped, so a name cannot end the line or the string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(cfg: dict[str, dict[str, Any]], header: list[str]) -> str:
    lines = [f"# {comment(h)}" if h else "#" for h in header]
    for section, keys in cfg.items():
        lines += ["", f"[{section}]", *(f"{k} = {_toml(v)}" for k, v in keys.items())]
    return "\n".join(lines) + "\n"


def run_command(ctx: ExportContext) -> str:
    launcher: list[Arg] = script_launcher_args(ctx)
    if ctx.options.script is None:
        program = ["-m", "torchtitan.train"]
    else:
        program = script_words(ctx, "train.py")
        if not program[0].endswith(".py"):
            launcher.append(("no-python", None))
    flag_table(KEYS).check("job.config_file", "train.toml")
    return command(None, ["torchrun"], launcher, tail=[*program, "--job.config_file", "train.toml"])


def export_torchtitan(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    cfg = job_config(ctx)
    table = flag_table(KEYS)
    header = plan_header(m, TARGET)
    header.append(f"keys checked against {table.pinned} ({table.sources[0]})")
    notes = [f"model: torchtitan's {cfg['model']['name']} {cfg['model']['flavor']}; tokenizer from "
             f"{cfg['model']['hf_assets_path']} (torchtitan's scripts/download_hf_assets.py --assets tokenizer)"]
    if m.layout.tp > 1 and not m.layout.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always runs sequence parallel: less activation memory than planned")
    toml_header = [*header, *notes, "steps, lr, dataset and checkpoint interval are placeholders to edit"]
    run_header = [*header, *notes]
    if m.hardware.num_nodes > 1:
        run_header += [f"run on each of the {m.hardware.num_nodes} nodes with HEAD_ADDR set to node 0's address:",
                       "  HEAD_ADDR=10.0.0.1 bash run.sh"]
        body = [*script_rdzv_lines(ctx), ""]
    else:
        run_header.append("run: bash run.sh (with torchtitan 0.2.2 installed)")
        body = []
    body.append(run_command(ctx))
    return [ExportFile("train.toml", to_toml(cfg, toml_header)),
            ExportFile("run.sh", script(body, header=run_header), executable=True)]
