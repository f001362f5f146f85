"""Starting `verify NEW --from OLD` here: two torchrun launches sharing one checkpoint folder.

1. the old plan's layout trains --steps steps and saves a torch.distributed.checkpoint (DCP)
   of the model and optimizer (every old rank writes its share, the lost ones included: their
   share was on shared storage before they were lost);
2. a fresh launch with the new plan's world size (the lost ranks are gone, other ranks may
   have joined) loads it into the new layout, DCP resharding it, and trains --steps more; its
   rank 0 then runs the unsharded reference for all the steps;
3. `reshard.py` compares the loss sequence with the reference, and what each new rank loaded
   with the move list for the same change. No torch here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from shardplan.errors import CannotVerify, VerifyRunFailed
from shardplan.fileio import write_text_atomic
from shardplan.tasks._moves import Devices
from shardplan.tasks.replan import lost_old_ranks, node_size
from shardplan.verify import reshard
from shardplan.verify.launch import (
    check_hostable,
    default_scale,
    is_worker,
    local_gpu_count,
    resolve_backend,
    rank_env,
    run_torchrun,
    torchrun_prefix,
)
from shardplan.verify.outofmemory import hardware_for
from shardplan.verify.report import CheckpointWrite, Progress, ReshardRank, ReshardReport
from shardplan.verify.reshard import ReshardPair


def leg_command(pair: ReshardPair, leg: str, world: int, port: int, run_dir: Path, checkpoint: Path, *,
                backend: str, scale: str, steps: int, timeout_seconds: float) -> tuple[list[str], dict[str, str]]:
    """torchrun's line for one leg: every rank runs `reshard_rank` (loopback only, as verify's own)."""
    cmd = [*torchrun_prefix(world, port), "-m", "shardplan.verify.reshard_rank", "--leg", leg,
           "--plan", pair.new_path, "--from-plan", pair.old_path, "--scale", scale, "--steps", str(steps),
           "--backend", backend, "--timeout", repr(float(timeout_seconds)), "--checkpoint", str(checkpoint),
           "--out", str(run_dir / "leg.json")]
    return cmd, rank_env(run_dir, backend)


def _leg(pair: ReshardPair, leg: str, checkpoint: Path, *, backend: str, scale: str, steps: int,
         timeout_seconds: float, on_event: Progress | None) -> tuple[dict[str, Any], Path, float]:
    """Run one leg; (rank 0's results, its run folder, wall seconds). Raises VerifyRunFailed."""
    run = pair.old_run if leg == "old" else pair.new_run
    plan = pair.old_path if leg == "old" else pair.new_path
    if on_event is not None:
        on_event(f"{leg} layout ({reshard.layout_label(run.layout)}, {run.world_size} ranks): "
                 + ("train and save the checkpoint" if leg == "old" else "load the checkpoint and train on"))
    t0 = time.monotonic()
    out = run_torchrun(lambda port, run_dir: leg_command(pair, leg, run.world_size, port, run_dir, checkpoint,
                                                         backend=backend, scale=scale, steps=steps,
                                                         timeout_seconds=timeout_seconds),
                       run.world_size, backend=backend, scale=scale, timeout_seconds=timeout_seconds, on_event=on_event)
    seconds = time.monotonic() - t0
    result = out.run_dir / "leg.json"
    if out.timed_out or out.code != 0 or not result.is_file():
        failure = out.failure(plan, run, timeout_seconds)
        failure["run_dir"] = str(out.run_dir)
        failure["leg"] = leg
        raise _Failed(failure)
    return json.loads(result.read_text()), out.run_dir, seconds


class _Failed(Exception):
    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__("; ".join(report["cause"]))
        self.report = report


def verify_reshard(plan: Path, from_plan: Path, *, lost_nodes: list[int], lost_ranks: list[int], backend: str,
                   scale: str | None, steps: int, timeout_seconds: float, report_path: Path | None,
                   on_event: Progress | None = None) -> ReshardReport:
    """Run `verify PLAN --from FROM_PLAN`. Raises ShardplanError (exit 2) for plans it cannot
    pair or run here, VerifyRunFailed (exit 5, after writing the failure report to
    `report_path`) when a leg does not complete."""
    if is_worker():
        raise CannotVerify("verify --from launches its two runs itself, one after the other", field="--from",
                           hint="run it on one machine, not under torchrun or srun")
    old, new = reshard.read_pair(plan, from_plan)  # refused before torch loads: plans that cannot pair,
    gpn = node_size(old, new)
    lost = lost_old_ranks(old, gpn, lost_nodes=lost_nodes, lost_ranks=lost_ranks)  # lost ranks it does not have
    gpus = local_gpu_count()
    backend = resolve_backend(backend, gpus)
    scale = default_scale(scale, gpus)
    pair = reshard.load_pair(plan, from_plan, scale=scale, steps=steps)
    for run in (pair.old_run, pair.new_run):
        check_hostable(run, backend, gpus)
    devices = Devices.build(gpus_per_node=gpn, old_num_gpus=pair.old.hardware.num_gpus,
                            new_num_gpus=pair.new.hardware.num_gpus, lost=lost)
    hw, _ = hardware_for(pair.new, pair.new_run)
    planned = reshard.move_split(reshard.as_ran(pair.old, pair.old_run), reshard.as_ran(pair.new, pair.new_run),
                                 pair.old_run.spec, devices, hw)
    at_plan_scale = reshard.move_split(pair.old, pair.new, pair.spec, devices, hw)
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="shardplan-reshard-"))
    checkpoint = root / "checkpoint"
    try:
        old, old_dir, old_seconds = _leg(pair, "old", checkpoint, backend=backend, scale=scale, steps=steps,
                                         timeout_seconds=timeout_seconds, on_event=on_event)
        left = max(1.0, timeout_seconds - (time.monotonic() - t0))
        new, new_dir, new_seconds = _leg(pair, "new", checkpoint, backend=backend, scale=scale, steps=steps,
                                         timeout_seconds=left, on_event=on_event)
    except _Failed as e:
        if report_path is not None:
            write_text_atomic(report_path, json.dumps(e.report, indent=2) + "\n")
        raise VerifyRunFailed(f"the {e.report['leg']} layout's run: " + ("; ".join(e.report["cause"]) or "failed"),
                              source=pair.old_path if e.report["leg"] == "old" else pair.new_path,
                              hint=f"see {e.report['run_dir']} and the report's log_tail") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the checkpoint: at --scale full, the model's size and more
    report = build_report(pair, old, new, planned, at_plan_scale, devices, backend=backend,
                          device="cuda" if backend == "nccl" else "cpu",
                          wall_seconds={"old_run": old_seconds, "new_run": new_seconds,
                                        "total": time.monotonic() - t0},
                          leg_dirs={"old": str(old_dir), "new": str(new_dir)})
    if report_path is not None:
        write_text_atomic(report_path, report.model_dump_json(indent=2) + "\n")
    if on_event is not None:
        on_event(f"done: {report.status}")
    return report


def build_report(pair: ReshardPair, old: dict[str, Any], new: dict[str, Any], planned, at_plan_scale,
                 devices: Devices, *, backend: str, device: str, wall_seconds: dict[str, float],
                 leg_dirs: dict[str, str] | None = None) -> ReshardReport:
    """The report from both legs' rank-0 results (`reshard_rank`) and the move lists."""
    (before,) = [r["losses"] for r in old["results"] if r.get("losses") is not None]
    (after,) = [r["losses"] for r in new["results"] if r.get("losses") is not None]
    rtol, atol = reshard.loss_tolerance(pair.old_run)
    numerics = reshard.loss_continuation(before, after, new["reference"], rtol=rtol, atol=atol)
    ranks, mismatches = [], []
    if not numerics.ok:
        step = numerics.first_bad_step
        where = "before the checkpoint" if step is not None and step < numerics.steps_before else "after resharding"
        mismatches.append(f"numerics: the loss of step {step} ({where}) is not the unsharded reference's within "
                          f"rtol {rtol:g} / atol {atol:g}")
    for r in sorted(new["results"], key=lambda r: r["rank"]):
        io = r["checkpoint"]
        states = [reshard.loaded_bytes(s, io["loaded_bytes"][s], planned[r["rank"]][s]) for s in reshard.STATES]
        for s in states:
            if not s.ok:
                how = f"{s.relative_error:+.1%}" if s.relative_error is not None else "loaded where none was planned"
                mismatches.append(f"new rank {r['rank']} {s.state}: loaded {s.measured_bytes} bytes, the move list "
                                  f"{s.planned_bytes:.0f} ({how}, tolerance {s.tolerance:.0%})")
        ranks.append(ReshardRank(rank=r["rank"], node=r["rank"] // devices.gpus_per_node,
                                 old_rank_on_gpu=reshard.old_rank_on_gpu(devices, r["rank"]), states=states,
                                 other_bytes=io["loaded_bytes"]["other"], file_bytes_read=io["file_bytes_read"],
                                 num_read_items=io["num_read_items"], load_seconds=io["seconds"],
                                 plan_scale=reshard.plan_scale(at_plan_scale[r["rank"]])))
    saved = [CheckpointWrite(rank=r["rank"], written_bytes=r["checkpoint"]["written_bytes"],
                             num_write_items=r["checkpoint"]["num_write_items"], save_seconds=r["checkpoint"]["seconds"])
             for r in sorted(old["results"], key=lambda r: r["rank"])]
    run = pair.old_run.as_dict()
    run["work"] = {"old": run["work"], "new": pair.new_run.as_dict()["work"]}
    # verify's own note on --dtype fp32 rescales its memory comparison, which this run does not make.
    legs = [n for n in (*run["notes"], *pair.new_run.notes) if not n.startswith("--dtype fp32")]
    run["notes"] = [*pair.notes, *dict.fromkeys(legs)]
    return ReshardReport(
        plan=pair.new_path, from_plan=pair.old_path, status="ok" if not mismatches else "mismatch", backend=backend,
        device=device, old_world_size=pair.old_run.world_size, new_world_size=pair.new_run.world_size,
        lost_ranks=sorted(devices.lost), old_layout=reshard.layout_label(pair.old_run.layout),
        new_layout=reshard.layout_label(pair.new_run.layout), run=run, numerics=numerics, compared=reshard.COMPARED,
        saved=saved, checkpoint_bytes=sum(s.written_bytes for s in saved), ranks=ranks, mismatches=mismatches,
        wall_seconds=wall_seconds, leg_dirs=leg_dirs,
    )
