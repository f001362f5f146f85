"""Figures of recommend and estimate results, rendered to PNG or SVG bytes.

The only module that imports matplotlib, an optional extra (`pip install 'shardplan[plot]'`),
and only once a plot is asked for. It draws from the same typed results `--json` prints, with
matplotlib's object API on the Agg canvas: no pyplot state, no display. The bytes are
reproducible (no date or version in the metadata, fixed SVG ids) and SVG text stays text.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from shardplan.cost.report import TrainingTimeReport
from shardplan.errors import ShardplanError
from shardplan.units import bytes_to_gib

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from shardplan.cost.report import CostReport, PlanReport
    from shardplan.search.results import ParetoPoint, RecommendResult

PLOT_FORMATS = {".png": "png", ".svg": "svg"}
INSTALL_HINT = "pip install 'shardplan[plot]' (matplotlib)"
DPI = 120
SIZE_INCHES = (8.0, 5.0)
# Colours of the memory components (matplotlib's tab10), fixed so every plot reads the same.
COMPONENT_COLORS = {
    "weights": "#1f77b4",
    "kv_cache": "#2ca02c",
    "activations": "#ff7f0e",
    "gradients": "#9467bd",
    "optimizer_states": "#8c564b",
    "temporary": "#e377c2",
    "overhead": "#7f7f7f",
}
PICK_COLOR = "#d62728"
_METADATA = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None}}


def plot_format(path: Path) -> str:
    """png or svg, from the file's suffix; anything else is bad input."""
    fmt = PLOT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ShardplanError(f"cannot tell the image format of {path.name!r} from its suffix", field="--plot",
                             hint="name the file .png or .svg")
    return fmt


def require_matplotlib() -> None:
    """Fail before any work when the plot extra is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ShardplanError("plotting needs matplotlib, which is not installed", field="--plot",
                             hint=INSTALL_HINT) from None


def render(fig: Figure, fmt: str) -> bytes:
    """The figure as PNG or SVG bytes."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "shardplan"}):
        fig.savefig(buf, format=fmt, metadata=_METADATA[fmt])
    return buf.getvalue()


def _figure() -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained")
    return fig, fig.add_subplot()


def _pick_label(plan: PlanReport) -> str:
    from shardplan.search.explain import describe

    return "pick: " + describe(plan)


def _point_label(p: ParetoPoint) -> str:
    """GPUs and formats: what tells two frontier points apart at a glance."""
    weights = "bf16" if p.quantization == "none" else p.quantization
    return f"{p.num_gpus} GPUs, tp{p.tp}, {weights}/kv {p.kv_cache_dtype}, b{p.batch_size}"


def recommend_figure(result: RecommendResult) -> Figure:
    """Serving: the Pareto frontier on the two quantities it is chosen on (search/serving.py,
    `pareto_front`): request latency (end to end) against output tokens/s per GPU, each point
    labelled with its GPUs and formats, the pick at its own (throughput, latency) point.
    Training: the best step time found at each GPU count, pick marked."""
    top = result.top
    if not top:
        raise ShardplanError("nothing fits, so there is nothing to plot", field="--plot",
                             hint="see the suggestions, or drop --plot")
    pick = top[0]
    fig, ax = _figure()
    if isinstance(pick.time, TrainingTimeReport):
        pts = result.best_per_num_gpus
        ax.plot([p.num_gpus for p in pts], [p.step_seconds for p in pts], "o-", color="#1f77b4",
                label=f"best plan at each GPU count ({result.objective})", gid="best-per-gpu-count")
        x, y = pick.num_gpus, pick.time.step_seconds
        ax.set_xlabel("GPUs")
        ax.set_ylabel("step time (s)")
        if len(pts) > 2 and pts[-1].num_gpus >= 8 * pts[0].num_gpus:
            ax.set_xscale("log", base=2)  # counts double, and the step halves with them
            ax.set_yscale("log")
        ax.set_xticks([p.num_gpus for p in pts], [str(p.num_gpus) for p in pts])
        ax.minorticks_off()
        title = "step time against GPU count"
    else:
        pts = sorted(result.pareto, key=lambda p: p.throughput_tokens_per_second_per_gpu)
        ax.plot([p.throughput_tokens_per_second_per_gpu for p in pts], [p.e2e_latency_seconds for p in pts],
                "o-", color="#1f77b4", label="Pareto frontier (request latency vs output tokens/s per GPU)",
                gid="pareto-frontier")
        for p in pts:
            ax.annotate(_point_label(p), (p.throughput_tokens_per_second_per_gpu, p.e2e_latency_seconds),
                        xytext=(4, -10), textcoords="offset points", fontsize=7, color="#1f77b4")
        x, y = pick.time.throughput_tokens_per_second_per_gpu, pick.time.e2e_latency_seconds
        ax.set_xlabel("output tokens/s per GPU (all replicas' throughput / GPUs)")
        ax.set_ylabel("request latency, end to end (s)")
        title = "serving Pareto frontier"
    ax.plot([x], [y], "*", color=PICK_COLOR, markersize=16, label=_pick_label(pick.plan), zorder=3, gid="pick")
    ax.annotate("pick", (x, y), xytext=(-10, 10), textcoords="offset points", ha="right", fontsize=9,
                color=PICK_COLOR, fontweight="bold")
    ax.set_title(f"{result.model} on {result.hardware}: {title}")
    ax.grid(True, alpha=0.3)
    ax.margins(0.08)
    ax.legend(fontsize=8, loc="best")
    return fig


def estimate_figure(report: CostReport) -> Figure:
    """Per-GPU memory of each pipeline stage as stacked bars by component, against the device's
    capacity (and, serving, vLLM's budget). Interleaved stages name each layer chunk."""
    ranks = report.memory.per_rank
    capacity = report.hardware.memory_capacity_bytes
    names = [f"stage {r.stage}\nlayers " + ", ".join(f"{a}-{b}" for a, b in r.layer_chunks) for r in ranks]
    fig, ax = _figure()
    bottoms = [0.0] * len(ranks)
    for comp, color in COMPONENT_COLORS.items():
        heights = [bytes_to_gib(r.per_gpu_bytes[comp]) for r in ranks]
        if not any(heights):
            continue
        bars = ax.bar(names, heights, bottom=bottoms, color=color, label=comp.replace("_", " "), width=0.6)
        for r, bar in zip(ranks, bars):
            bar.set_gid(f"{comp}-stage-{r.stage}")  # an id in the SVG
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.axhline(bytes_to_gib(capacity), color="black", linewidth=1.5, label=f"device memory {bytes_to_gib(capacity):.1f} GiB",
               gid="capacity")
    if report.workload.kind == "inference":
        ax.axhline(bytes_to_gib(report.memory.budget_bytes), color="black", linestyle="--", linewidth=1,
                   label=f"vLLM budget {report.workload.gpu_memory_utilization:g} x device")
    p = report.plan
    layout = " ".join(f"{k}={getattr(p, k)}" for k in ("tp", "pp", "dp", "cp", "ep") if getattr(p, k) > 1) or "one GPU"
    verdict = "fits" if report.fits else "does not fit"
    ax.set_title(f"{report.model.name} on {report.hardware.num_gpus} x {report.hardware.name} "
                 f"({layout}, {report.workload.kind}): {verdict}", fontsize=10)
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_ylim(0, max(max(bottoms), bytes_to_gib(capacity)) * 1.15)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def write_plot(path: Path, fig: Figure) -> None:
    """Render by the suffix of `path` and write it atomically."""
    from shardplan.fileio import write_bytes_atomic

    write_bytes_atomic(path, render(fig, plot_format(path)))
