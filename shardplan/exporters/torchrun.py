"""`torchrun` per node with c10d rendezvous, and a Slurm `sbatch` script (srun + torchrun).

Both run the plan's world size (tp x pp x cp x dp ranks) as num_nodes x GPUs-per-node
processes. What each rank runs is `--script` (a training script and its arguments), by
default `shardplan verify <plan>`, which reads the layout from the manifest itself; a --script
gets the layout appended as arguments (`degree_args`: --tp N --pp N --dp N ...).
Flags are checked in the tests by torch's own parser (`torch.distributed.run.get_args_parser`).
"""

from __future__ import annotations

from shardplan.plan.schema import TrainingWorkloadSection
from shardplan.exporters.base import (
    Arg,
    ExportContext,
    ExportFile,
    Raw,
    command,
    gpus_per_node_used,
    plan_header,
    safe_name,
    script,
    script_words,
)

RDZV_PORT = 29500  # torchrun's default master port


def rank_program(ctx: ExportContext) -> tuple[list[Arg], list[str]]:
    """torchrun flags and trailing words that start the rank program."""
    if ctx.options.script is None:
        plan = ctx.options.plan_file
        return [], ["-m", "shardplan", "verify", f"./{plan}" if plan.startswith("-") else plan]
    words = [*script_words(ctx, ""), *degree_args(ctx)]
    if words[0].endswith(".py"):
        return [], words
    return [("no-python", None)], words  # an executable, e.g. a console script


def degree_args(ctx: ExportContext) -> list[str]:
    """The plan's layout, appended after --script's own arguments so that the script reads it
    (argparse) instead of repeating it: --tp --pp --dp --cp --ep (degrees; 1: not used), --vp
    (model chunks per pipeline stage), --zero-stage, --micro-batch-size (sequences), and for a
    training plan --global-batch-size (sequences per step) and --seq-len (tokens)."""
    m = ctx.manifest
    L = m.layout
    pairs = [("tp", L.tp), ("pp", L.pp), ("dp", L.dp), ("cp", L.cp), ("ep", L.ep), ("vp", L.virtual_stages),
             ("zero-stage", L.zero_stage), ("micro-batch-size", L.micro_batch_size)]
    if isinstance(m.workload, TrainingWorkloadSection):
        pairs += [("global-batch-size", m.workload.global_batch_size), ("seq-len", m.workload.seq_len)]
    return [w for name, value in pairs for w in (f"--{name}", str(value))]


def torchrun_command(ctx: ExportContext, *, nnodes: str | int, rdzv_id: str, head: str) -> str:
    """One torchrun line; on one node it is standalone (no rendezvous host needed)."""
    m = ctx.manifest
    port = ctx.options.port or RDZV_PORT
    extra, tail = rank_program(ctx)
    args: list[Arg] = [("nproc-per-node", gpus_per_node_used(m))]
    if m.hardware.num_nodes == 1:
        args.insert(0, ("standalone", None))
    else:
        args = [("nnodes", nnodes), *args, ("rdzv-id", Raw(rdzv_id)), ("rdzv-backend", "c10d"),
                ("rdzv-endpoint", Raw(f"{head}:{port}"))]
    return command(None, ["torchrun"], [*args, *extra], tail=tail)


def export_torchrun(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    n = m.hardware.num_nodes
    header = plan_header(m, "torchrun")
    if n == 1:
        header.append("run on the node: bash torchrun.sh")
        body = [torchrun_command(ctx, nnodes=1, rdzv_id="", head="")]
    else:
        header += [f"run on each of the {n} nodes with HEAD_ADDR set to node 0's address (any order; "
                   "c10d rendezvous assigns node ranks):", "  HEAD_ADDR=10.0.0.1 bash torchrun.sh"]
        body = ['HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of node 0}"',
                'RDZV_ID="${RDZV_ID:-shardplan}"', "",
                torchrun_command(ctx, nnodes=n, rdzv_id="$RDZV_ID", head="$HEAD_ADDR")]
    return [ExportFile("torchrun.sh", script(body, header=header), executable=True)]


def export_slurm(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    n, g = m.hardware.num_nodes, gpus_per_node_used(m)
    sbatch = [
        f"--job-name=shardplan-{safe_name(m.model.name, 'model')}",  # sbatch reads this line itself: no quoting
        f"--nodes={n}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the node's ranks
        f"--gpus-per-node={g}",
        "--exclusive",
        "--output=%x-%j.out",
    ]
    header = [*plan_header(m, "slurm"), "submit: sbatch slurm.sbatch"]
    lines = ["#!/usr/bin/env bash", *(f"#SBATCH {s}" for s in sbatch), *(f"# {h}" for h in header),
             "set -euo pipefail", "",
             *(['HEAD_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', ""] if n > 1 else []),
             "srun --kill-on-bad-exit=1 " + torchrun_command(ctx, nnodes=Raw("$SLURM_NNODES"),
                                                             rdzv_id="$SLURM_JOB_ID", head="$HEAD_ADDR")]
    return [ExportFile("slurm.sbatch", "\n".join(lines) + "\n", executable=True)]
