"""`tasks.watch`: recorded real /metrics pages (tests/data/metrics, sources in SOURCES.md) parsed,
mapped to a plan's ranks and replicas and held against its bands; Prometheus' histogram_quantile;
the names by version in knowledge/metrics.yaml; the fetch edge's bounds against a local HTTP
server on 127.0.0.1. Where a test changes a recorded page it says which value."""

from __future__ import annotations

import contextlib
import gc
import io
import math
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from conftest import REPO, build_plan

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload
from shardplan.errors import InputFileError, ShardplanError
from shardplan.knowledge.load import metrics_file
from shardplan.knowledge.schema import parse_version
from shardplan.plan.manifest import write_manifest
from shardplan.tasks import watch as w

PAGES = REPO / "tests" / "data" / "metrics"
SGLANG = (PAGES / "sglang_docs_llama31_8b.txt").read_bytes()
VLLM_RECENT = (PAGES / "vllm_recent_qwen3vl_235b_tp2.txt").read_bytes()
VLLM_09 = (PAGES / "vllm_0_9_cpu_qwen3_0_6b.txt").read_bytes()
DCGM = (PAGES / "dcgm_a100_pcie_idle.txt").read_bytes()
MIB = 2**20


# ----- plans, made by the real `recommend` (in-process) ----------------------------------------------

def recommend(path: Path, *args: str) -> Path:
    from shardplan.cli.main import main

    argv = sys.argv
    sys.argv = ["shardplan", "recommend", *args, "-o", str(path)]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main()
    except SystemExit as e:
        assert e.code in (0, None), (args, e.code)
    finally:
        sys.argv = argv
        gc.unfreeze()  # main() freezes what a command made, for a process about to exit
    return path


# SGLang 0.4.2, Llama 3.1 8B, one 80 GB H100: the deployment the SGLang docs page is from (its
# cache, 442,354 tokens, is an H100's: inferred, SOURCES.md).
# The page is of a benchmark run past saturation (most first tokens after 30 s): the plan's SLA limits TPOT
# only (not judged), the SLA tests below hold the page to a TTFT limit.
SGLANG_PLAN = ("llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", "--engine", "sglang", "--engine-version", "0.4.2",
               "--max-tpot-ms", "50")
# The recorded recent vLLM page's deployment: Qwen3 235B AWQ, tp 2, its flags (GPU inferred: two H200s).
QWEN_PLAN = ("qwen3-235b-a22b", "-H", "h200-sxm-141gb", "--gpus", "2", "--tp", "2", "--engine", "vllm", "--quantization",
             "awq", "--gpu-memory-utilization", "0.8", "--max-model-len", "32768", "--enforce-eager", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "8192")
A100_PLAN = ("llama-3.1-8b", "-H", "a100-pcie-80gb", "--gpus", "1", "--tp", "1", "--engine", "vllm")
H100_DP2_PLAN = ("llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "2", "--tp", "1", "--dp", "2", "--engine", "vllm")


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("plans")
    return {name: recommend(d / f"{name}.yaml", *args) for name, args in
            (("sglang", SGLANG_PLAN), ("qwen", QWEN_PLAN), ("a100", A100_PLAN), ("dp2", H100_DP2_PLAN))}


def scrape(plan: Path, pages: dict[str, bytes], map_path: Path | None = None, **kw) -> w.WatchScrape:
    return w.Watcher(plan, list(pages), map_path, fetch=lambda u: pages[u], **kw).scrape()


# ----- Prometheus' histogram_quantile ------------------------------------------------------------------

def test_a_plan_judged_under_traffic_is_shown_at_the_rate_to_plan_for(plans):
    """`recommend` judges serving plans under traffic: beside the measured TTFT and TPOT, a replica's
    row carries the plan's p50/p90/p99 at the rate to plan for (`predicted.load.plan_for`) and the
    replica's share of that rate, not the static batch's figures (one batch of max_num_seqs)."""
    from shardplan.plan.manifest import load_manifest

    m = load_manifest(plans["dp2"])
    assert m.predicted.load is not None and m.layout.dp == 2
    rate, ttft, tpot = m.predicted.load.plan_for
    assert rate is not None
    row = scrape(plans["dp2"], {"http://a/metrics": VLLM_RECENT}).replicas[0]
    assert row.predicted_request_rate_per_second == pytest.approx(rate / 2)
    assert row.ttft_predicted is not None and row.tpot_predicted is not None
    assert (row.ttft_predicted.p50_seconds, row.ttft_predicted.p90_seconds, row.ttft_predicted.p99_seconds) == \
        (ttft.p50, ttft.p90, ttft.p99)
    assert row.tpot_predicted.p90_seconds == tpot.p90 < 0.05  # within the default SLA
    assert row.ttft_predicted_seconds is None and row.tpot_predicted_seconds is None and row.predicted_batch_size is None


def test_histogram_quantile_interpolates_linearly_within_the_bucket():
    b = [(0.1, 1.0), (0.5, 3.0), (math.inf, 4.0)]
    assert w.histogram_quantile(0.5, b) == pytest.approx(0.1 + 0.4 * (2 - 1) / 2)  # rank 2 in (0.1, 0.5]
    assert w.histogram_quantile(0.1, b) == pytest.approx(0.1 * 0.4 / 1)  # the first bucket starts at 0
    assert w.histogram_quantile(0.99, b) == 0.5  # in +Inf: the highest finite bound
    assert w.histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None  # no observations
    assert w.histogram_quantile(0.5, [(0.1, 1.0), (0.5, 2.0)]) is None  # no +Inf bucket
    # non-monotonic counts are made monotonic (2, 2, 4): rank 2 lands at the top of the first bucket
    assert w.histogram_quantile(0.5, [(0.1, 2.0), (0.5, 1.0), (math.inf, 4.0)]) == pytest.approx(0.1)


def test_recorded_sglang_tpot_median_by_hand(plans):
    """TPOT p50 of the SGLang page: 7,400,757 observations, rank 3,700,378.5 falls in (0.075, 0.1]
    holding 4,950,195 - 433,413 of them: 0.075 + 0.025 x (3,700,378.5 - 433,413) / 4,516,782."""
    r = scrape(plans["sglang"], {"http://a/metrics": SGLANG})
    tpot = r.replicas[0].tpot
    assert tpot is not None and tpot.metric == "sglang:time_per_output_token_seconds"
    assert tpot.p50_seconds == pytest.approx(0.075 + 0.025 * (3_700_378.5 - 433_413) / (4_950_195 - 433_413))
    ttft = r.replicas[0].ttft
    assert ttft is not None and ttft.window == "since start"
    # 8,495 of 11,008 first tokens took over the 30 s bucket: p50 reads as 30 s, a lower bound
    assert ttft.p50_seconds == 30.0 and ttft.above_highest_bucket == 11008 - 2513 and ttft.highest_bucket_seconds == 30.0


# ----- the knowledge file ------------------------------------------------------------------------------

def test_vllm_kv_usage_name_follows_the_rename():
    k = metrics_file()
    names = lambda v: [m.name for m in k.names("vllm", "kv_usage_fraction", v)]  # noqa: E731
    assert names("0.6.4")[0] == "vllm:gpu_cache_usage_perc"
    assert names("0.21.0")[0] == "vllm:kv_cache_usage_perc"
    kv = next(m for m in k.metrics if m.name == "vllm:kv_cache_usage_perc")
    old = next(m for m in k.metrics if m.name == "vllm:gpu_cache_usage_perc")
    assert kv.since == "0.9.2" and "18354" in kv.source
    assert old.emitted_at(parse_version("0.10.2")) and not old.emitted_at(parse_version("0.11.0"))
    assert [m.name for m in k.names("vllm", "tpot_seconds", "0.11.0")][0] == "vllm:inter_token_latency_seconds"


def test_every_metric_rule_has_a_source_and_sane_range():
    k = metrics_file()
    assert {m.exporter for m in k.metrics} == {"vllm", "sglang", "dcgm"}
    for m in k.metrics:
        assert m.source.strip() and (m.range_established or m.note), m.name
    with pytest.raises(ValueError):
        type(k.metrics[0]).model_validate({**k.metrics[0].model_dump(), "since": "0.9", "until": "0.8"})
    with pytest.raises(ValueError):  # strict: a misspelt key is an error
        type(k.metrics[0]).model_validate({**k.metrics[0].model_dump(), "sorce": "x"})


def test_sources_md_names_every_recorded_page():
    listed = (PAGES / "SOURCES.md").read_text()
    for page in PAGES.glob("*.txt"):
        assert f"`{page.name}`" in listed, page.name


# ----- pages -> rows ----------------------------------------------------------------------------------

def test_sglang_docs_page_is_within_the_sglang_plan(plans):
    r = scrape(plans["sglang"], {"http://a/metrics": SGLANG})
    assert r.status == "ok" and w.exit_error(r) is None
    (rep,) = r.replicas
    assert rep.replica == 0 and rep.running_requests == 162 and rep.waiting_requests == 2826
    assert rep.kv_capacity_tokens == pytest.approx(123859 / 0.28)
    assert rep.kv_capacity_predicted_tokens is not None and rep.kv_band_abs_error is not None
    assert abs(rep.kv_capacity_predicted_tokens / rep.kv_capacity_tokens - 1) <= rep.kv_band_abs_error
    assert rep.kv_capacity_verdict == "within" and rep.kv_usage_verdict == "within"
    assert rep.kv_usage_ceiling_fraction == pytest.approx(162 * (1024 + 128) / rep.kv_capacity_predicted_tokens)


def test_one_changed_value_puts_the_replica_outside(plans):
    """The SGLang page with sglang:token_usage changed from 0.28 to 0.95 (the only change): the
    cache the page implies is 123,859 / 0.95 tokens, and 162 requests fill it past the plan's ceiling."""
    page = SGLANG.replace(b'sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28',
                          b'sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.95')
    assert page != SGLANG
    r = scrape(plans["sglang"], {"http://a/metrics": page})
    assert r.status == "outside"
    rep = r.replicas[0]
    assert rep.kv_capacity_verdict == "outside" and rep.kv_usage_verdict == "outside"
    err = w.exit_error(r)
    assert isinstance(err, w.OutsideBand) and err.exit_code == 4
    line = err.one_line()
    assert "replica 0" in line and "130,378 tokens measured" in line and "442,669 predicted" in line


def test_recent_vllm_page_reads_the_new_names_and_fits_the_band(plans):
    r = scrape(plans["qwen"], {"http://v/metrics": VLLM_RECENT})
    (rep,) = r.replicas
    assert rep.engine == "0" and "vllm:kv_cache_usage_perc" in rep.metrics_read
    assert rep.kv_capacity_tokens == 551520  # kv_cache_size_tokens (= 34,470 blocks x 16)
    assert rep.kv_capacity_verdict == "within" and r.status == "ok"
    assert not any("emitted by" in n for n in rep.notes)  # the plan names 0.33.0, which emits this name


def test_old_vllm_page_on_a_cpu_backend_is_read_not_judged(plans):
    r = scrape(plans["a100"], {"http://v/metrics": VLLM_09})
    (rep,) = r.replicas
    assert "vllm:gpu_cache_usage_perc" in rep.metrics_read and "vllm:time_per_output_token_seconds" in rep.metrics_read
    assert "the page has vllm:gpu_cache_usage_perc, which vllm emits before 0.11.0; the plan names vllm 0.33.0" in rep.notes
    assert rep.kv_capacity_tokens == 2340 * 16 and rep.kv_capacity_verdict == "not judged"
    assert any("CPU-backend" in n for n in rep.notes)
    assert rep.ttft is not None and rep.ttft.num_observations == 69
    # 69 first tokens: rank 34.5 falls in (7.5, 10] holding 36 - 31: 7.5 + 2.5 x 3.5 / 5
    assert rep.ttft.p50_seconds == pytest.approx(7.5 + 2.5 * 3.5 / 5)


def test_utilization_other_than_the_plans_is_not_judged(plans):
    page = VLLM_RECENT.replace(b'gpu_memory_utilization="0.8"', b'gpu_memory_utilization="0.9"')  # the only change
    rep = scrape(plans["qwen"], {"http://v/metrics": page}).replicas[0]
    assert rep.kv_capacity_verdict == "not judged" and any("0.9" in n and "0.8" in n for n in rep.notes)


def test_an_engine_the_plan_was_not_sized_for_is_not_judged(plans):
    rep = scrape(plans["a100"], {"http://s/metrics": SGLANG}).replicas[0]
    assert rep.kv_capacity_verdict == rep.kv_usage_verdict == "not judged"
    assert any("sized by vllm" in n for n in rep.notes)


def test_idle_gpu_is_outside_the_plans_memory(plans):
    r = scrape(plans["a100"], {"http://d/metrics": DCGM})
    (g,) = r.gpus
    assert (g.rank, g.node, g.gpu, g.host) == (0, 0, "0", "nvidia-dcgm-exporter-d2khm")
    assert g.memory_used_bytes == 741 * MIB and g.memory_free_bytes == 80328 * MIB
    assert g.memory_verdict == "outside" and r.status == "outside"
    assert "GPU rank 0" in r.outside[0] and "0.72 GiB measured" in r.outside[0]


def test_memory_near_the_prediction_is_within(plans):
    """The DCGM page with DCGM_FI_DEV_FB_USED changed from 741 to the plan's total in MiB (the only change)."""
    from shardplan.plan.manifest import load_manifest

    total = load_manifest(plans["a100"]).predicted.memory.stages[0].per_gpu_bytes["total"]
    page = DCGM.replace(b"} 741\n", f"}} {round(total / MIB * 1.02)}\n".encode())
    (g,) = scrape(plans["a100"], {"http://d/metrics": page}).gpus
    assert g.memory_verdict == "within" and g.memory_error == pytest.approx(1 / 1.02 - 1, abs=1e-4)
    assert g.memory_band_abs_error is not None and 0 < g.memory_band_abs_error < 0.0887


def test_plan_without_bands_judges_nothing(tmp_path):
    m, _ = build_plan("llama-3.1-8b", 1, Layout(), InferenceWorkload(), hardware="a100-pcie-80gb")  # no engine version
    plan = tmp_path / "plan.yaml"
    write_manifest(m, plan)
    r = scrape(plan, {"http://d/metrics": DCGM, "http://s/metrics": SGLANG})
    assert r.status == "ok" and r.gpus[0].memory_verdict == "not judged"
    assert any("no KV-capacity band" in a for a in r.assumptions)


def test_nvlink_counter_rate_needs_two_scrapes(plans):
    """The DCGM page served twice, DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL changed from 0 to 9e10 bytes
    on the second (the only change), 10 s apart on a fake clock: 9e9 B/s."""
    assert DCGM.rstrip().endswith(b"} 0") and b"NVLINK_BANDWIDTH_TOTAL{" in DCGM.rstrip().splitlines()[-1]
    second = DCGM[: DCGM.rindex(b"} 0")] + b"} 90000000000\n"
    pages = {"http://d/metrics": DCGM}
    clock = iter([0.0, 0.0, 0.1, 10.0, 10.0, 10.1, 20.0]).__next__
    watcher = w.Watcher(plans["dp2"], ["http://d/metrics"], fetch=lambda u: pages[u], clock=clock)
    first = watcher.scrape()
    assert first.gpus[0].nvlink_total_bytes_per_second is None
    assert any("one scrape gives no rate" in n for n in first.gpus[0].notes)
    pages["http://d/metrics"] = second
    r = watcher.scrape()
    g = r.gpus[0]
    assert r.interval_seconds == pytest.approx(10.0)
    assert g.nvlink_total_bytes_per_second == pytest.approx(9e10 / 10.0)
    assert g.nvlink_bandwidth_fraction == pytest.approx(9e9 / (2 * 450e9))  # rx + tx over 2 x the H100's NVLink


def test_histograms_over_the_last_interval(plans):
    """The old vLLM page twice: the second with 10 more first tokens, all in the (0.75, 1] bucket
    (its buckets from 1.0 up and the count raised by 10: the only changes)."""
    def bumped(text: str) -> bytes:
        out = []
        for line in text.splitlines():
            if line.startswith("vllm:time_to_first_token_seconds_bucket") and not any(
                    f'le="{b}"' in line for b in ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1",
                                                  "0.25", "0.5", "0.75")) or line.startswith(
                    "vllm:time_to_first_token_seconds_count"):
                name, value = line.rsplit(" ", 1)
                line = f"{name} {float(value) + 10}"
            out.append(line)
        return ("\n".join(out) + "\n").encode()

    pages = {"http://v/metrics": VLLM_09}
    now = [100.0]
    watcher = w.Watcher(plans["a100"], list(pages), fetch=lambda u: pages[u], clock=lambda: now[0])
    first = watcher.scrape().replicas[0].ttft
    assert first is not None and first.observations_per_second is None  # no interval yet
    pages["http://v/metrics"] = bumped(VLLM_09.decode())
    now[0] += 4.0
    ttft = watcher.scrape().replicas[0].ttft
    assert ttft is not None and ttft.window == "last interval" and ttft.num_observations == 10
    assert ttft.p50_seconds == pytest.approx(0.75 + 0.25 * 5 / 10)
    assert ttft.observations_per_second == pytest.approx(10 / 4.0)  # requests started over the interval
    now[0] += 2.0  # nothing new: no request started, and the percentiles stay those since start
    idle = watcher.scrape().replicas[0].ttft
    assert idle is not None and idle.observations_per_second == 0.0 and idle.window == "since start"


# ----- mapping ---------------------------------------------------------------------------------------

def test_engines_in_metrics_order_are_the_replicas(plans):
    pages = {"http://e0/metrics": VLLM_RECENT, "http://e1/metrics": VLLM_RECENT, "http://e2/metrics": VLLM_RECENT}
    r = scrape(plans["dp2"], pages)
    assert [x.replica for x in r.replicas] == [0, 1, None]
    assert any("not mapped" in n for n in r.replicas[2].notes)


def test_map_file_places_gpus_and_replicas(plans, tmp_path):
    m = tmp_path / "map.yaml"
    m.write_text("gpus:\n  GPU-c89b14a3-ce7c-6725-8424-b55d37d9c332: 1\n"
                 "replicas:\n  - endpoint: http://e0/metrics\n    replica: 1\n  - endpoint: http://e1/metrics\n    replica: 0\n")
    r = scrape(plans["dp2"], {"http://d/metrics": DCGM, "http://e0/metrics": VLLM_RECENT, "http://e1/metrics": VLLM_RECENT}, m)
    assert [g.rank for g in r.gpus] == [1] and r.gpus[0].replica == 1
    assert {x.endpoint: x.replica for x in r.replicas} == {"http://e0/metrics": 1, "http://e1/metrics": 0}
    assert any("rank(s) 0" in n for n in r.notes)


@pytest.mark.parametrize("text, field", [
    ("gpus:\n  GPU-x: 7\n", "gpus.GPU-x"),  # the dp2 plan has 2 GPUs
    ("replicas:\n  - engine: '0'\n    replica: 2\n", "replicas.0.replica"),
    ("nodes:\n  host: 3\n", "nodes.host"),
    ("gpu:\n  GPU-x: 0\n", "gpu"),  # misspelt key
    ("replicas:\n  - replica: 0\n", "replicas.0"),  # nothing to match on
])
def test_map_file_is_strict(plans, tmp_path, text, field):
    m = tmp_path / "map.yaml"
    m.write_text(text)
    with pytest.raises(InputFileError) as e:
        w.Watcher(plans["dp2"], ["http://d/metrics"], m, fetch=lambda u: DCGM)
    assert e.value.field == field and e.value.source == str(m) and e.value.exit_code == 2


def test_multi_node_plan_needs_the_host_in_the_map(tmp_path):
    plan = recommend(tmp_path / "p.yaml", "llama-3.1-70b", "-H", "h100-sxm-80gb", "--gpus", "16", "--gpus-per-node", "8",
                     "--tp", "8", "--dp", "2", "--engine", "vllm")
    r = scrape(plan, {"http://d/metrics": DCGM})
    assert r.gpus[0].rank is None and any("not in the map file's nodes" in n for n in r.gpus[0].notes)
    m = tmp_path / "map.yaml"
    m.write_text("nodes:\n  nvidia-dcgm-exporter-d2khm: 1\n")
    assert scrape(plan, {"http://d/metrics": DCGM}, m).gpus[0].rank == 8


# ----- hostile pages -----------------------------------------------------------------------------------

def test_safe_text_escapes_what_a_terminal_would_run():
    s = w.safe_text('a"b\nc\x1b[31mred\x1b[0m\u202edir\u200b' + "x" * 500)
    assert "\x1b" not in s and "\n" not in s and "\u202e" not in s and "\u200b" not in s
    assert "\\x1b" in s and "\\u202e" in s and len(s) == w.MAX_LABEL_CHARS


def test_injected_labels_reach_no_result_raw(plans):
    """The DCGM page with its Hostname label replaced by quotes, an escaped newline, a raw ANSI
    escape and rich markup (the only change)."""
    page = DCGM.replace(b'Hostname="nvidia-dcgm-exporter-d2khm"', b'Hostname="x\\"y\\nz\x1b[2J[red]boom[/red]"')
    r = scrape(plans["a100"], {"http://d/metrics": page})
    text = r.model_dump_json()
    assert "\x1b" not in text and "\\u001b" not in text
    assert r.gpus[0].host == 'x"y\\x0az\\x1b[2J[red]boom[/red]'


@pytest.mark.parametrize("mutate, needle", [
    (lambda p: p.replace(b"} 741\n", b"} NaN\n"), "is nan"),
    (lambda p: p.replace(b"} 741\n", b"} +Inf\n"), "is inf"),
    (lambda p: p + b"\x00\x01\x02", "binary data"),
    (lambda p: p + b"\xff\xfe", "not UTF-8"),
    (lambda p: p + b"DCGM_FI_DEV_FB_USED{gpu=\"1\" 5\n", "not a Prometheus text page"),
    (lambda p: b"a 1\n" * (w.MAX_SERIES + 1), "series"),
    (lambda p: b"<html><body>not metrics</body></html>\n", "not a Prometheus text page"),
    (lambda p: b"# HELP up 1\nup 1\n", "no vLLM, SGLang or DCGM series"),
])
def test_unreadable_pages_end_with_one_line(plans, mutate, needle):
    r = scrape(plans["a100"], {"http://d/metrics": mutate(DCGM)})
    assert r.status == "unreadable" and r.gpus == []
    err = w.exit_error(r)
    assert isinstance(err, w.EndpointUnreadable) and err.exit_code == 5
    line = err.one_line()
    assert needle in line and "\n" not in line and "(fix: " in line  # each names what to do


def test_a_million_series_is_refused_before_parsing():
    page = b"vllm:num_requests_running 1\n" * 1_000_000
    t = time.monotonic()
    with pytest.raises(w.EndpointUnreadable, match="over 100,000 series"):
        w.decode_page(page, "http://x/metrics")
    assert time.monotonic() - t < 2.0


# ----- the fetch edge, against a local server ---------------------------------------------------------

class _Server:
    """An HTTP server on 127.0.0.1 (an ephemeral port) in a thread; `routes` maps a path to bytes or
    to a callable(handler) for odd behaviours."""

    def __init__(self, routes: dict[str, bytes | Callable]) -> None:
        routes_ = routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = routes_.get(self.path)
                if body is None:
                    self.send_error(404)
                elif callable(body):
                    body(self)
                else:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # the client closing early (a page over the limit) is the point of those tests

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    servers = []

    def start(routes):
        s = _Server(routes)
        servers.append(s)
        return s.url

    yield start
    for s in servers:
        s.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream_without_length(total: int) -> Callable:
    def send(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.end_headers()
        chunk = b"a" * (1 << 20)
        try:
            for _ in range(total // len(chunk) + 1):
                h.wfile.write(chunk)
        except OSError:
            pass
    return send


def _slow(h: BaseHTTPRequestHandler) -> None:
    time.sleep(2.0)


def _trickle(h: BaseHTTPRequestHandler) -> None:
    """Headers, no length, then a few bytes every 0.2 s for far longer than a page may take."""
    h.send_response(200)
    h.end_headers()
    try:
        for _ in range(100):
            h.wfile.write(b"# x\n")
            h.wfile.flush()
            time.sleep(0.2)
    except OSError:
        pass


def _redirect_to_file(h: BaseHTTPRequestHandler) -> None:
    h.send_response(302)
    h.send_header("Location", "file:///etc/passwd")
    h.end_headers()


def test_fetch_reads_a_recorded_page(server):
    url = server({"/metrics": DCGM})
    assert w.fetch_page(url + "/metrics") == DCGM


@pytest.mark.parametrize("route, kw, needle", [
    ("/missing", {}, "HTTP 404"),
    ("/big", {}, "over the 16,777,216-byte limit"),
    ("/stream", {}, "over the 16,777,216-byte limit"),
    ("/slow", {"timeout_seconds": 0.3}, "timed out"),
    ("/redirect", {}, "HTTP 302"),
    ("/trickle", {"deadline_seconds": 1.0}, "took over 1 s"),  # each read within the socket timeout, the page not
])
def test_fetch_bounds(server, route, kw, needle):
    big = b"a" * (w.MAX_PAGE_BYTES + 1)
    url = server({"/big": big, "/stream": _stream_without_length(w.MAX_PAGE_BYTES + 2 * 2**20), "/slow": _slow,
                  "/redirect": _redirect_to_file, "/trickle": _trickle})
    t = time.monotonic()
    with pytest.raises(w.EndpointUnreadable) as e:
        w.fetch_page(url + route, **kw)
    assert needle in e.value.one_line() and time.monotonic() - t < 5.0


def test_fetch_refused_connection():
    with pytest.raises(w.EndpointUnreadable, match="cannot connect"):
        w.fetch_page(f"http://127.0.0.1:{_closed_port()}/metrics")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://x/metrics", "http:///metrics", "localhost:9400/metrics"])
def test_only_http_urls(url):
    with pytest.raises(ShardplanError) as e:
        w.check_url(url)
    assert e.value.field == "--metrics" and e.value.exit_code == 2


# ----- TTFT against the plan's SLA ------------------------------------------------------------------------

# 1,000 first tokens: 500 within 0.25 s, 800 within 0.5, 900 within 1, 990 within 2.5, ten after.
_TTFT = [(0.25, 500.0), (0.5, 800.0), (1.0, 900.0), (2.5, 990.0), (math.inf, 1000.0)]


@pytest.mark.parametrize("percentile,limit,verdict,within,over", [
    (90, 1.0, "within", 900, 100),      # 900 of 1,000 at most 1 s: the p90 is
    (90, 0.5, "outside", 800, 200),     # at most 800 within 0.5 s (a bound): 200 certainly over
    (90, 0.4, "outside", 500, 200),     # at most 800 within 0.4 s: those past 0.5 s are certainly over
    (90, 0.75, "not judged", 800, 100),  # 800 certainly within, up to 900 may be: the bucket (0.5, 1] decides
    (99, 2.5, "within", 990, 10),
    (99, 1.0, "outside", 900, 100),
    (50, 0.25, "within", 500, 500),
    (99, 5.0, "within", 990, 0),        # past the highest finite bound: only the +Inf bucket's ten may be over
])
def test_sla_check_decides_what_the_buckets_decide(percentile, limit, verdict, within, over):
    c = w.sla_check(percentile, limit, _TTFT, "last interval", "m")
    assert (c.verdict, c.within_at_least, c.over_at_least, c.num_observations) == (verdict, within, over, 1000)
    q = w.histogram_quantile(percentile / 100, _TTFT)  # Prometheus' reading agrees where the buckets decide
    assert q is not None
    if verdict == "outside":
        assert q > limit and f"at least {over:,} of 1,000 requests took longer" in c.note
    if verdict == "within":
        assert q <= limit


def test_sla_check_needs_two_requests_beyond_the_percentile():
    few = [(b, c / 100) for b, c in _TTFT]  # 10 requests
    assert w.sla_check(90, 0.25, few, "since start", "m").verdict == "not judged"  # a p90 needs 20
    assert w.sla_check(50, 0.25, few, "since start", "m").verdict == "within"  # a p50 needs 4
    assert w.sla_check(99, 1.0, [(b, c / 5) for b, c in _TTFT], "since start", "m").verdict == "outside"  # 200
    assert w.sla_check(99, 1.0, [(b, c / 6) for b, c in _TTFT], "since start", "m").verdict == "not judged"  # 167


@given(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=8), st.integers(min_value=1, max_value=99),
       st.floats(min_value=0.001, max_value=20, allow_nan=False), st.integers(min_value=0, max_value=20))
def test_a_decided_sla_check_agrees_with_histogram_quantile(counts, percentile, limit, past):
    """Whatever the bucket counts, percentile and requests past the last finite bound: outside means
    Prometheus' quantile is above the limit, within at or under it."""
    bounds = [0.1 * 2 ** i for i in range(len(counts))]
    cum, total = [], 0.0
    for b, c in zip(bounds, counts):
        total += c
        cum.append((b, total))
    buckets = cum + [(math.inf, total + past)]
    c = w.sla_check(percentile, limit, buckets, "last interval", "m")
    q = w.histogram_quantile(percentile / 100, buckets)
    if c.verdict == "outside":
        assert q is not None and q > limit
    elif c.verdict == "within":
        assert q is not None and q <= limit
    assert c.within_at_least + c.over_at_least <= c.num_observations


def test_the_recorded_sglang_page_breaks_the_default_sla_and_a_quiet_interval_meets_it(tmp_path):
    """The SGLang docs page's deployment under the default SLA (p90 TTFT 1 s): since its start, 27 of its
    11,008 first tokens came within 1 s (le="1.0"), so at least 10,981 came after. Then intervals of the
    same page with 40 more first tokens, all within 0.5 s (its TTFT buckets from 0.5 up and its count
    raised by 40 each time): with the page's 2,826 requests still waiting they do not decide the p90;
    with its queue gauge at 0 (sglang:num_queue_reqs, the other change) they meet it; an interval with
    no request judges nothing (the history was judged at the first scrape)."""
    plan = recommend(tmp_path / "default_sla.yaml", *SGLANG_PLAN[:-2])
    from shardplan.plan.manifest import load_manifest

    sla = load_manifest(plan).sla
    assert sla is not None and (sla.percentile, sla.max_ttft_seconds, sla.max_tpot_seconds, sla.defaulted) == \
        (90, 1.0, 0.05, True)
    pages = {"http://s/metrics": SGLANG}
    now = [0.0]
    watcher = w.Watcher(plan, list(pages), fetch=lambda u: pages[u], clock=lambda: now[0])
    first = watcher.scrape()
    row = first.replicas[0]
    assert row.ttft_sla is not None and row.ttft_sla.verdict == "outside" and row.ttft_sla.window == "since start"
    assert (row.ttft_sla.over_at_least, row.ttft_sla.num_observations) == (10981, 11008)
    assert first.status == "outside" and any("at least 10,981 of 11,008 requests took longer (the p90 allows 1,100) "
                                             "since the engine started" in line for line in first.outside)

    def bumped(text: str, more: int, waiting: float | None = None) -> str:
        out = []
        for line in text.splitlines():
            if line.startswith("sglang:time_to_first_token_seconds_bucket") and not any(
                    f'le="{b}"' in line for b in ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1",
                                                  "0.25")) or line.startswith("sglang:time_to_first_token_seconds_count"):
                name, value = line.rsplit(" ", 1)
                line = f"{name} {float(value) + more}"
            elif waiting is not None and line.startswith("sglang:num_queue_reqs{"):
                line = f"{line.rsplit(' ', 1)[0]} {waiting}"
            out.append(line)
        return "\n".join(out) + "\n"

    def next_scrape(text: str) -> w.WatchScrape:
        pages["http://s/metrics"] = text.encode()
        now[0] += 10.0
        return watcher.scrape()

    text = bumped(SGLANG.decode(), 40)
    second = next_scrape(text)
    c = second.replicas[0].ttft_sla
    assert c is not None and (c.window, c.verdict, c.within_at_least, c.num_observations) == \
        ("last interval", "not judged", 40, 40)
    assert "2,826 are still waiting" in c.note and any("SLA not judged" in n for n in second.replicas[0].notes)
    assert not any("TTFT" in line for line in second.outside)
    text = bumped(text, 40, waiting=0.0)
    third = next_scrape(text)
    c = third.replicas[0].ttft_sla
    assert c is not None and (c.window, c.verdict, c.within_at_least, c.num_observations) == ("last interval", "within", 40, 40)
    assert not any("TTFT" in line for line in third.outside)
    assert any("SLA (shardplan's default SLA, p90): TTFT <= 1,000 ms, TPOT <= 50 ms" in a for a in third.assumptions)
    assert third.replicas[0].tpot_sla is None  # SGLang's histograms are of inter-token gaps: TPOT is not judged
    idle = next_scrape(text)
    c = idle.replicas[0].ttft_sla
    assert c is not None and (c.window, c.verdict, c.num_observations) == ("last interval", "not judged", 0)
    assert idle.status == "ok" and idle.outside == []


def test_a_plan_without_an_sla_judges_no_latency(plans):
    """A plan ranked without latency limits (an older manifest has no `sla` either): the page's TTFT, far
    past any limit, is shown and not judged."""
    from shardplan.plan.manifest import load_manifest

    assert load_manifest(plans["qwen"]).sla is not None  # the default SLA, for contrast
    plan = recommend(plans["qwen"].parent / "throughput.yaml", *SGLANG_PLAN[:-2], "--objective", "throughput")
    assert load_manifest(plan).sla is None
    r = scrape(plan, {"http://s/metrics": SGLANG})
    row = r.replicas[0]
    assert row.ttft is not None and row.ttft.p50_seconds == 30.0  # past the highest bucket: read as its bound
    assert row.ttft_sla is None and row.tpot_sla is None and r.status == "ok"


def test_sla_check_refuses_counts_that_fall_with_their_bounds():
    c = w.sla_check(90, 0.5, [(0.25, 95.0), (0.5, 80.0), (math.inf, 100.0)], "since start", "m")
    assert c.verdict == "not judged" and "do not rise" in c.note
    c = w.sla_check(90, 0.5, [(0.25, 50.0), (0.5, 120.0), (math.inf, 100.0)], "since start", "m")
    assert c.verdict == "not judged" and "do not rise" in c.note


@pytest.mark.parametrize("percentile", range(1, 100))
def test_sla_check_compares_shares_exactly(percentile):
    """At an exact share (p of 100 requests within the limit) the percentile is met, whatever p: no float
    rounding of p / 100 x 100 tips it."""
    b = [(0.1, float(percentile)), (1.0, 100.0), (math.inf, 100.0)]
    needed = math.ceil(200 / (100 - percentile))
    scale = max(1, math.ceil(needed / 100))
    c = w.sla_check(percentile, 0.1, [(x, n * scale) for x, n in b], "since start", "m")
    assert c.verdict == "within", c.note


# vLLM's per-request TPOT histogram (vllm:request_time_per_output_token_seconds) appended to the recorded
# recent page: its bucket bounds as vllm/v1/metrics/loggers.py declares them, the counts ours (1,000
# finished requests: 700 within 25 ms, 850 within 50 ms, 950 within 75 ms, 990 within 100 ms).
_TPOT_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_COUNTS = {0.01: 100, 0.025: 700, 0.05: 850, 0.075: 950, 0.1: 990}


def _with_request_tpot(page: bytes, extra: int = 0) -> bytes:
    labels = 'engine="0",model_name="qwen3-vl-235b-awq"'
    lines = ["# TYPE vllm:request_time_per_output_token_seconds histogram"]
    for b in _TPOT_BOUNDS:
        count = next((c for bound, c in sorted(_TPOT_COUNTS.items()) if b <= bound), 1000) + extra
        lines.append(f'vllm:request_time_per_output_token_seconds_bucket{{{labels},le="{b}"}} {float(count)}')
    lines.append(f'vllm:request_time_per_output_token_seconds_bucket{{{labels},le="+Inf"}} {1000.0 + extra}')
    lines.append(f"vllm:request_time_per_output_token_seconds_count{{{labels}}} {1000.0 + extra}")
    return page.rstrip(b"\n") + b"\n" + ("\n".join(lines) + "\n").encode()


@pytest.mark.parametrize("limit_ms,verdict", [(50, "outside"), (100, "within"), (60, "not judged")])
def test_vllms_per_request_tpot_is_held_against_the_sla(tmp_path, limit_ms, verdict):
    """p90 TPOT: 850 of the 1,000 requests within 50 ms (fewer than 900: outside), 990 within 100 ms
    (within), and 60 ms inside the (50, 75] ms bucket that holds the p90 (not judged)."""
    plan = recommend(tmp_path / "q.yaml", *QWEN_PLAN, "--max-tpot-ms", str(limit_ms), "--max-ttft-ms", "60000")
    r = scrape(plan, {"http://q/metrics": _with_request_tpot(VLLM_RECENT)})
    row = r.replicas[0]
    assert row.request_tpot is not None and row.request_tpot.metric == "vllm:request_time_per_output_token_seconds"
    assert row.request_tpot.num_observations == 1000
    assert row.tpot_sla is not None and row.tpot_sla.verdict == verdict and row.tpot_sla.limit_seconds == limit_ms / 1e3
    if verdict == "outside":
        assert r.status == "outside" and any(
            f"p90 TPOT over the SLA's {limit_ms} ms: at least 150 of 1,000 requests took longer" in line for line in r.outside)
        assert not any("default SLA" in line for line in r.outside)  # the limits given
    else:
        assert not any("TPOT" in line for line in r.outside)
