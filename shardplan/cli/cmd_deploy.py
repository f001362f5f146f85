"""`export`, `checkpoint` and `replan`: from a plan to a running deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


from shardplan.errors import EXIT_DOES_NOT_FIT, ShardplanError

from shardplan.cli.app import app, JsonOpt

# The exporters, the tasks and the renderers are imported when a command runs (`shardplan
# --help` loads none of them).
from shardplan.cli.options import ObjectiveChoice, ToOpt, check_outputs
from shardplan.cli.targets import TargetOpt




@app.command("export")
def export_cmd(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    to: ToOpt,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Folder to write the files into (created if missing); default: print them.")] = None,
    model_path: Annotated[Optional[str], typer.Option(help="Checkpoint path or Hugging Face id the engine loads (default: the plan's hf_id).")] = None,
    script: Annotated[Optional[str], typer.Option(help="Training: the script and arguments each rank runs (default: `shardplan verify PLAN`; deepspeed/accelerate: train.py). torchrun/slurm append the plan's layout after them: --tp N --pp N --dp N --cp N --ep N --vp N --zero-stage N --micro-batch-size N (training: --global-batch-size N --seq-len N).")] = None,
    image: Annotated[Optional[str], typer.Option(help="kubernetes: container image (default: the engine's release image).")] = None,
    port: Annotated[Optional[int], typer.Option(min=1, max=65535, help="Serving port (first replica) or rendezvous port.")] = None,
    nvme_path: Annotated[str, typer.Option(help="deepspeed: folder NVMe offload writes to.")] = "/local_nvme",
    engine: Annotated[str, typer.Option(help="kubernetes: serving engine the pods run (vllm, sglang, tgi, trtllm).")] = "vllm",
    cache_pvc: Annotated[Optional[str], typer.Option(help="kubernetes: PersistentVolumeClaim for the model cache (HF_HOME); default: an emptyDir per pod.")] = None,
    hf_token_secret: Annotated[str, typer.Option(help="kubernetes: Secret whose key `token` the pods read as HF_TOKEN (optional).")] = "hf-token",
    max_restarts: Annotated[int, typer.Option(min=0, help="torchrun, slurm, kubernetes training: times torchrun restarts the ranks after a fault (slurm: also the most requeues; kubernetes: the Job's backoffLimit).")] = 3,
    elastic_min_nodes: Annotated[Optional[int], typer.Option(min=1, help="torchrun, slurm, kubernetes training: the fewest nodes torchrun may re-form the group on (--nnodes MIN:MAX, MAX = the plan's nodes); default: all the plan's nodes, because the layout is sized for them.")] = None,
    disaggregated: Annotated[bool, typer.Option("--disaggregated", help="vllm, sglang: launch the plan's prefill and decode pools (recommend --disaggregated) with the engine's KV-transfer connector (vLLM NixlConnector, SGLang --disaggregation-mode with NIXL) instead of its aggregated replicas.")] = False,
    engine_version: Annotated[Optional[str], typer.Option(help="vllm, sglang, tgi (and kubernetes with --engine): check the flags against, and tag the image with, the bundled flag list of this engine version instead of the plan's --engine-version (the newest list not newer than it; the header says which and why).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Turn a plan into what a deployment tool takes: engine command lines (vllm, sglang, tgi,
    trtllm), training configs and launchers (deepspeed, torchrun, slurm, accelerate), Kubernetes
    objects, or a JAX mesh. Flags are pinned to a stated version of each tool. A plan the target
    cannot express (e.g. pipeline stages for TGI, ZeRO for a serving engine) exits 2 saying why;
    a plan that does not fit exits 3. Files are written atomically."""
    from shardplan.cli import render_common, render_deploy
    from shardplan.exporters import ExportOptions
    from shardplan.tasks.export import export_plan

    opts = ExportOptions(model_path=model_path, script=script, plan_file=str(plan), image=image, port=port,
                         nvme_path=nvme_path, engine=engine, cache_pvc=cache_pvc, hf_token_secret=hf_token_secret,
                         max_restarts=max_restarts, elastic_min_nodes=elastic_min_nodes, disaggregated=disaggregated,
                         engine_version=engine_version)
    result = export_plan(plan, to, opts, output)
    if json_out:
        render_common.print_json(result.model_dump(mode="json"))
    else:
        render_deploy.export_report(result, written=output is not None)


@app.command("checkpoint")
def checkpoint_cmd(
    plan: Annotated[Path, typer.Argument(help="A manifest written by `shardplan recommend -o`.")],
    checkpoint_dir: Annotated[Path, typer.Argument(help="A safetensors checkpoint: a folder with model.safetensors.index.json or one .safetensors file (or that file).")],
    dtype: Annotated[Optional[str], typer.Option(help="The tensors' dtype (default: the model spec's, e.g. bf16).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Which bytes of a safetensors checkpoint each rank reads for this plan. Reads the index and
    the file headers only (never tensor data), checks every tensor's name, shape and dtype
    against the model, and reports per rank the files, byte ranges and total bytes, and the
    total per node (the table gives ranks with the same figures, such as the data-parallel
    replicas of one slice, one row: `shardplan checkpoint plan.yaml ckpt/`; every rank's byte
    ranges with --json). A missing, extra or mis-shaped tensor, or an index entry outside the
    folder, exits 2 naming it."""
    from shardplan.cli import render_common, render_deploy
    from shardplan.tasks.checkpoint import plan_checkpoint

    result = plan_checkpoint(plan, checkpoint_dir, dtype=dtype)
    render_common.emit(result.model_dump(mode="json") if json_out else result, json_out, render_deploy.checkpoint_report)


@app.command("replan")
def replan_cmd(
    plan: Annotated[Path, typer.Argument(help="The current plan (a manifest written by `shardplan recommend -o`).")],
    gpus: Annotated[Optional[int], typer.Option(min=1, help="GPUs of the changed cluster.")] = None,
    nodes: Annotated[Optional[int], typer.Option(min=1, help="Nodes of the changed cluster (the plan's GPUs per node).")] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="Hardware profile (default: the plan's).")] = None,
    margin: Annotated[float, typer.Option(min=0, max=0.99, help="Take the layout that moves least among those within this fraction of the best objective.")] = 0.05,
    objective: Annotated[Optional[ObjectiveChoice], typer.Option(help="Rank by this instead of the plan's objective.")] = None,
    top_k: Annotated[int, typer.Option("--top", min=1, help="Candidate layouts to cost the move of.")] = 5,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the chosen plan's manifest here (and its move list beside it).")] = None,
    moves: Annotated[Optional[Path], typer.Option(help="Write the move list here (.json, or .yaml); default: beside -o as NAME.moves.json.")] = None,
    lost_nodes: Annotated[Optional[str], typer.Option(help="Old nodes that are gone, e.g. 1 or 0,2 or 1-3: their ranks are never sources.")] = None,
    lost_ranks: Annotated[Optional[str], typer.Option(help="Old ranks whose memory is lost, e.g. 3,11 or 8-15 (a node whose every rank is lost is gone).")] = None,
    from_checkpoint: Annotated[Optional[Path], typer.Option(help="Safetensors checkpoint folder to read the slices no surviving rank holds from (headers only are read here).")] = None,
    prefer_fast_recovery: Annotated[bool, typer.Option(help="Among layouts within --margin, take the one whose move is predicted to end soonest (default: the one that moves fewest bytes).")] = False,
    min_capacity: Annotated[Optional[float], typer.Option(help="Serving: the share of the old plan's served rate the rollout keeps, in (0, 1], e.g. --min-capacity 0.75: new replicas start on free GPUs and old ones drain in an order whose rate never falls below it (default: the highest share any order keeps). Exit 3 when no order keeps it.")] = None,
    target: TargetOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """A new plan for a changed cluster (--gpus N or --nodes N), ranked like recommend, with the
    cost of getting there: for each candidate, the bytes of weights (training: and optimizer
    states) each new rank must receive, from which surviving old rank or checkpoint byte range,
    over which link, and the predicted time (bytes / the link's bandwidth + its latency; per new
    rank its links in parallel, each link's pieces in turn; the move: the slowest rank). Chooses
    the layout that moves least (--prefer-fast-recovery: ends soonest) among those within
    --margin of the best, writes its manifest and the move list. Ranks of --lost-nodes and
    --lost-ranks are never sources. Serving: also the rollout, the order that starts the new
    replicas (each serving once its weights are read from storage) and drains the old ones,
    with each step's time and the served rate as a share of the old plan's; e.g.
    `shardplan replan plan.yaml --gpus 24 --min-capacity 0.75` serves 75% or more throughout. The move
    list names each piece of the first 512 new ranks (the rest are counted); a rollout is planned for
    up to 65,536 replicas, old and new (past that the answer says so). Exit 3
    when nothing fits, when slices only lost ranks held have no --from-checkpoint to come from,
    or when no rollout order keeps --min-capacity (the best order is still printed)."""
    from shardplan.cli import render_common, render_deploy
    from shardplan.plan.manifest import load_manifest
    from shardplan.plan.readback import plan_hardware
    from shardplan.search.ahead import search_workers
    from shardplan.specs import cluster
    from shardplan.tasks.replan import replan

    if (gpus is None) == (nodes is None):
        raise ShardplanError("give the changed cluster as --gpus N or --nodes N", field="--gpus", hint="give one of them")
    check_outputs(("-o", output), ("--moves", moves))
    dead_nodes = _index_list(lost_nodes, "--lost-nodes")
    dead_ranks = _index_list(lost_ranks, "--lost-ranks")
    old = load_manifest(plan)
    base = plan_hardware(old, str(plan), hardware)
    gpn = old.hardware.gpus_per_node if old.hardware.num_nodes > 1 else base.gpus_per_node
    n = cluster.cluster(base, gpus=gpus, nodes=nodes, gpus_per_node=gpn).num_gpus
    hw = base.with_topology(gpus_per_node=gpn, num_nodes=1)
    with render_common.progress(f"replanning for {n} GPUs") as progress:
        result = replan(old, source=str(plan), hw=hw, num_gpus=n, margin=margin, top_k=top_k,
                        objective=objective.value if objective else None, manifest_path=output, moves_path=moves,
                        progress=progress, lost_nodes=dead_nodes, lost_ranks=dead_ranks, checkpoint=from_checkpoint,
                        prefer_fast_recovery=prefer_fast_recovery, min_capacity=min_capacity, target=target,
                        workers=search_workers())
    render_common.emit(result.model_dump(mode="json") if json_out else result, json_out, render_deploy.replan_report)
    render_deploy.replan_files_written(result)
    if result.chosen is None or (result.rollout is not None and not result.rollout.keeps_floor):
        raise typer.Exit(EXIT_DOES_NOT_FIT)


MAX_INDEX_LIST = 1 << 20  # ranks one option may name: far above any cluster, a bound on a hostile range


def _index_list(text: Optional[str], flag: str) -> list[int]:
    """'3', '0,2', '8-15' or a mix, as sorted distinct integers; a malformed item exits 2."""
    if text is None:
        return []
    out: set[int] = set()
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ShardplanError(f"{item.strip()!r} is not an index or a range", field=flag,
                                 hint="e.g. 1 or 0,2 or 8-15") from None
        if a < 0 or b < a or b - a >= MAX_INDEX_LIST:
            raise ShardplanError(f"range {item.strip()!r} is empty or too long", field=flag, hint="e.g. 8-15")
        out.update(range(a, b + 1))
    return sorted(out)
