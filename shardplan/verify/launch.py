"""Starting `verify`: read the plan, decide what runs, refuse what this machine cannot host,
then either start every rank here through torchrun (`torch.distributed.run`) or, when a
launcher already started this process as one rank (RANK and WORLD_SIZE set: torchrun on
every node, srun, a Kubernetes job), run as that rank.

The local launcher runs torchrun in its own session with its rendezvous on the loopback
interface, bounds the whole run by --timeout (ranks get a collective timeout inside it), and
kills the session when it ends, so no rank outlives it. Each rank leaves a small status file;
when the run fails they name the rank that failed first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardplan.errors import CannotVerify, ShardplanError, VerifyRunFailed
from shardplan.plan.readback import plan_spec
from shardplan.fileio import write_text_atomic
from shardplan.plan.manifest import load_manifest
from shardplan.plan.schema import DeploymentManifest
from shardplan.verify.outofmemory import check_limit, hardware_for
from shardplan.verify.report import Progress, VerifyReport
from shardplan.verify.runspec import RUN_DIR_ENV, RunSpec, plan_run

CPU_RANKS_PER_CORE = 4  # gloo ranks per CPU core this machine may start (8 ranks on 2 cores)
MIN_CPU_RANKS = 8
KILL_GRACE_SECONDS = 3.0
WATCH_INTERVAL_SECONDS = 0.05  # how often the launcher looks for ranks that died
# Messages peers raise when another rank died or hung: not the root cause.
COLLATERAL = ("Connection closed by peer", "Connection reset", "Timed out", "timed out", "timeout", "Broken pipe",
              "NCCL", "gloo", "ProcessGroup", "DistBackendError", "SIGTERM", "Signal 15")


def load_plan(plan: Path, scale: str, steps: int, dtype: str = "plan",
              device_memory_gib: float | None = None) -> tuple[DeploymentManifest, RunSpec]:
    m = load_manifest(plan)
    spec = plan_spec(m)
    if spec is None:
        raise CannotVerify(f"the model spec '{m.model.source}' is missing or changed since the plan was written",
                           source=str(plan), field="model.source", hint="re-run shardplan recommend with the spec")
    try:
        run = plan_run(m, spec, scale=scale, steps=steps, dtype=dtype, device_memory_gib=device_memory_gib)
    except ShardplanError as e:
        e.source = e.source or str(plan)
        raise
    return m, run


def local_gpu_count() -> int:
    try:
        import torch  # only here: the launcher needs torch just to count GPUs
    except ImportError:
        raise CannotVerify("verify runs the plan with torch, which is not installed", field="torch",
                           hint="pip install 'shardplan[verify]' (CPU only: pip install torch==2.13.0)") from None

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, gpus: int) -> str:
    if backend == "auto":
        return "nccl" if gpus > 0 else "gloo"
    if backend == "nccl" and gpus == 0:
        raise CannotVerify("NCCL needs GPUs and this machine has none", field="--backend",
                           hint="use --backend gloo (CPU) or run on a GPU node")
    return backend


def default_scale(scale: str | None, gpus: int) -> str:
    return scale or ("full" if gpus > 0 else "proxy")


def check_hostable(run: RunSpec, backend: str, gpus: int) -> None:
    """Refuse up front a run this machine should not start."""
    world = run.world_size
    if backend == "nccl" and world > gpus:
        raise CannotVerify(f"the plan has {world} ranks and this machine {gpus} GPU(s)", field="layout",
                           hint="run it on the cluster with the torchrun or slurm export (each node starts its own ranks)")
    limit = max(MIN_CPU_RANKS, CPU_RANKS_PER_CORE * (os.cpu_count() or 1))
    if backend == "gloo" and world > limit:
        raise CannotVerify(f"the plan has {world} ranks; this machine starts at most {limit} CPU ranks", field="layout",
                           hint="verify a smaller layout of the same shape, or run it on the cluster")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_session(proc: subprocess.Popen) -> None:
    """TERM, then KILL, the launcher's whole process group, each with a grace period. The
    launcher is our child: it is reaped (`poll`) while we wait, or its zombie would keep the
    group alive and every grace period would run out in full."""
    pgid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + KILL_GRACE_SECONDS
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)


def _statuses(run_dir: Path, world: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world):
        try:
            out.append(json.loads((run_dir / f"rank{r}.json").read_text()))
        except (OSError, ValueError):
            out.append({"rank": r, "state": "not started"})
    return out


def _alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped by torchrun, does not: Linux /proc)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+)", re.S)


def torchrun_root_cause(log: str) -> int | None:
    """The rank torchrun's agent saw fail first ("Root Cause (first observed failure)" in its
    summary): it watches its workers' exit codes and terminates the others only after that, so
    it knows the order even when a loaded machine lets our own polling see both gone at once."""
    m = _ROOT_CAUSE.search(log)
    return int(m.group(1)) if m else None


# What a peer raises when a collective waited past the process-group timeout for a rank that
# never joined it (gloo: "Timed out waiting 7500ms for recv operation"; NCCL's watchdog:
# "Watchdog caught collective operation timeout"), and what it raises when that rank died instead.
PEER_WAITED = ("Timed out", "timed out", "timeout")
PEER_LOST = ("Connection closed by peer", "Connection reset", "Broken pipe")


def silent_ranks_hung(statuses: list[dict[str, Any]], root: int | None = None) -> bool:
    """Whether the ranks that ended without a word were hung rather than killed, when the run
    ended before --timeout: a peer gave up waiting for them (its collective timed out) and none
    lost its connection to them, and torchrun's root cause (`root`, when its summary names one)
    is not one of them. A hung rank blocks its peers until the process-group timeout; the first
    peer to time out raises, and torchrun then stops the hung rank with SIGTERM, which looks like
    a kill. A killed rank instead closes its sockets: peers see "Connection closed by peer"
    within a second, and torchrun names the killed rank (SIGKILL) as the root cause."""
    silent = {s["rank"] for s in statuses if s.get("state") in ("started", "not started")}
    errors = [str(s.get("error") or "") for s in statuses if s.get("state") == "error"]
    if not silent or (root is not None and root in silent):
        return False
    return any(w in e for e in errors for w in PEER_WAITED) and not any(w in e for e in errors for w in PEER_LOST)


def hung_cause(status: dict[str, Any], *, now: float | None, launched_at: float | None, timeout_seconds: float,
               by_peers: bool) -> str:
    """Why a rank that never finished is blamed. Its peers timing out on it (`by_peers`) is a hang:
    'rank R hung: no progress for N s (...)'. The launcher's --timeout alone cannot tell a hang from
    a run that needs longer (a rank reports when it starts and when it ends, not each step), so
    that cause says both, and what to change. N: wall-clock seconds from the rank's last status file
    write (or the launch, for a rank that never wrote one) to when the launcher gave up; --timeout
    when neither time is known."""
    since = status.get("time") or launched_at
    seconds = now - since if now is not None and since is not None else timeout_seconds
    if by_peers:
        return (f"rank {status['rank']} hung: no progress for {seconds:.0f} s (its peers' collectives timed out "
                "waiting for it; torchrun then stopped it)")
    since_what = "its last report" if status.get("time") else "the launch"
    return (f"rank {status['rank']} had not finished {seconds:.0f} s after {since_what} when --timeout "
            f"{timeout_seconds:g} s stopped the run: it hung, or the run needs longer (raise --timeout or lower --steps)")


def failure_report(plan: str, run: RunSpec, statuses: list[dict[str, Any]], *, timed_out: bool, timeout_seconds: float,
                   exit_code: int | None, log_tail: str, died_at: dict[int, float] | None = None,
                   now: float | None = None, launched_at: float | None = None) -> dict[str, Any]:
    """Who failed and how. The root cause is a rank whose own error is not a peer's collateral
    one; else a rank that vanished without a word: hung when its peers timed out waiting for it
    (`silent_ranks_hung`), else killed, the first seen gone when several did (`died_at`: rank ->
    when); else, on a timeout, the ranks that never finished (hung). `timed_out` in the report is
    true whenever the run ended because something waited past a timeout: --timeout (the
    launcher's wall clock, `timed_out` here) or the collective timeout inside it. `now` and
    `launched_at` (wall-clock seconds) give how long a hung rank made no progress."""
    errors = [s for s in statuses if s.get("state") in ("error", "oom")]
    own = [s for s in errors if not any(c in s.get("error", "") for c in COLLATERAL)]
    silent = [s for s in statuses if s.get("state") in ("started", "not started")]
    root = torchrun_root_cause(log_tail)
    hung_by_peers = not own and not timed_out and silent_ranks_hung(statuses, root)
    if own:
        failed = sorted(own, key=lambda s: s.get("time", 0))
        how = [f"rank {s['rank']} raised {s['error']}" for s in failed]
    elif silent and not timed_out and not hung_by_peers:
        seen = {s["rank"]: died_at[s["rank"]] for s in silent if died_at and s["rank"] in died_at}
        if root is not None and any(s["rank"] == root for s in silent):
            failed = [s for s in silent if s["rank"] == root]
        else:
            failed = [s for s in silent if s["rank"] in seen and seen[s["rank"]] == min(seen.values())] if seen else silent
        how = [f"rank {s['rank']} died without an error (killed by a signal or the OS)" for s in failed]
    elif timed_out or hung_by_peers:
        failed = silent or errors
        how = [hung_cause(s, now=now, launched_at=launched_at, timeout_seconds=timeout_seconds, by_peers=hung_by_peers)
               for s in failed]
    else:
        failed = errors
        how = [f"rank {s['rank']}: {s.get('error', 'failed')}" for s in failed]
    return {
        "plan": plan, "status": "failed", "world_size": run.world_size, "run": run.as_dict(),
        "failed_ranks": [s["rank"] for s in failed], "cause": how, "timed_out": timed_out or hung_by_peers,
        "launcher_exit_code": exit_code,
        "ranks": [{k: s.get(k) for k in ("rank", "pid", "state", "error")} for s in statuses],
        "log_tail": log_tail[-4000:],
    }


def torchrun_prefix(world: int, port: int) -> list[str]:
    """torchrun on this node only, its c10d rendezvous on the loopback interface, no restarts."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0"]


def rank_env(run_dir: Path, backend: str) -> dict[str, str]:
    """The ranks' environment: the run folder for their status files, one thread each on a CPU
    (many ranks on few cores), gloo's sockets bound to `lo`."""
    env = dict(os.environ, **{RUN_DIR_ENV: str(run_dir)})
    if backend == "gloo":
        env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def local_command(plan: Path, world: int, port: int, run_dir: Path, *, backend: str, scale: str, steps: int,
                  timeout_seconds: float, dtype: str = "plan",
                  device_memory_gib: float | None = None) -> tuple[list[str], dict[str, str]]:
    """torchrun's command line and environment for a single-node run. Everything listens on the
    loopback interface only: the c10d rendezvous endpoint is 127.0.0.1 and gloo's sockets
    are bound to `lo`, so no other host can join or talk to the ranks."""
    cmd = [*torchrun_prefix(world, port),
           "-m", "shardplan", "verify", str(plan), "--backend", backend, "--scale", scale, "--steps", str(steps),
           "--timeout", str(timeout_seconds), "--report", str(run_dir / "report.json"), "--dtype", dtype]
    if device_memory_gib is not None:
        cmd += ["--device-memory-gib", repr(float(device_memory_gib))]
    return cmd, rank_env(run_dir, backend)


PHASES = {  # a rank's status file `phase` -> what rank 0 is doing then (session.py)
    "reference": "running the unsharded single-process reference",
    "compare": "comparing with the cost model",
}


def status_events(seen: dict[int, tuple[Any, Any]], statuses: list[dict[str, Any]], world: int) -> list[str]:
    """Lines for what changed in the ranks' status files since `seen` (rank -> (state, phase)),
    which it updates: a rank started, finished its run, raised, or rank 0 entered a phase. A
    change missed between two looks (started and done at once) still gives its lines."""
    out: list[str] = []
    for st in statuses:
        r = st["rank"]
        state, phase = st.get("state"), st.get("phase")
        before_state, before_phase = seen.get(r, ("not started", None))
        if (state, phase) == (before_state, before_phase):
            continue
        seen[r] = (state, phase)
        if before_state == "not started" and state != "not started":
            out.append(f"rank {r} started ({sum(1 for k in seen.values() if k[0] != 'not started')}/{world})")
        if state == "done" and before_state != "done":
            out.append(f"rank {r} finished its run ({sum(1 for k in seen.values() if k[0] == 'done')}/{world})")
        if state == "done" and phase is not None and phase != before_phase:
            out.append(f"rank {r}: {PHASES.get(phase, phase)}")
        if state == "error":
            first = str(st.get("error") or "error").splitlines()[0][:200]
            out.append(f"rank {r} failed: {first}")
    return out


def _watch(proc: subprocess.Popen, run_dir: Path, world: int, timeout_seconds: float,
           on_event: Progress | None = None) -> tuple[int | None, dict[int, float]]:
    """Wait for torchrun (exit code, or None past the timeout), noting when each rank's process
    was first seen gone: when a rank is killed, torchrun then terminates its peers before they
    can say why, and only the order of the deaths tells the root cause from the collateral.
    `on_event` gets a line for each change of a rank's status."""
    deadline = time.monotonic() + timeout_seconds
    died_at: dict[int, float] = {}
    seen: dict[int, tuple[Any, Any]] = {}
    while True:
        try:
            return proc.wait(timeout=WATCH_INTERVAL_SECONDS), died_at
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if now >= deadline:
                return None, died_at
            statuses = _statuses(run_dir, world)
            for st in statuses:
                if st.get("pid") and st["rank"] not in died_at and not _alive(st["pid"]):
                    died_at[st["rank"]] = now
            if on_event is not None:
                for line in status_events(seen, statuses, world):
                    on_event(line)


def out_of_memory_report(statuses: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The report of the first rank that ran out of memory (its status file holds it), with the
    other such ranks' measurements and lines added; None when none did."""
    failed = sorted((s for s in statuses if s.get("state") == "oom" and isinstance(s.get("report"), dict)),
                    key=lambda s: (s.get("time", 0), s["rank"]))
    if not failed:
        return None
    report = dict(failed[0]["report"])
    for other in failed[1:]:
        theirs = other["report"]
        report["ranks"] = [*report["ranks"], *theirs["ranks"]]
        report["mismatches"] = [*report["mismatches"], *theirs["mismatches"]]
        report["probes"] = [*report["probes"], *theirs["probes"]]
    report["ranks"] = sorted(report["ranks"], key=lambda r: r["rank"])
    report["oom"] = dict(report["oom"], out_of_memory_ranks=sorted(s["rank"] for s in failed))
    return report


RENDEZVOUS_ATTEMPTS = 2


def _lost_rendezvous(code: int | None, statuses: list[dict[str, Any]], log_path: Path) -> bool:
    """torchrun failed in its rendezvous, before any rank wrote a status: the free port picked
    for its store was taken by another process in between (a race with concurrent runs)."""
    if code in (None, 0) or any(s.get("pid") for s in statuses):
        return False
    log = log_path.read_text(errors="replace")
    return "RendezvousConnectionError" in log or "address already in use" in log.lower()


@dataclass(frozen=True)
class TorchrunOutcome:
    """How one torchrun launch ended: its exit code (None: stopped at the timeout), each rank's
    status file, when ranks were seen gone, and where its log and files are."""

    code: int | None
    timed_out: bool
    statuses: list[dict[str, Any]]
    died_at: dict[int, float]
    run_dir: Path
    log_path: Path
    launched_at: float
    ended_at: float

    def failure(self, plan: str, run: RunSpec, timeout_seconds: float) -> dict[str, Any]:
        """The failure report of a launch that did not complete (`failure_report`)."""
        return failure_report(plan, run, self.statuses, timed_out=self.timed_out, timeout_seconds=timeout_seconds,
                              exit_code=self.code, log_tail=self.log_path.read_text(errors="replace"),
                              died_at=self.died_at, now=self.ended_at, launched_at=self.launched_at)


Command = Callable[[int, Path], tuple[list[str], dict[str, str]]]  # (port, run folder) -> torchrun line, environment


def run_torchrun(command: Command, world: int, *, backend: str, scale: str, timeout_seconds: float,
                 on_event: Progress | None = None) -> TorchrunOutcome:
    """Start `world` ranks here through torchrun (`command` gives its line for a free port and a
    fresh run folder) in their own session, watch them until they end or `timeout_seconds`
    pass, then kill the session. A rendezvous lost to a port race is launched again once."""
    for attempt in range(RENDEZVOUS_ATTEMPTS):
        run_dir = Path(tempfile.mkdtemp(prefix="shardplan-verify-"))
        cmd, env = command(_free_port(), run_dir)
        log_path = run_dir / "torchrun.log"
        launched_at = time.time()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            if on_event is not None:
                on_event(f"launched {world} rank(s) with torchrun ({backend}, {scale} model); logs in {run_dir}")
            try:
                code, died_at = _watch(proc, run_dir, world, timeout_seconds, on_event)
                ended_at = time.time()  # when the launcher saw the end or gave up, before the kill
            finally:
                _kill_session(proc)
                proc.wait()
        statuses = _statuses(run_dir, world)
        if not _lost_rendezvous(code, statuses, log_path) or attempt == RENDEZVOUS_ATTEMPTS - 1:
            break
        if on_event is not None:  # another launcher took the port between its pick and torchrun's bind
            on_event("torchrun lost its rendezvous store before any rank started; launching again on a new port")
    for s in statuses:  # a rank that left the session would still be caught here
        if s.get("pid") and _alive(s["pid"]):
            try:
                os.kill(s["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    return TorchrunOutcome(code=code, timed_out=code is None, statuses=statuses, died_at=died_at, run_dir=run_dir,
                           log_path=log_path, launched_at=launched_at, ended_at=ended_at)


def launch_local(plan: Path, run: RunSpec, *, backend: str, scale: str, steps: int, timeout_seconds: float,
                 on_event: Progress | None = None, dtype: str = "plan",
                 device_memory_gib: float | None = None) -> dict[str, Any]:
    """Start every rank here through torchrun and return rank 0's report, the report of a run
    that ran out of memory, or a failure report. `on_event` gets a line at the launch and for
    each change of a rank's status."""
    world = run.world_size

    def command(port: int, run_dir: Path) -> tuple[list[str], dict[str, str]]:
        return local_command(plan, world, port, run_dir, backend=backend, scale=scale, steps=steps,
                             timeout_seconds=timeout_seconds, dtype=dtype, device_memory_gib=device_memory_gib)

    out = run_torchrun(command, world, backend=backend, scale=scale, timeout_seconds=timeout_seconds,
                       on_event=on_event)
    report_path = out.run_dir / "report.json"
    oom = out_of_memory_report(out.statuses)
    if not out.timed_out and out.code == 0 and report_path.is_file():
        report = json.loads(report_path.read_text())
    elif oom is not None:
        report = oom
    else:
        report = out.failure(str(plan), run, timeout_seconds)
    report["pids"] = [s["pid"] for s in out.statuses if s.get("pid")]
    report["run_dir"] = str(out.run_dir)
    return report


def is_worker() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def verify_plan(plan: Path, *, backend: str, scale: str | None, steps: int, timeout_seconds: float,
                report_path: Path | None, on_event: Progress | None = None, dtype: str = "plan",
                device_memory_gib: float | None = None) -> VerifyReport | None:
    """Run `verify`. Returns the report (rank 0, the rank that ran out of memory, or the local
    launcher), None on other ranks; a report with status "oom" when a rank ran out of memory.
    Raises VerifyRunFailed after writing the report when the run did not complete otherwise.
    `on_event` (the local launcher only) gets one line per phase and per rank's status as it
    arrives. `dtype` is --dtype, `device_memory_gib` --device-memory-gib (runspec.plan_run)."""
    gpus = local_gpu_count()
    backend = resolve_backend(backend, gpus)
    scale = default_scale(scale, gpus)
    m, run = load_plan(plan, scale, steps, dtype, device_memory_gib)
    check_limit(run, hardware_for(m, run)[0], str(plan))
    if is_worker():
        world = int(os.environ["WORLD_SIZE"])
        if world != run.world_size:
            raise CannotVerify(f"WORLD_SIZE is {world} but the plan has {run.world_size} ranks", source=str(plan),
                               field="layout", hint="start tp x pp x cp x dp ranks in all")
        from shardplan.verify.session import RunOutOfMemory, run_worker  # torch: imported only in a rank

        try:
            report = run_worker(m, run, plan=str(plan), backend=backend, timeout_seconds=timeout_seconds)
        except RunOutOfMemory as e:
            report = e.report
    else:
        check_hostable(run, backend, gpus)
        report = launch_local(plan, run, backend=backend, scale=scale, steps=steps, timeout_seconds=timeout_seconds,
                              on_event=on_event, dtype=dtype, device_memory_gib=device_memory_gib)
    if report is None:
        return None
    if report_path is not None:
        write_text_atomic(report_path, json.dumps(report, indent=2) + "\n")
    if report["status"] == "failed":
        raise VerifyRunFailed("; ".join(report["cause"]) or "the run failed", source=str(plan),
                              hint=f"see {report.get('run_dir', 'the ranks logs')} and the report's log_tail")
    if on_event is not None:
        on_event(f"done: {report['status']}")
    return VerifyReport.model_validate(report)
