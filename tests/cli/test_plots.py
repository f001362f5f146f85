"""`--plot` on estimate and recommend through the real CLI: the files are valid PNG (magic
bytes, IHDR size) and SVG (XML with an <svg> root), the SVG's marks are the JSON's numbers
(bar heights against the capacity line, one frontier marker per Pareto point, the pick's
label), the bytes are reproducible, and the failures are one line with exit 2."""

from __future__ import annotations

import re
import struct
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from shardplan.cli.plots import DPI, SIZE_INCHES
from shardplan.search.explain import describe

SVG = "{http://www.w3.org/2000/svg}"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PARTS = ("weights", "kv_cache", "activations", "gradients", "optimizer_states", "temporary", "overhead")


def _ok(res, code=0):
    assert res.exit_code == code, (res.exit_code, res.stderr)
    return res.json()


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _svg(path: Path) -> ET.Element:
    root = ET.fromstring(path.read_bytes())
    assert root.tag == SVG + "svg"
    return root


def _texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(SVG + "text")]


def _group(root: ET.Element, gid: str) -> ET.Element:
    found = [g for g in root.iter(SVG + "g") if g.get("id") == gid]
    assert len(found) == 1, gid
    return found[0]


def _ys(group: ET.Element) -> list[float]:
    """The y coordinates of the path in a group (a bar's rectangle, a horizontal line)."""
    d = next(group.iter(SVG + "path")).get("d")
    nums = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", d)]
    return nums[1::2]


def _one_line_error(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.stdout[-300:], res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


EST = ("estimate", "llama-3.1-70b", "--hardware", "h100-sxm-80gb", "--gpus", "8", "--tp", "4", "--pp", "2",
       "--max-model-len", "8192")


def test_estimate_png_is_a_png_of_the_stated_size_and_stdout_stays_json(cli, tmp_path):
    out = tmp_path / "memory.png"
    rep = _ok(cli(*EST, "--plot", str(out), "--json"))
    assert rep["fits"]
    assert _png_size(out) == (int(SIZE_INCHES[0] * DPI), int(SIZE_INCHES[1] * DPI))


def test_estimate_svg_bars_are_the_reported_bytes_against_capacity(cli, tmp_path):
    out = tmp_path / "memory.svg"
    res = cli(*EST, "--plot", str(out), "--json")
    rep = _ok(res)
    assert f"plot written to {out}" in res.stderr
    root = _svg(out)
    texts = _texts(root)
    assert {"stage 0", "layers 0-39", "stage 1", "layers 40-79"} <= {line for t in texts for line in t.splitlines()}
    assert any("fits" in t and "tp=4 pp=2" in t for t in texts)
    assert "vLLM budget 0.92 x device" in texts
    capacity = rep["hardware"]["memory_capacity_bytes"]
    zero_px = max(_ys(_group(root, "weights-stage-0")))  # bars start at 0 GiB
    cap_px = _ys(_group(root, "capacity"))[0]
    px_per_byte = (zero_px - cap_px) / capacity
    drawn = 0
    for rank in rep["memory"]["per_rank"]:
        top_px = zero_px
        for part in PARTS:
            b = rank["per_gpu_bytes"][part]
            gid = f"{part}-stage-{rank['stage']}"
            if not any(r["per_gpu_bytes"][part] for r in rep["memory"]["per_rank"]):
                assert not [g for g in root.iter(SVG + "g") if g.get("id") == gid]
                continue
            ys = _ys(_group(root, gid))
            assert max(ys) - min(ys) == pytest.approx(b * px_per_byte, abs=1e-3)
            assert max(ys) == pytest.approx(top_px, abs=1e-3)  # stacked on the part below
            top_px = min(ys)
            drawn += 1
        # the stack's top is the rank's total
        assert zero_px - top_px == pytest.approx(rank["per_gpu_bytes"]["total"] * px_per_byte, abs=1e-3)
    assert drawn == 2 * 4  # weights, KV cache, activations, overhead on each of 2 stages


def test_estimate_plot_of_a_plan_that_does_not_fit_is_still_written(cli, tmp_path):
    out = tmp_path / "overflow.svg"
    rep = _ok(cli("estimate", "llama-3.1-70b", "--gpus", "1", "--max-model-len", "8192", "--plot", str(out), "--json"), code=3)
    assert not rep["fits"]
    root = _svg(out)
    assert any("does not fit" in t for t in _texts(root))
    zero_px = max(_ys(_group(root, "weights-stage-0")))
    cap_px = _ys(_group(root, "capacity"))[0]
    weights_top = min(_ys(_group(root, "weights-stage-0")))
    assert weights_top < cap_px  # the 16-bit weights alone rise above the device's memory
    assert (zero_px - weights_top) / (zero_px - cap_px) == pytest.approx(
        rep["memory"]["per_gpu_bytes"]["weights"] / rep["hardware"]["memory_capacity_bytes"], rel=1e-5)


def test_recommend_serving_svg_draws_the_frontier_and_marks_the_pick(cli, tmp_path):
    out = tmp_path / "frontier.svg"
    d = _ok(cli("recommend", "llama-3.1-8b", "--objective", "throughput", "--gpus", "2", "--max-model-len", "8192", "--plot", str(out), "--json"))
    root = _svg(out)
    pick = d["top"][0]
    texts = _texts(root)
    assert "pick: " + describe(pick["plan"]) in texts
    assert "pick" in texts and any("serving Pareto frontier" in t for t in texts)
    # the axes are the two quantities `pareto_front` chooses on: latency and tokens/s per GPU
    assert "output tokens/s per GPU (all replicas' throughput / GPUs)" in texts
    assert "request latency, end to end (s)" in texts and "time per output token (ms)" not in texts
    frontier = _group(root, "pareto-frontier")
    marks = [(float(u.get("x")), float(u.get("y"))) for u in frontier.iter(SVG + "use")]
    assert len(marks) == len(d["pareto"]) >= 2
    for p in d["pareto"]:  # every point says its GPUs and formats
        assert any(t.startswith(f"{p['num_gpus']} GPUs, tp{p['tp']}, ") and f"b{p['batch_size']}" in t for t in texts)
    picks = [(float(u.get("x")), float(u.get("y"))) for u in _group(root, "pick").iter(SVG + "use")]
    assert len(picks) == 1
    # the pick sits on its own frontier point when it is one (same per-GPU throughput and latency)
    t = pick["time"]
    on = [i for i, p in enumerate(sorted(d["pareto"], key=lambda p: p["throughput_tokens_per_second_per_gpu"]))
          if p["throughput_tokens_per_second_per_gpu"] == pytest.approx(t["throughput_tokens_per_second_per_gpu"], rel=1e-9)
          and p["e2e_latency_seconds"] == pytest.approx(t["e2e_latency_seconds"], rel=1e-9)]
    assert on, "the throughput pick of this case is the frontier's highest-throughput point"
    assert picks[0] == pytest.approx(marks[on[0]], abs=1e-3)


def test_recommend_training_png_and_the_best_step_at_each_count(cli, tmp_path):
    png, svg = tmp_path / "steps.png", tmp_path / "steps.svg"
    args = ("recommend", "llama-3.1-8b", "--workload", "training", "--max-gpus", "16", "--seq-len", "2048",
            "--global-batch-size", "64", "--json")
    d = _ok(cli(*args, "--plot", str(png)))
    assert _png_size(png) == (int(SIZE_INCHES[0] * DPI), int(SIZE_INCHES[1] * DPI))
    best = d["best_per_num_gpus"]
    # No one-GPU plan: the default stack (torchtitan) offloads only FSDP2 shards (dp > 1), and 8B's
    # training states do not fit one 80 GB GPU without offload.
    assert d["gpu_counts"] == [1, 2, 4, 8, 16] and [b["num_gpus"] for b in best] == [2, 4, 8, 16]
    # the pick is the best plan found at its own count, and more GPUs never make the best step slower here
    at_pick = next(b for b in best if b["num_gpus"] == d["top"][0]["num_gpus"])
    assert at_pick["step_seconds"] == pytest.approx(d["top"][0]["time"]["step_seconds"], rel=1e-12)
    steps = [b["step_seconds"] for b in best]
    assert steps == sorted(steps, reverse=True)
    _ok(cli(*args, "--plot", str(svg)))
    root = _svg(svg)
    assert len(list(_group(root, "best-per-gpu-count").iter(SVG + "use"))) == len(best)
    assert "pick: " + describe(d["top"][0]["plan"]) in _texts(root)


def test_the_same_inputs_give_the_same_bytes(cli, tmp_path):
    for suffix in ("png", "svg"):
        a, b = tmp_path / f"a.{suffix}", tmp_path / f"b.{suffix}"
        _ok(cli(*EST, "--plot", str(a), "--json"))
        _ok(cli(*EST, "--plot", str(b), "--json"))
        assert a.read_bytes() == b.read_bytes()


def test_unknown_suffix_is_bad_input_before_any_work(cli, tmp_path):
    out = tmp_path / "memory.pdf"
    res = cli(*EST, "--plot", str(out), "--json")
    _one_line_error(res, "--plot", "memory.pdf", ".png or .svg")
    assert res.stdout == "" and not out.exists()


def test_missing_matplotlib_says_how_to_install_it(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "frontier.png"
    res = cli("recommend", "llama-3.1-8b", "--gpus", "1", "--plot", str(out), "--json")
    _one_line_error(res, "matplotlib", "pip install 'shardplan[plot]'")
    assert res.stdout == "" and not out.exists()


def test_a_folder_that_does_not_exist_is_one_line(cli, tmp_path):
    res = cli(*EST, "--plot", str(tmp_path / "missing" / "memory.png"), "--json")
    _one_line_error(res, "cannot write")


def test_only_the_plot_module_imports_matplotlib():
    pkg = Path(__file__).resolve().parents[2] / "shardplan"
    imports = re.compile(r"^\s*(import|from) matplotlib\b", re.M)
    users = sorted(p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py") if imports.search(p.read_text()))
    assert users == ["cli/plots.py"]
