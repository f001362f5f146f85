"""`torchrun` per node with c10d rendezvous, and a Slurm `sbatch` script (srun + torchrun).

Both run the plan's world size (tp x pp x cp x dp ranks) as num_nodes x GPUs-per-node
processes. What each rank runs is `--script` (a training script and its arguments), by
default `shardplan verify <plan>`, which reads the layout from the manifest itself; a --script
gets the layout appended as arguments (`degree_args`: --tp N --pp N --dp N ...).
Flags are checked in the tests by torch's own parser (`torch.distributed.run.get_args_parser`).

Faults: torchrun's elastic agent restarts every rank of the group up to --max-restarts times
(`max_restarts`, default 3) after a rank fails or a node leaves or joins, re-forming the group
through the c10d rendezvous over `--nnodes MIN:MAX` nodes. MAX is the plan's node count; MIN is
the same unless `elastic_min_nodes` says otherwise, because the plan's layout (tp x pp x dp) is
sized for all of its GPUs: a group that re-forms on fewer nodes runs another world size, which
the rank program must accept (it reads WORLD_SIZE) and which should be replanned first
(`replan_line`). The rendezvous id is derived from the plan (`rdzv_id`), so every node of one
plan meets in the same rendezvous and a restarted node rejoins it. Slurm adds `--requeue` and
a wrapper that requeues the job once torchrun has spent its restarts (`export_slurm`).
"""

from __future__ import annotations

import hashlib
import json

from shardplan.errors import ShardplanError
from shardplan.plan.schema import DeploymentManifest, TrainingWorkloadSection
from shardplan.exporters.base import (
    Arg,
    ExportContext,
    ExportFile,
    Raw,
    command,
    comment,
    gpus_per_node_used,
    plan_header,
    safe_name,
    script,
    script_words,
)

RDZV_PORT = 29500  # torchrun's default master port
# Slurm sends SIGTERM to the job step this long before the time limit: torchrun passes it to the
# ranks, whose script can save a checkpoint before the job is requeued.
SIGNAL_LEAD_SECONDS = 120


def rdzv_id(m: DeploymentManifest) -> str:
    """A rendezvous id that is the same for every node, and every restart, of one plan: the model
    name and the first 8 hex digits of the sha256 of the model, hardware and layout sections."""
    shape = {k: getattr(m, k).model_dump(mode="json") for k in ("model", "hardware", "layout")}
    if not shape["layout"]["offload_layers"]:  # a field added later: ids of plans without it stay as they were
        del shape["layout"]["offload_layers"]
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:8]
    return f"{safe_name(m.model.name, 'model')[:40]}-{digest}"


def nnodes_range(ctx: ExportContext) -> tuple[int, int]:
    """(MIN, MAX) for torchrun --nnodes: MAX the plan's nodes; MIN `elastic_min_nodes`, else MAX."""
    n = ctx.manifest.hardware.num_nodes
    low = ctx.options.elastic_min_nodes
    if low is None:
        return n, n
    if not 1 <= low <= n:
        raise ShardplanError(f"--elastic-min-nodes {low} is not between 1 and the plan's {n} node(s)",
                             field="--elastic-min-nodes", hint=f"give 1 to {n}, or leave it out to require all {n}")
    return low, n


def max_restarts(ctx: ExportContext) -> int:
    restarts = ctx.options.max_restarts
    if restarts < 0:
        raise ShardplanError(f"--max-restarts {restarts} is negative", field="--max-restarts",
                             hint="give 0 (fail at the first fault) or more")
    return restarts


def fault_lines(ctx: ExportContext) -> list[str]:
    """Header lines: how the launch survives faults, and what to run when the world size changes."""
    low, high = nnodes_range(ctx)
    restarts = f"torchrun restarts all ranks up to {max_restarts(ctx)} times (--max-restarts)"
    if high == 1:
        lines = [f"faults: {restarts}"]
    else:
        lines = [f"faults: {restarts} and re-forms the group over {low}:{high} nodes "
                 "(--nnodes MIN:MAX; MIN: --elastic-min-nodes)"]
    if low < high:
        lines.append(f"fewer than {high} nodes is another world size: the rank program must read WORLD_SIZE")
    return [comment(line) for line in (*lines, replan_line(ctx))]  # the plan's path is anyone's text


def replan_line(ctx: ExportContext) -> str:
    lost = "--nodes K --lost-nodes I,J" if ctx.manifest.hardware.num_nodes > 1 else "--gpus N --lost-ranks R,S"
    return (f"world size changed (a node or GPU lost for good): shardplan replan {ctx.options.plan_file} {lost} "
            "--from-checkpoint DIR -o new/plan.yaml, export new/plan.yaml, resume from the checkpoint")


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


def launcher_args(ctx: ExportContext, *, nnodes: str | int, rdzv_id: str, head: str) -> list[Arg]:
    """torchrun's own arguments, shared by every launcher that runs the plan under torchrun
    (torchrun, slurm, megatron, torchtitan): standalone on one node (no rendezvous host needed);
    over several, elastic: `nnodes` MIN:MAX (`nnodes_range`, or what stands for it in the script),
    a c10d rendezvous at `head`; restarts up to `max_restarts` either way."""
    m = ctx.manifest
    args: list[Arg] = [("nproc-per-node", gpus_per_node_used(m)), ("max-restarts", max_restarts(ctx))]
    if m.hardware.num_nodes == 1:
        return [("standalone", None), *args]
    return [("nnodes", nnodes), *args, ("rdzv-id", Raw(rdzv_id)), ("rdzv-backend", "c10d"),
            ("rdzv-endpoint", Raw(f"{head}:{ctx.options.port or RDZV_PORT}"))]


def script_rdzv_lines(ctx: ExportContext) -> list[str]:
    """The shell lines a multi-node launcher script sets its rendezvous host and id with."""
    return ['HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of node 0}"',
            f'RDZV_ID="${{RDZV_ID:-{rdzv_id(ctx.manifest)}}}"']


def script_launcher_args(ctx: ExportContext) -> list[Arg]:
    """`launcher_args` as a launcher script run on every node writes them (after `script_rdzv_lines`)."""
    low, high = nnodes_range(ctx)
    return launcher_args(ctx, nnodes=f"{low}:{high}", rdzv_id="$RDZV_ID", head="$HEAD_ADDR")


def torchrun_command(ctx: ExportContext, *, nnodes: str | int, rdzv_id: str, head: str) -> str:
    """One torchrun line running the plan's rank program (`launcher_args` for the rest)."""
    extra, tail = rank_program(ctx)
    return command(None, ["torchrun"], [*launcher_args(ctx, nnodes=nnodes, rdzv_id=rdzv_id, head=head), *extra],
                   tail=tail)


def export_torchrun(ctx: ExportContext) -> list[ExportFile]:
    m = ctx.manifest
    n = m.hardware.num_nodes
    header = [*plan_header(m, "torchrun"), *fault_lines(ctx)]
    if n == 1:
        header.append("run on the node: bash torchrun.sh")
        body = [torchrun_command(ctx, nnodes=1, rdzv_id="", head="")]
    else:
        low, high = nnodes_range(ctx)
        header += [f"run on each of the {n} nodes with HEAD_ADDR set to node 0's address (any order; "
                   "c10d rendezvous assigns node ranks):", "  HEAD_ADDR=10.0.0.1 bash torchrun.sh"]
        body = [*script_rdzv_lines(ctx), "",
                torchrun_command(ctx, nnodes=f"{low}:{high}", rdzv_id="$RDZV_ID", head="$HEAD_ADDR")]
    return [ExportFile("torchrun.sh", script(body, header=header), executable=True)]


def export_slurm(ctx: ExportContext) -> list[ExportFile]:
    """An sbatch script: one torchrun per node under srun. It survives faults three ways:
    torchrun restarts the ranks in the allocation (--max-restarts); `#SBATCH --requeue` lets
    Slurm requeue the job when a node fails; and the wrapper requeues it itself
    (`scontrol requeue`) when torchrun exits non-zero with its restarts spent, at most
    --max-restarts times (SLURM_RESTART_COUNT counts the requeues), so a new allocation replaces
    a bad node. `--signal=TERM@120` stops the ranks gracefully 120 s before the time limit; the
    wrapper then requeues the job like any other failure. The rendezvous id is the plan's id and
    the job id, which a requeued job keeps."""
    m = ctx.manifest
    n, g = m.hardware.num_nodes, gpus_per_node_used(m)
    restarts = max_restarts(ctx)
    low, _ = nnodes_range(ctx)
    sbatch = [
        f"--job-name=shardplan-{safe_name(m.model.name, 'model')}",  # sbatch reads this line itself: no quoting
        f"--nodes={n}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the node's ranks
        f"--gpus-per-node={g}",
        "--exclusive",
        "--output=%x-%j.out",
        "--open-mode=append",  # a requeued job appends to its log instead of truncating it
        "--requeue",
        f"--signal=TERM@{SIGNAL_LEAD_SECONDS}",
    ]
    header = [*plan_header(m, "slurm"), *fault_lines(ctx),
              f"requeue: when torchrun fails with its restarts spent, the script requeues the job "
              f"(at most {restarts} times) so that Slurm starts it again, on new nodes if one failed; "
              f"{SIGNAL_LEAD_SECONDS} s before the time limit the ranks get SIGTERM (save a checkpoint there)",
              "submit: sbatch slurm.sbatch"]
    launch = "srun --kill-on-bad-exit=1 " + torchrun_command(
        ctx, nnodes=Raw(f"{low}:$SLURM_NNODES"), rdzv_id=f"{rdzv_id(m)}-$SLURM_JOB_ID", head="$HEAD_ADDR")
    lines = ["#!/usr/bin/env bash", *(f"#SBATCH {s}" for s in sbatch), *(f"# {h}" for h in header),
             "set -euo pipefail", "",
             # sed reads every name: `head -n 1` would exit early, and under pipefail scontrol's SIGPIPE (141)
             # would end the job
             *(['HEAD_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)', ""] if n > 1 else []),
             f"MAX_REQUEUES={restarts}", "set +e", launch, "status=$?", "set -e",
             'if [ "$status" -ne 0 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then',
             '    echo "torchrun exited $status; requeueing (requeue $((${SLURM_RESTART_COUNT:-0} + 1)) of '
             '$MAX_REQUEUES)" >&2',
             '    scontrol requeue "$SLURM_JOB_ID"',
             "fi",
             'exit "$status"']
    return [ExportFile("slurm.sbatch", "\n".join(lines) + "\n", executable=True)]
