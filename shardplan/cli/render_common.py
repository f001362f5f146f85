"""Shared rendering: the console (stdout) and err_console (stderr), `--json` output,
number formats, progress, error lines. Renderers take a command's result and print it; they
compute nothing.

rich is imported when something is rendered with it: `console` and `err_console` are made on
first use (module `__getattr__`), so `--json`, which writes with `json`, never loads it."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from shardplan import units

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

# Piped output (`| tee`, `| less`, CI logs) is read later, at any width: render it at a fixed
# wide width, not rich's 80-column default, so tables keep one row per line. COLUMNS, when
# exported, still wins; a terminal uses its own width.
PIPED_WIDTH_COLUMNS = 200


def _console(*, stderr: bool = False) -> Console:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and "COLUMNS" not in os.environ
    return Console(stderr=stderr, width=PIPED_WIDTH_COLUMNS if piped else None)


def __getattr__(name: str) -> Any:
    """`console` and `err_console`, made on first use and kept (PEP 562)."""
    if name in ("console", "err_console"):
        made = globals()[name] = _console(stderr=name == "err_console")
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _stderr_is_terminal() -> bool:
    """rich's `is_terminal` for stderr, without building a console (and importing rich) where
    nothing could make it one: stderr is not a TTY and no variable rich reads says otherwise."""
    if not sys.stderr.isatty() and not any(v in os.environ for v in ("FORCE_COLOR", "TTY_COMPATIBLE")):
        return False
    return _err().is_terminal


def _out() -> Console:
    return sys.modules[__name__].console  # type: ignore[no-any-return]


def _err() -> Console:
    return sys.modules[__name__].err_console  # type: ignore[no-any-return]


PROGRESS_AFTER_SECONDS = 0.5  # searches shorter than this show no bar


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def emit(obj: Any, as_json: bool, table: Callable[[Any], None]) -> None:
    """A command's result: the JSON object with --json, else its rich rendering."""
    if as_json:
        print_json(obj)
    else:
        table(obj)


def fmt_count(n: float | None) -> str:
    if n is None:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}"
    return f"{n:.0f}"


def fmt_gib(n_bytes: float | None) -> str:
    if n_bytes is None:
        return "-"
    return f"{units.bytes_to_gib(n_bytes):.2f} GiB"


def fmt_rate_gb(n_bytes_per_second: float) -> str:
    return f"{n_bytes_per_second / units.BYTES_PER_GB:,.0f} GB/s"


def error_line(text: str) -> None:
    from rich.text import Text

    # The message is plain text: brackets in it (a pip extra, a list) are not rich markup.
    _err().print(Text.assemble(("error:", "red"), " ", text), highlight=False, soft_wrap=True)


def file_written(path: Any, what: str) -> None:
    """A side file (a plot) was written: a log line on stderr, so stdout stays data."""
    _err().print(f"{what} written to {path}", markup=False, highlight=False, soft_wrap=True)


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.2f} ms"
    return f"{s * 1e6:,.1f} us"


def breakdown_table(title: str, columns: dict[str, dict[str, float]]) -> Table:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("")
    for name in columns:
        t.add_column(name, justify="right")
        t.add_column("share", justify="right")
    keys = [k for k in next(iter(columns.values())) if k != "total"]
    for k in keys:
        if not any(col[k] for col in columns.values()):
            continue
        cells: list[str] = []
        for col in columns.values():
            cells += [fmt_seconds(col[k]), f"{100 * col[k] / col['total']:.1f}%" if col["total"] else "-"]
        t.add_row(k.replace("_", " "), *cells)
    total_cells: list[str] = []
    for col in columns.values():
        total_cells += [f"[bold]{fmt_seconds(col['total'])}[/bold]", "100%"]
    t.add_row("[bold]total[/bold]", *total_cells)
    return t


@contextmanager
def progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback for long searches: a transient bar on stderr that appears only once
    the search has run for PROGRESS_AFTER_SECONDS (quick searches print nothing)."""
    start = time.monotonic()
    bar: Progress | None = None
    task = None
    shown: bool | None = None  # decided once, when the search has run PROGRESS_AFTER_SECONDS

    def update(done: int, total: int) -> None:
        nonlocal bar, task, shown
        if bar is None:
            if shown is False or time.monotonic() - start < PROGRESS_AFTER_SECONDS:
                return
            shown = _stderr_is_terminal()
            if not shown:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=_err(),
                           transient=True)
            bar.start()
            task = bar.add_task(label, total=total)
        bar.update(task, completed=done, total=total)  # type: ignore[arg-type]

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()


def fmt_bytes(n_bytes: float) -> str:
    """GiB from 1 GiB up, else MiB (a proxy model's tensors are megabytes)."""
    if n_bytes >= units.BYTES_PER_GIB:
        return fmt_gib(n_bytes)
    return f"{n_bytes / units.BYTES_PER_MIB:.2f} MiB"


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def fmt_degrees(plan: dict[str, Any]) -> str:
    """A layout's degrees in a few characters: tp, pp, dp, and what else is on."""
    parts = [f"tp{plan['tp']}", f"pp{plan['pp']}", f"dp{plan.get('dp', plan.get('replicas', 1))}"]
    parts += [f"{k}{plan[k]}" for k in ("cp", "ep") if plan.get(k, 1) > 1]
    if plan.get("zero_stage"):
        parts.append(f"zero{plan['zero_stage']}")
    return " ".join(parts)


def fitted_table(title: str, columns: list[tuple[str, str, int]], rows: list[list[str]],
                 caption: str | None = None) -> Table:
    """A table that fits the console: each column is (header, justify, priority); cells are
    never truncated to `...`; instead the highest-priority-number columns are dropped until the
    rest fit (priority 0 is never dropped: identifiers such as the layout), and the caption
    says which were left out."""
    from rich.table import Table

    console = _out()
    def width(i: int) -> int:
        return max([len(columns[i][0])] + [len(row[i]) for row in rows]) + 3  # padding and a border

    keep = list(range(len(columns)))
    for i in sorted(keep, key=lambda i: (-columns[i][2], -i)):
        if sum(width(j) for j in keep) + 1 <= console.width or columns[i][2] == 0:
            break
        keep.remove(i)
    dropped = [columns[i][0] for i in range(len(columns)) if i not in keep]
    note = f"(narrow terminal: {', '.join(dropped)} left out; --json has every figure)" if dropped else None
    t = Table(title=title, title_justify="left", caption=" ".join(x for x in (caption, note) if x) or None,
              caption_justify="left")
    # If what is never dropped is still wider than the console, the widest such column wraps at
    # its spaces (every word shown) rather than be cropped at the edge.
    wraps = max(keep, key=width) if sum(width(j) for j in keep) + 1 > console.width else None
    for i in keep:
        if i == wraps:
            t.add_column(columns[i][0], justify=columns[i][1], overflow="fold")  # type: ignore[arg-type]
        else:
            t.add_column(columns[i][0], justify=columns[i][1], no_wrap=True, min_width=width(i) - 3)  # type: ignore[arg-type]
    for row in rows:
        t.add_row(*[row[i] for i in keep])
    return t


_LOAD_NAMES = {"ttft_p50": "median TTFT", "tpot_p50": "median TPOT", "itl_p50": "median ITL",
               "output_tokens_per_second": "output tokens/s"}


def load_band_line(bands: list[Any] | None) -> str:
    """'measured error (shardplan validate): median TTFT ±86.2% (mean -75%), ... over 6 vLLM V1 ...
    serving benchmark runs below saturation'; '' without load bands."""
    from shardplan.cost.accuracy import band_cases

    found = [b for b in bands or [] if b.quantity in _LOAD_NAMES]
    if not found:
        return ""
    # by the cases each band is over (a calibrated profile's own runs may measure only some figures)
    groups: dict[str, list[str]] = {}
    unknown = []
    for b in found:
        if b.band_abs_error is None:
            unknown.append(f"{_LOAD_NAMES[b.quantity]}: {b.note}")
            continue
        groups.setdefault(band_cases(b), []).append(
            f"{_LOAD_NAMES[b.quantity]} ±{100 * b.band_abs_error:.0f}% (mean {100 * (b.mean_signed_error or 0):+.0f}%)")
    if len(groups) == 1 and not unknown:
        (cases, parts), = groups.items()
        return f"measured error of the model under traffic ({cases}, `shardplan validate`): {', '.join(parts)}"
    segments = [f"{', '.join(parts)} ({cases})" for cases, parts in groups.items()] + unknown
    return f"measured error of the model under traffic (`shardplan validate`): {'; '.join(segments)}"
