from __future__ import annotations

import gc
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
VALIDATION = REPO / "tests" / "data" / "validation"  # published figures, each with its source


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """Run the real console entry point in-process (error mapping and exit codes included)."""
    from shardplan.cli import main, render_common

    # Output as it is piped, whatever the runner's environment (pytest-xdist exports COLUMNS=80):
    # tests that want a narrow terminal set the width themselves.
    monkeypatch.setattr(render_common.console, "width", render_common.PIPED_WIDTH_COLUMNS)
    monkeypatch.setattr(render_common.err_console, "width", render_common.PIPED_WIDTH_COLUMNS)

    def run(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["shardplan", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            gc.unfreeze()  # main() freezes what a command made, for a process about to exit
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run


@pytest.fixture
def bf16_matmuls_as_fp32():
    """bf16 matmuls computed as fp32 GEMMs of the bf16 values, rounded to bf16, on a CPU without bf16
    instructions (shardplan/verify/cpu_matmul.py, as verify's ranks run them): every tensor an op
    returns is what torch's own kernel returns, up to the order of the sums, so what verify's
    storage tracker measures is the same, in a fiftieth of the time."""
    from shardplan.verify import cpu_matmul

    installed = cpu_matmul.install()
    yield installed
    if installed:
        cpu_matmul.uninstall()


GLOO_RANKS_TIMEOUT_SECONDS = 180


def gloo_ranks(fn: Any, world: int = 2) -> list[Any]:
    """Run `fn(rank, world, port, out)` in `world` spawned processes (gloo over a free local port):
    what each put on `out`. `fn` must be a module-level function of the test module. A rank that
    has not ended within GLOO_RANKS_TIMEOUT_SECONDS fails the test (its processes are ended), so a
    stuck rank never holds the suite."""
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(fn, args=(world, port, out), nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + GLOO_RANKS_TIMEOUT_SECONDS
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail(f"gloo ranks still running after {GLOO_RANKS_TIMEOUT_SECONDS} s")
    return [out.get() for _ in range(world)]


def validation_file(name: str) -> Path:
    path = VALIDATION / name
    if not path.is_file():
        pytest.fail(f"validation data missing: {path} (tests/data/validation is part of the repository)")
    return path


def build_plan(model: str, gpus: int, layout, workload, gpus_per_node: int | None = None,
               hardware: str = "h100-sxm-80gb", **extra):
    """A manifest for a pinned layout, from a real estimate (no search): (manifest, its report's JSON)."""
    from shardplan.plan import manifest as mf
    from shardplan.cost.estimate import estimate
    from shardplan.specs.cluster import cluster
    from shardplan.specs.loading import load_hardware, load_model

    loaded = load_model(model)
    hw = cluster(load_hardware(hardware), gpus=gpus, nodes=None, gpus_per_node=gpus_per_node)
    report = estimate(loaded.spec, hw, layout, workload)
    manifest = mf.build_manifest(loaded=loaded, hw=hw, layout=layout, workload=workload, report=report, **extra)
    return manifest, report.model_dump(mode="json")  # the report as `estimate --json` prints it


TORCHRUN_GROUP = "torchrun"


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own naming of grouped tests (below)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Torchrun sessions (`dist`) run one at a time, on one xdist worker: two at once on a
    2-core machine starve gloo's worker threads, and verify's memory sampling then sees
    buffers a finished collective still holds. The other workers run everything else.

    pytest-xdist's `--dist loadgroup` schedules a test by the group name it appends to its node
    id (`...::test@torchrun`); it sets the id through `item._nodeid`, which pytest 9 no longer
    reads (the id lives in `item._id`), so under pytest 9 the group was never formed and the
    sessions ran two at a time. The name is given here where it is missing. The sessions are
    also put first, so that their worker starts on them at once and the rest of the suite runs
    beside them (where they lie they were the suite's last minutes, with a worker idle)."""
    dist = [item for item in items if item.get_closest_marker("dist") is not None]
    chosen = set(map(id, dist))
    items[:] = dist + [item for item in items if id(item) not in chosen]
    if not getattr(config.option, "loadgroup", False):  # not an xdist worker under --dist loadgroup
        return
    for item in dist:
        _in_group(item, TORCHRUN_GROUP)


def _in_group(item: pytest.Item, group: str) -> None:
    """Name the item as pytest-xdist names a test of an xdist_group."""
    named = f"{item.nodeid}@{group}"
    if item.nodeid.endswith(f"@{group}"):
        return  # pytest-xdist named it (pytest 8)
    structured = getattr(item, "_id", None)
    if structured is not None and not isinstance(structured, str):
        item._id = type(structured).parse(named)  # type: ignore[attr-defined]
    else:
        item._nodeid = named  # type: ignore[attr-defined]


def pytest_itemcollected(item: pytest.Item) -> None:
    """The group's marker, as each item is collected: before any collection_modifyitems hook, so
    that pytest-xdist's (which names the grouped tests) sees it."""
    if item.get_closest_marker("dist") is not None:
        item.add_marker(pytest.mark.xdist_group(TORCHRUN_GROUP))
