"""Exporters: a manifest in, the files a deployment tool takes out. One module per target,
each a pure function `ExportContext -> list[ExportFile]`; the CLI writes the files atomically.

    from shardplan.exporters import export, ExportOptions
    files = export(manifest, "vllm", spec=spec, options=ExportOptions())

Rules (tests/test_architecture.py): exporters import no rich, typer, torch, `tasks` or `cli`,
and form no import circle (the Kubernetes pod builders are the leaf `k8s_objects`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from shardplan.exporters.base import (
    CannotExpress,
    ExportContext,
    ExportFile,
    ExportOptions,
    PlanDoesNotFit,
    refuse_unfit,
)
from shardplan.errors import ShardplanError
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs.model import ModelSpec


@dataclass(frozen=True)
class Target:
    name: str
    module: str  # shardplan.exporters.<module>
    function: str
    summary: str


TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("vllm", "vllm", "export_vllm", "`vllm serve` line; Ray head/worker + LeaderWorkerSet when a replica spans nodes"),
    Target("sglang", "sglang", "export_sglang", "`python -m sglang.launch_server` per node"),
    Target("tgi", "tgi", "export_tgi", "`text-generation-launcher` per replica"),
    Target("trtllm", "trtllm", "export_trtllm", "TensorRT-LLM: `trtllm-serve` (PyTorch backend) and the engine build"),
    Target("llamacpp", "llamacpp", "export_llamacpp", "llama.cpp: `llama-server` per replica on a GGUF file, and a README"),
    Target("deepspeed", "deepspeed", "export_deepspeed", "ds_config.json and the `deepspeed` launch line"),
    Target("torchrun", "torchrun", "export_torchrun", "torchrun per node with c10d rendezvous"),
    Target("slurm", "torchrun", "export_slurm", "sbatch script: srun + torchrun"),
    Target("megatron", "megatron", "export_megatron", "Megatron-LM pretrain_gpt.py under torchrun, flags from the plan"),
    Target("torchtitan", "torchtitan", "export_torchtitan", "torchtitan job TOML and its torchrun launch"),
    Target("accelerate", "accelerate", "export_accelerate", "device_map (serving) or FSDP config (training)"),
    Target("kubernetes", "kubernetes", "export_kubernetes", "Deployment, LeaderWorkerSet or Indexed Job"),
    Target("jax", "jax", "export_jax", "JAX mesh axes and PartitionSpec per weight kind"),
]}


def export(manifest: DeploymentManifest, target: str, *, spec: ModelSpec | None = None,
           options: ExportOptions | None = None) -> list[ExportFile]:
    t = TARGETS.get(target)
    if t is None:
        raise ShardplanError(f"unknown export target '{target}'", field="--to",
                             hint=f"use one of {', '.join(TARGETS)}")
    refuse_unfit(manifest, target)  # one check for every target, before its exporter runs
    fn = getattr(importlib.import_module(f"shardplan.exporters.{t.module}"), t.function)
    return fn(ExportContext(manifest=manifest, spec=spec, options=options or ExportOptions()))


__all__ = ["TARGETS", "Target", "export", "ExportFile", "ExportOptions", "CannotExpress", "PlanDoesNotFit"]
