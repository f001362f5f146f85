"""`shardplan watch` end to end: recorded real /metrics pages (tests/data/metrics, SOURCES.md)
served by an HTTP server on 127.0.0.1, the command run in-process, its `--json` lines parsed and
its exit codes checked: 0 within the bands, 4 a shard outside (named with its figures), 5 an
endpoint that cannot be read, 2 bad input. Hostile pages end with one line, fast and in bounded
memory. Where a test changes a recorded page it says which value."""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import REPO

PAGES = REPO / "tests" / "data" / "metrics"
SGLANG = (PAGES / "sglang_docs_llama31_8b.txt").read_bytes()
VLLM_RECENT = (PAGES / "vllm_recent_qwen3vl_235b_tp2.txt").read_bytes()
DCGM = (PAGES / "dcgm_a100_pcie_idle.txt").read_bytes()
HOSTILE_SECONDS = 8.0  # each ends in about a second here (a quadratic parse took minutes); the fetch deadline is 15 s
HOSTILE_PEAK_BYTES = 100 * 2**20


class _Server:
    """Serves `routes` (path -> bytes, replaceable between scrapes) on 127.0.0.1, an ephemeral port."""

    def __init__(self, routes: dict[str, bytes]) -> None:
        self.routes = routes
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = outer.routes.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *args) -> None:
                pass

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture
def serve():
    servers: list[_Server] = []

    def start(routes: dict[str, bytes]) -> _Server:
        servers.append(_Server(routes))
        return servers[-1]

    yield start
    for s in servers:
        s.httpd.shutdown()
        s.httpd.server_close()


def _plan(cli, path: Path, *args: str) -> Path:
    r = cli("recommend", *args, "-o", path)
    assert r.exit_code == 0, r.stderr
    return path


@pytest.fixture
def sglang_plan(cli, tmp_path):
    # SGLang 0.4.2, Llama 3.1 8B on one 80 GB H100: the docs page's deployment (GPU inferred, SOURCES.md).
    # The page is of a benchmark run past saturation (most first tokens after 30 s): the plan's SLA here
    # limits TPOT only (not judged: the page's histogram is of inter-token gaps);
    # `test_a_deployment_breaking_the_plans_sla_exits_4` holds the page to the default SLA's TTFT.
    return _plan(cli, tmp_path / "sglang.yaml", *SGLANG_ARGS, "--max-tpot-ms", "50")


SGLANG_ARGS = ("llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "1", "--engine", "sglang", "--engine-version", "0.4.2")


@pytest.fixture
def a100_plan(cli, tmp_path):
    return _plan(cli, tmp_path / "a100.yaml", "llama-3.1-8b", "-H", "a100-pcie-80gb", "--gpus", "1", "--tp", "1",
                 "--engine", "vllm")


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_healthy_sglang_deployment_exits_0(cli, serve, sglang_plan):
    s = serve({"/metrics": SGLANG})
    r = cli("watch", sglang_plan, "--metrics", s.url + "/metrics", "--once", "--json")
    assert r.exit_code == 0, r.stderr
    (out,) = _lines(r.stdout)  # one scrape, one JSON line
    assert out["status"] == "ok" and out["outside"] == []
    rep = out["replicas"][0]
    assert rep["kv_capacity_verdict"] == "within" and rep["kv_usage_verdict"] == "within"
    assert rep["kv_capacity_tokens"] == pytest.approx(123859 / 0.28) and rep["kv_capacity_predicted_tokens"] == 442669
    assert rep["tpot"]["metric"] == "sglang:time_per_output_token_seconds"
    # the plan's percentiles at its rate beside the measured ones, in the table as in --json
    from shardplan.cli.render_common import fmt_seconds

    text = " ".join(cli("watch", sglang_plan, "--metrics", s.url + "/metrics", "--once").stdout.split())
    plan = rep["ttft_predicted"]  # (a narrow terminal leaves the TPOT column out)
    assert f"(plan {fmt_seconds(plan['p50_seconds'])}/{fmt_seconds(plan['p90_seconds'])}/" in text, text
    assert f"at {rep['predicted_request_rate_per_second']:,.2f} req/s)" in text


def test_healthy_recent_vllm_deployment_exits_0(cli, serve, tmp_path):
    plan = _plan(cli, tmp_path / "q.yaml", "qwen3-235b-a22b", "-H", "h200-sxm-141gb", "--gpus", "2", "--tp", "2",
                 "--engine", "vllm", "--quantization", "awq", "--gpu-memory-utilization", "0.8", "--max-model-len",
                 "32768", "--enforce-eager", "--max-num-seqs", "4", "--max-num-batched-tokens", "8192")
    s = serve({"/metrics": VLLM_RECENT})
    r = cli("watch", plan, "--metrics", s.url + "/metrics", "--once", "--json")
    assert r.exit_code == 0, r.stderr
    rep = _lines(r.stdout)[0]["replicas"][0]
    assert rep["kv_capacity_tokens"] == 551520 and rep["kv_capacity_verdict"] == "within"
    assert "vllm:kv_cache_usage_perc" in rep["metrics_read"]


def test_kv_outside_its_band_exits_4_naming_the_replica(cli, serve, sglang_plan):
    """The SGLang page with sglang:token_usage changed from 0.28 to 0.95 (the only change)."""
    page = SGLANG.replace(b'Llama-3.1-8B-Instruct"} 0.28', b'Llama-3.1-8B-Instruct"} 0.95')
    assert page != SGLANG
    s = serve({"/metrics": page})
    r = cli("watch", sglang_plan, "--metrics", s.url + "/metrics", "--once", "--json")
    assert r.exit_code == 4
    out = _lines(r.stdout)[0]
    assert out["status"] == "outside" and len(out["outside"]) == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in r.stderr
    assert "replica 0" in err and "130,378 tokens measured" in err and "442,669 predicted ±7.3%" in err


def test_a_deployment_breaking_the_plans_sla_exits_4(cli, serve, tmp_path):
    """The SGLang page against a plan ranked within the default SLA (p90 TTFT 1 s): 27 of its 11,008
    first tokens within 1 s (le="1.0"); its KV figures are within their bands (the test above)."""
    plan = _plan(cli, tmp_path / "sla.yaml", *SGLANG_ARGS)
    s = serve({"/metrics": SGLANG})
    r = cli("watch", plan, "--metrics", s.url + "/metrics", "--once", "--json")
    assert r.exit_code == 4
    out = _lines(r.stdout)[0]
    rep = out["replicas"][0]
    assert rep["kv_capacity_verdict"] == "within" and rep["ttft_sla"]["verdict"] == "outside"
    assert (rep["ttft_sla"]["percentile"], rep["ttft_sla"]["limit_seconds"]) == (90, 1.0)
    assert out["status"] == "outside" and len(out["outside"]) == 1
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in r.stderr
    assert "replica 0" in err and "p90 TTFT over the SLA's 1,000 ms: at least 10,981 of 11,008 requests" in err
    assert "since the engine started (shardplan's default SLA" in err  # not the user's own limits
    table = cli("watch", plan, "--metrics", s.url + "/metrics", "--once")
    assert table.exit_code == 4
    text = " ".join(table.stdout.split())
    assert "latency against its SLA" in text and "OUTSIDE/-" in text and "at least 10,981 of 11,008" in text


def test_replan_keeps_the_sla_its_plan_was_ranked_within(cli, tmp_path):
    """A plan ranked within p99 TTFT 2 s and TPOT 40 ms, replanned from 2 GPUs to 4: the new plan records
    the same SLA, and its predicted load meets it."""
    old = _plan(cli, tmp_path / "old.yaml", "llama-3.1-8b", "-H", "h100-sxm-80gb", "--gpus", "2", "--engine", "vllm",
                "--max-ttft-ms", "2000", "--max-tpot-ms", "40", "--slo-percentile", "99")
    from shardplan.plan.manifest import load_manifest

    sla = load_manifest(old).sla
    assert sla is not None and (sla.percentile, sla.max_ttft_seconds, sla.max_tpot_seconds, sla.defaulted) == \
        (99, 2.0, 0.04, False)
    r = cli("replan", old, "--gpus", "4", "-o", tmp_path / "new.yaml", "--json")
    assert r.exit_code == 0, r.stderr
    new = load_manifest(tmp_path / "new.yaml")
    assert new.sla == sla and new.objective == "goodput"
    load = new.predicted.load
    assert load is not None and load.ttft_seconds is not None and load.tpot_seconds is not None
    assert load.ttft_seconds.p99 <= 2.0 and load.tpot_seconds.p99 <= 0.04
    shown = " ".join(cli("show", tmp_path / "new.yaml").stdout.split())
    assert "SLA it was ranked within: p99 TTFT <= 2.00 s, TPOT <= 40.00 ms" in shown and "default" not in shown


def test_replan_drops_a_default_sla_the_new_count_cannot_meet_and_any_sla_off_goodput(cli, tmp_path):
    """Llama 3.1 70B with 20,000-token prompts, ranked within the default SLA on 8 H100s: on 2 no layout
    prefills such a prompt within p90 TTFT 1 s, and the default is a preference (as recommend takes it):
    the new plan is ranked by goodput without it and records none. Ranked by throughput, a plan carries
    no SLA either."""
    from shardplan.plan.manifest import load_manifest

    old = _plan(cli, tmp_path / "old.yaml", "llama-3.1-70b", "-H", "h100-sxm-80gb", "--gpus", "8", "--input-len",
                "20000", "--output-len", "100")
    sla = load_manifest(old).sla
    assert sla is not None and sla.defaulted
    r = cli("replan", old, "--gpus", "2", "-o", tmp_path / "two.yaml", "--json")
    assert r.exit_code == 0, r.stderr
    two = load_manifest(tmp_path / "two.yaml")
    assert two.sla is None and two.objective == "goodput" and two.layout.tp * two.layout.pp * two.layout.dp == 2
    r = cli("replan", old, "--gpus", "16", "--objective", "throughput", "-o", tmp_path / "t.yaml", "--json")
    assert r.exit_code == 0, r.stderr
    assert load_manifest(tmp_path / "t.yaml").sla is None


def test_idle_gpu_exits_4_naming_the_rank(cli, serve, a100_plan):
    """The recorded DCGM page as it is: an idle A100 (741 MiB used) where the plan has an engine."""
    s = serve({"/metrics": DCGM})
    r = cli("watch", a100_plan, "--metrics", s.url + "/metrics", "--once")
    assert r.exit_code == 4
    assert "GPU rank 0" in r.stdout and "OUTSIDE" in r.stdout
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "GPU rank 0 (node 0, gpu 0" in err and "0.72 GiB measured" in err


def test_gpu_within_its_band_exits_0(cli, serve, a100_plan):
    """The DCGM page with DCGM_FI_DEV_FB_USED changed from 741 MiB to the plan's total (the only change)."""
    from shardplan.plan.manifest import load_manifest

    total = load_manifest(a100_plan).predicted.memory.stages[0].per_gpu_bytes["total"]
    s = serve({"/metrics": DCGM.replace(b"} 741\n", f"}} {round(total / 2**20)}\n".encode())})
    r = cli("watch", a100_plan, "--metrics", s.url + "/metrics", "--once", "--json")
    assert r.exit_code == 0, r.stderr
    g = _lines(r.stdout)[0]["gpus"][0]
    assert g["rank"] == 0 and g["memory_verdict"] == "within"
    assert any("one scrape gives no rate" in n for n in g["notes"])  # --once: the NVLink counter has no rate


def test_dead_endpoint_exits_5(cli, a100_plan):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = cli("watch", a100_plan, "--metrics", f"http://127.0.0.1:{port}/metrics", "--once", "--json")
    assert r.exit_code == 5
    assert _lines(r.stdout)[0]["status"] == "unreadable"
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot connect" in r.stderr and "Traceback" not in r.stderr


def test_two_scrapes_give_two_json_lines_and_a_rate(cli, serve, a100_plan):
    s = serve({"/metrics": DCGM})
    r = cli("watch", a100_plan, "--metrics", s.url + "/metrics", "--count", "2", "--interval", "0.5", "--json")
    first, second = _lines(r.stdout)
    assert (first["scrape_index"], second["scrape_index"]) == (0, 1)
    assert first["interval_seconds"] is None and second["interval_seconds"] >= 0.45
    assert not any("one scrape gives no rate" in n for n in second["gpus"][0]["notes"])
    assert r.exit_code == 4  # the idle GPU, both times


def _hostile_pages() -> dict[str, tuple[bytes, int, str]]:
    """path -> (page, exit code, what the one line says)."""
    injected = DCGM.replace(b'Hostname="nvidia-dcgm-exporter-d2khm"',
                            b'Hostname="a\\"b\\nc\x1b]0;pwned\x07\x1b[31m[bold]x[/bold]"')  # the only change
    return {
        "/huge": (b"# " + b"a" * (17 * 2**20) + b"\n", 5, "16,777,216-byte limit"),
        "/binary": (bytes(range(256)) * 4096, 5, "binary data"),
        "/million": (b"DCGM_FI_DEV_FB_USED 1\n" * 700_000, 5, "over 100,000 series"),  # 15 MB
        "/nan": (DCGM.replace(b"} 741\n", b"} NaN\n"), 5, "is nan"),
        "/inf": (DCGM.replace(b"} 741\n", b"} -Inf\n"), 5, "is -inf"),
        "/injected": (injected, 4, "GPU rank 0"),
        "/longline": (b'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="' + b"z" * (15 * 2**20) + b'"} 741\n', 5, "a line over"),
        "/manylong": ((b'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="' + b"z" * 60_000 + b'"} 741\n') * 250, 5,
                      "characters of vLLM, SGLang or DCGM series"),
    }


@pytest.mark.parametrize("path", list(_hostile_pages()))
def test_hostile_pages_end_with_one_line(cli, serve, a100_plan, path):
    page, code, needle = _hostile_pages()[path]
    s = serve({path: page})
    tracemalloc.start()
    t = time.monotonic()
    try:
        r = cli("watch", a100_plan, "--metrics", s.url + path, "--once")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    elapsed = time.monotonic() - t
    assert r.exit_code == code, (path, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in r.stderr, err
    for stream in (r.stdout, r.stderr):
        assert "\x1b" not in stream and "\x07" not in stream  # no raw escape reaches the terminal
    assert elapsed < HOSTILE_SECONDS, (path, elapsed)
    assert peak < HOSTILE_PEAK_BYTES, (path, peak)


def test_injected_label_is_escaped_in_json(cli, serve, a100_plan):
    page, _, _ = _hostile_pages()["/injected"]
    s = serve({"/metrics": page})
    r = cli("watch", a100_plan, "--metrics", s.url + "/metrics", "--once", "--json")
    host = _lines(r.stdout)[0]["gpus"][0]["host"]
    assert host == 'a"b\\x0ac\\x1b]0;pwned\\x07\\x1b[31m[bold]x[/bold]'


@pytest.mark.parametrize("args, needle", [
    (["--metrics", "ftp://x/metrics", "--once"], "not an http(s) URL"),
    (["--once"], "no endpoint to watch"),
    (["--metrics", "http://127.0.0.1:1/metrics", "--map", "MISSING"], "file not found"),
])
def test_bad_input_exits_2(cli, a100_plan, tmp_path, args, needle):
    args = [str(tmp_path / "nope.yaml") if a == "MISSING" else a for a in args]
    r = cli("watch", a100_plan, *args)
    assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_map_file_with_a_misspelt_key_exits_2(cli, a100_plan, tmp_path):
    m = tmp_path / "map.yaml"
    m.write_text("gpu:\n  GPU-c89b14a3-ce7c-6725-8424-b55d37d9c332: 0\n")
    r = cli("watch", a100_plan, "--metrics", "http://127.0.0.1:1/metrics", "--map", m, "--once")
    assert r.exit_code == 2 and str(m) in r.stderr and "gpu" in r.stderr


def test_help_has_an_example_and_the_exit_codes(cli):
    r = cli("watch", "--help")
    flat = " ".join(r.stdout.split())
    assert r.exit_code == 0 and "Example: shardplan watch plan.yaml --metrics" in flat
    assert "Exit 0" in flat and "4 when a shard is outside" in flat and "5 when an endpoint cannot be read" in flat
