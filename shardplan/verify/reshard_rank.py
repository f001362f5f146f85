"""One rank of one leg of `verify NEW --from OLD`, as torchrun starts it
(`python -m shardplan.verify.reshard_rank --leg old|new ...`; `reshard_launch` builds the line).

The old leg trains the old plan's layout and saves a DCP checkpoint; the new leg, a fresh
launch with the new world size, loads it into the new layout and trains on; its rank 0 then
runs the unsharded reference for both legs' steps. Rank 0 writes every rank's result to
--out. Both legs read the plans again (`reshard.load_pair`, pure), so every rank runs what
the launcher checked. Imports torch (through the worker)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardplan.fileio import write_text_atomic
from shardplan.verify import worker
from shardplan.verify.reshard import load_pair
from shardplan.verify.session import MIN_COLLECTIVE_TIMEOUT_SECONDS

LEGS = ("old", "new")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardplan.verify.reshard_rank",
                                description="one rank of `shardplan verify NEW --from OLD` (started by it)")
    p.add_argument("--leg", choices=LEGS, required=True)
    p.add_argument("--plan", type=Path, required=True, help="the new manifest")
    p.add_argument("--from-plan", type=Path, required=True, help="the old manifest")
    p.add_argument("--scale", choices=("proxy", "full"), required=True)
    p.add_argument("--steps", type=int, required=True, help="steps of each leg")
    p.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    p.add_argument("--timeout", type=float, required=True, help="seconds the leg may take")
    p.add_argument("--checkpoint", type=Path, required=True, help="the DCP folder the old leg writes")
    p.add_argument("--out", type=Path, required=True, help="where rank 0 writes the leg's results (JSON)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    pair = load_pair(a.plan, a.from_plan, scale=a.scale, steps=a.steps)
    old = a.leg == "old"
    m, run = (pair.old, pair.old_run) if old else (pair.new, pair.new_run)
    ckpt = worker.Checkpointing(save_to=str(a.checkpoint)) if old else worker.Checkpointing(load_from=str(a.checkpoint))
    rank, results = worker.run_rank(run, m.placement.tp_splits, m.placement.gpus_per_node, a.backend,
                                    max(MIN_COLLECTIVE_TIMEOUT_SECONDS, a.timeout / 4), checkpoint=ckpt)
    if rank != 0 or results is None:
        return
    out: dict = {"leg": a.leg, "results": results}
    try:
        if not old:
            worker.write_status(0, state="done", phase="reference")
            out["reference"] = worker.reference_training(pair.reference_run())
        write_text_atomic(a.out, json.dumps(out) + "\n")
    except BaseException as e:
        worker.write_status(0, state="error", error=f"{type(e).__name__}: {e}"[:2000])
        raise


if __name__ == "__main__":
    main()
