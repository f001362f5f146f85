"""Work ahead of an in-order search on the machine's other cores.

The serving search costs its points one by one in a fixed order (the highest bound first), and
whether it costs a point at all depends on the points before it (a point whose bound cannot
reach the top plans is left out). Costing a point is a pure function of the point: its
simulation reads nothing the search changes. So while the search costs one point, forked
worker processes cost the next ones it is likely to want; the search then takes their answers
in its own order and applies each exactly as if it had costed it itself, and drops an answer
for a point it leaves out. The results, their order and every count are those of the search on
one core (tests/search/test_ahead.py compares the two); only the wall time changes.

Workers are forked (Linux), so they start with the search's state and receive only a point's index
(and, where the search gives one, a hint read at that moment: `in_order`'s `hint`). How many is the
caller's to say (`Space.workers`; 0, the default, runs everything in this process): the command line
gives `search_workers()`, which `SHARDPLAN_SEARCH_WORKERS` sets (0: one core) and otherwise is one
fewer than the cores this process may run on, at most MAX_WORKERS. Where fork is not available, or a
worker fails or dies, the search costs the point itself. The pool is this module's alone: the search
hands it a pure function of an index and reads the answers back in its own order.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator
from multiprocessing.pool import AsyncResult
from typing import Any

from shardplan.errors import ShardplanError

WORKERS_ENV = "SHARDPLAN_SEARCH_WORKERS"
MAX_WORKERS = 7

# A worker's task: each worker sets it from its pool's start arguments, which a forked process
# inherits as they are (nothing shared between two pools started at once in two threads).
_TASK: Callable[[int], Any] | None = None
# How often a wait for a worker's answer looks whether a worker died (its answer would never come).
LIVENESS_SECONDS = 0.25


def search_workers() -> int:
    """How many worker processes a search may fork (module docstring)."""
    raw = os.environ.get(WORKERS_ENV)
    if raw is not None and raw.strip() != "":
        try:
            wanted = int(raw)
        except ValueError:
            raise ShardplanError(f"{WORKERS_ENV}={raw!r} is not a whole number", field=WORKERS_ENV,
                                 hint="set it to 0 (no workers) or a count of worker processes") from None
        if wanted < 0:
            raise ShardplanError(f"{WORKERS_ENV}={raw!r} is negative", field=WORKERS_ENV,
                                 hint="set it to 0 (no workers) or a count of worker processes")
        return min(wanted, MAX_WORKERS) if _can_fork() else 0
    if not _can_fork():
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(0, min(MAX_WORKERS, cores - 1))


def _can_fork() -> bool:
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _worker_start(task: Callable[[int], Any]) -> None:
    """In a worker: its task. Ctrl-C is the search's to handle (it stops the workers), so a worker
    ignores it; and it writes nothing: a worker whose search was killed (SIGTERM to that process
    alone) finds its pipe closed when it answers, and ends there without a traceback."""
    global _TASK
    _TASK = task
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    os.close(quiet)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the worker's for its life


def _run(i: int, args: tuple[Any, ...]) -> tuple[bool, Any]:
    try:
        assert _TASK is not None
        return True, _TASK(i, *args)
    except BaseException:  # noqa: BLE001 - the search costs the point itself and raises what it raises
        return False, None


class _Raised:
    """An exception this process met computing an index ahead of its turn, raised at that turn."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


SKIPPED = object()  # `in_order`'s answer for an index its `keep` left out
QUEUED_PER_WORKER = 2  # indices given to each worker at a time: the next waits in its queue, so it never idles


def in_order(indices: list[int], task: Callable[..., Any], workers: int, keep: Callable[[int], bool] | None = None,
             worth: Callable[[int], bool] | None = None,
             hint: Callable[[int], Any] | None = None) -> Iterator[tuple[int, Any]]:
    """(i, task(i)) for each index in the order given, or (i, SKIPPED) where `keep(i)` is false when
    its turn comes; the consumer may change what `keep` answers between items (a search's top plans
    after each point), as long as an index it leaves out stays left out. Up to `workers` forked
    processes compute the indices after the current one that `keep` still takes and `worth` says
    are worth a worker (not a memo hit), and this process computes a later one while a worker has
    the current one; each index is computed once, and an answer is used only at its turn. With
    `hint`, task(i, hint(i)), hint(i) read in this process when i's computation starts (a worker's
    own copy of the consumer's state is the one it was forked with)."""
    keep = keep or (lambda i: True)
    worth = worth or (lambda i: True)

    def args_of(i: int) -> tuple[Any, ...]:
        return () if hint is None else (hint(i),)

    ahead = None
    if workers > 0 and _can_fork() and sum(1 for i in indices if worth(i)) >= 2:
        try:
            ahead = Ahead(task, workers)
        except (OSError, ImportError):  # no processes or semaphores to be had here: one core
            ahead = None
    if ahead is None:
        for i in indices:
            yield (i, task(i, *args_of(i))) if keep(i) else (i, SKIPPED)
        return
    done: dict[int, Any] = {}  # answers this process computed ahead of their turn

    def ahead_of_turn(j: int) -> Any:
        try:
            return task(j, *args_of(j))
        except Exception as e:  # noqa: BLE001 - raised at j's turn, if j is not left out by then
            return _Raised(e)

    def upcoming(pos: int, most: int) -> list[int]:
        """Up to `most` of the indices after position `pos` that are still to be computed."""
        found: list[int] = []
        for j in indices[pos + 1:]:
            if len(found) >= most:
                break
            if j not in done and not ahead.started(j) and worth(j) and keep(j):
                found.append(j)
        return found

    with ahead:
        for pos, i in enumerate(indices):
            if not keep(i):
                ahead.drop(i)
                done.pop(i, None)
                yield i, SKIPPED
                continue
            while i not in done:
                later = upcoming(pos, ahead.free() + 1)  # for the idle workers, and one for this process
                for j in later[:ahead.free()]:
                    ahead.start(j, args_of(j))
                later = [j for j in later if not ahead.started(j)]
                if not ahead.started(i):
                    done[i] = task(i, *args_of(i))
                elif ahead.ready(i) or not later:
                    ok, got = ahead.take(i)
                    done[i] = got if ok else task(i, *args_of(i))
                else:
                    done[later[0]] = ahead_of_turn(later[0])
            got = done.pop(i)
            if isinstance(got, _Raised):
                raise got.error
            yield i, got


class Ahead:
    """Forked workers that compute `task(i)` for indices given to them, answers kept by index. If a
    worker dies (killed, out of memory), the answers still owed are not waited for: `take` says
    they failed, and nothing more is given to the workers."""

    def __init__(self, task: Callable[[int], Any], workers: int) -> None:
        before = {p.pid for p in multiprocessing.active_children()}
        self._pool = multiprocessing.get_context("fork").Pool(workers, initializer=_worker_start, initargs=(task,))
        self._pids = {p.pid for p in multiprocessing.active_children()} - before  # this pool's workers
        self.workers = workers
        self._started: dict[int, AsyncResult] = {}
        self.broken = False

    def _running(self) -> int:
        return sum(1 for r in self._started.values() if not r.ready())

    def free(self) -> int:
        """How many more indices the workers may be given now (QUEUED_PER_WORKER each)."""
        return 0 if self.broken else max(0, QUEUED_PER_WORKER * self.workers - self._running())

    def start(self, i: int, args: tuple[Any, ...] = ()) -> None:
        """Give `i` to the workers: task(i, *args)."""
        if not self.broken:
            self._started[i] = self._pool.apply_async(_run, (i, args))

    def started(self, i: int) -> bool:
        return i in self._started

    def ready(self, i: int) -> bool:
        return self._started[i].ready()

    def take(self, i: int) -> tuple[bool, Any]:
        """(True, the answer) once the worker has it (waits for it); (False, None) if it failed or
        a worker died meanwhile."""
        r = self._started.pop(i)
        while not r.ready():
            if self.broken or not self._pids <= {p.pid for p in multiprocessing.active_children()}:
                self.broken = True  # the pool replaces a dead worker, but what it held is lost
                return False, None
            r.wait(LIVENESS_SECONDS)
        try:
            return r.get()
        except Exception:  # noqa: BLE001 - an answer that could not come back (not picklable): computed here
            return False, None

    def drop(self, i: int) -> None:
        self._started.pop(i, None)

    def close(self) -> None:
        """Stop the workers at once: answers nobody took are not wanted."""
        self._pool.terminate()
        self._pool.join()

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
