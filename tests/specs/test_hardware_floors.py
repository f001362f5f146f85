"""A profile's rates and shares have floors (specs/hardware.py MIN_*): far below any device, high
enough that every figure the cost model derives stays a finite float. At the floors a serving and a
training estimate give finite numbers; below them the profile is refused in one line naming the
field, exit 2 (a bandwidth of 1e-300 GB/s had overflowed the roofline's square: "internal error")."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import yaml

from shardplan.specs import hardware

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "hardware_profiles" / "h100-sxm-80gb.yaml").read_text())

RATES = [("gpu", "memory_bandwidth_gb_per_s"), ("node", "intra_node_link", "bandwidth_gb_per_s"),
         ("node", "inter_node_link", "bandwidth_gb_per_s"), ("node", "host_link", "bandwidth_gb_per_s")]
SHARES = [("efficiency", k) for k in ("matmul", "memory_bandwidth", "intra_node_link", "inter_node_link", "host_link",
                                      "nvme", "overlap_compute_share")] + [("gpu", "power_limited_compute_fraction")]


def _set(data, path, value):
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _at_floors() -> dict:
    data = copy.deepcopy(BASE)
    for dtype in data["gpu"]["peak_dense_tflops"]:
        data["gpu"]["peak_dense_tflops"][dtype] = hardware.MIN_TFLOPS
    for path in RATES:
        _set(data, path, hardware.MIN_BANDWIDTH_GB_PER_S)
    for path in SHARES:
        _set(data, path, hardware.MIN_FRACTION)
    return data


def _numbers(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _numbers(v)
    elif isinstance(node, list):
        for v in node:
            yield from _numbers(v)
    elif isinstance(node, float):
        yield node


@pytest.mark.parametrize("args", [
    ["llama-3.1-70b", "--gpus", "8", "--tp", "8"],
    ["llama-3.1-8b", "--gpus", "2", "--tp", "2", "--workload", "training", "--seq-len", "2048", "--global-batch-size", "8"],
])
def test_every_figure_is_finite_at_the_floors(cli, tmp_path, args):
    profile = tmp_path / "slow.yaml"
    profile.write_text(yaml.safe_dump(_at_floors()))
    res = cli("estimate", *args, "-H", str(profile), "--json")
    assert res.exit_code in (0, 3), res.stderr
    report = json.loads(res.stdout)
    values = list(_numbers(report))
    assert values and all(math.isfinite(v) for v in values if not math.isnan(v))
    seconds = report["time"].get("step_seconds") or report["time"].get("tpot_seconds")
    assert seconds > 1e3  # a millionth of a TFLOP/s and of a GB/s: a step takes long, but a number


@pytest.mark.parametrize("path", [("gpu", "peak_dense_tflops", "bf16"), *RATES, *SHARES,
                                  ("node", "nvme_bandwidth_gb_per_s")])
def test_a_rate_or_share_below_its_floor_is_refused_naming_the_field(cli, tmp_path, path):
    data = copy.deepcopy(BASE)
    _set(data, path, 1e-300)
    profile = tmp_path / "hw.yaml"
    profile.write_text(yaml.safe_dump(data))
    res = cli("estimate", "llama-3.1-8b", "-H", str(profile), "--gpus", "1")
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.stderr
    assert str(profile) in lines[0] and path[-1] in lines[0]


def test_no_nvme_is_still_zero(cli, tmp_path):
    data = copy.deepcopy(BASE)
    data["node"]["nvme_bandwidth_gb_per_s"] = 0
    profile = tmp_path / "hw.yaml"
    profile.write_text(yaml.safe_dump(data))
    assert cli("estimate", "llama-3.1-8b", "-H", str(profile), "--gpus", "1", "--json").exit_code == 0
