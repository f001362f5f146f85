"""The search's progress bar: decided once, when the search has run PROGRESS_AFTER_SECONDS; on a
stderr that is no terminal (a pipe, CI, `--json | jq`) no console is built at all (rich's import and
its terminal checks on every one of a long search's thousands of updates cost ~0.1-0.3 s)."""

from __future__ import annotations

import io

import shardplan.cli.render_common as rc


class _Stderr(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _clock(monkeypatch, times: list[float]) -> None:
    it = iter(times)
    monkeypatch.setattr(rc.time, "monotonic", lambda: next(it))


def test_a_pipe_gets_no_bar_and_no_console(monkeypatch):
    monkeypatch.setattr(rc.sys, "stderr", _Stderr(tty=False))
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(var, raising=False)
    made: list[bool] = []
    monkeypatch.setattr(rc, "_console", lambda **kw: made.append(True))
    monkeypatch.delitem(rc.__dict__, "err_console", raising=False)
    # the start, then 1,000 updates all past the threshold
    _clock(monkeypatch, [0.0] + [10.0] * 1000)
    with rc.progress("searching") as update:
        for i in range(1000):
            update(i, 1000)
    assert made == []
    assert rc.sys.stderr.getvalue() == ""


def test_the_decision_is_taken_once(monkeypatch):
    """A variable rich reads (FORCE_COLOR) sends the decision to rich, once: not on every update."""
    monkeypatch.setattr(rc.sys, "stderr", _Stderr(tty=False))
    monkeypatch.setenv("FORCE_COLOR", "")  # rich: an empty FORCE_COLOR is not a terminal
    asked: list[bool] = []

    class _Console:
        @property
        def is_terminal(self) -> bool:
            asked.append(True)
            return False

    monkeypatch.setattr(rc, "_err", lambda: _Console())
    _clock(monkeypatch, [0.0, 0.1] + [10.0] * 50)
    with rc.progress("searching") as update:
        for i in range(51):
            update(i, 51)
    assert asked == [True]


def test_a_terminal_gets_the_bar_after_the_threshold(monkeypatch):
    """rich says terminal (TTY_COMPATIBLE=1 forces it on a pipe): the bar starts, once, after the threshold."""
    monkeypatch.setattr(rc.sys, "stderr", _Stderr(tty=False))
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    started: list[str] = []

    class _Bar:
        def __init__(self, *a, **kw) -> None:
            pass

        def start(self) -> None:
            started.append("start")

        def add_task(self, label, total):  # noqa: ANN001, ANN201
            return 0

        def update(self, task, completed, total) -> None:  # noqa: ANN001
            started.append(f"{completed}/{total}")

        def stop(self) -> None:
            started.append("stop")

    import rich.progress

    monkeypatch.setattr(rich.progress, "Progress", _Bar)
    monkeypatch.delitem(rc.__dict__, "err_console", raising=False)
    _clock(monkeypatch, [0.0, 0.1, 0.2, 1.0, 1.5])
    with rc.progress("searching") as update:
        for i in range(4):
            update(i, 4)
    assert started == ["start", "2/4", "3/4", "stop"]
