"""`shardplan watch`: a running deployment's Prometheus pages (vLLM's and SGLang's /metrics,
NVIDIA's DCGM exporter) held against what its plan predicted, per GPU and per serving replica.

Fetching is the edge (`fetch_page`: bounded bytes, time and redirects); everything after it is
pure and is tested on recorded pages: decoding (`decode_page`), parsing with prometheus_client's
own parser (`parse_page`), mapping series to the plan's ranks and replicas, and the comparison.

Which series: knowledge/metrics.yaml names each quantity's series per exporter and version (vLLM
renamed `vllm:gpu_cache_usage_perc` to `vllm:kv_cache_usage_perc` in 0.9.2, ...). The names the
plan's engine version emits are tried first, then the others (a page from another version than
the plan names still reads, with a note).

Which shard a series is:
  GPU (DCGM)     the map file's `gpus:` (UUID -> rank); else node x gpus_per_node + the `gpu` label,
                 the node from the map file's `nodes:` (host label -> node), or node 0 when the plan
                 has one node. MIG instances (GPU_I_ID) are not whole GPUs: listed, not mapped.
  replica        the map file's `replicas:` (endpoint / engine label / pod -> dp index); else the
                 engines in --metrics order (within a page, by vLLM's `engine` label) are replicas
                 0, 1, ... Rank order is the manifest's: tp fastest, then cp, dp, pp.

What is judged (outside its band: exit 4), with the plan's own recorded band (`predicted.bands`,
`shardplan validate`'s p90 of |predicted / measured - 1|; a plan without one is not judged):
  memory per GPU   DCGM_FI_DEV_FB_USED against the rank's stage total, outside when
                   |predicted / measured - 1| > band. Training: the peak-memory band. Serving: the
                   engine fills its budget with KV cache, so the total is what the plan sized and
                   the KV-capacity band measures the error of the other terms in bytes: band =
                   kv band x the stage's KV bytes / its total. Both directions count: a GPU far
                   below the plan (an engine that is not running, another utilization) is as
                   much not the plan as one above it.
  KV capacity      the engine's cache in tokens (vLLM: `vllm:cache_config_info`'s kv_cache_size_tokens,
                   else num_gpu_blocks x block_size; SGLang: max_total_num_tokens, else
                   num_used_tokens / token_usage) against `kv_cache.capacity_tokens`, outside when
                   |predicted / measured - 1| > the KV band. Not judged for a CPU-backend vLLM
                   (cpu_kvcache_space_bytes set), a num_gpu_blocks_override, a
                   gpu_memory_utilization other than the plan's, or an engine other than the plan's.
  KV usage         a usage gauge near 100% is the engine doing its job, not a misprediction. What the
                   plan says is how full its cache is with the running requests: each of the plan's
                   input_len + output_len tokens, ceiling = min(1, max(running, 1) x tokens /
                   capacity). Outside when usage > ceiling x (1 + KV band) (the cache can be smaller
                   by the band): the cache is smaller than planned, or requests are longer than the
                   plan's; the message says which figures.
  latency against SLA   a plan ranked within latency limits (the manifest's `sla`): the engine's
                   TTFT histogram over the window (since start on the first scrape; after it the
                   last interval, an empty one too: the history was judged before) against
                   max_ttft_seconds at the SLA's percentile, as far as the buckets decide it
                   (`sla_check`, shares in whole numbers): outside when fewer than that share of the
                   requests can have had their first token within the limit (counting every
                   observation up to the first bucket bound at or past it); within when the share up
                   to the last bound at or under it is enough even with the requests still waiting
                   for a first token counted as over it; else not judged (the limit falls inside the
                   bucket that holds the percentile, the waiting requests could tip it, fewer than
                   two requests lie beyond the percentile, 20 for a p90, or the counts do not rise
                   with their bounds), and the row's note says why. The engine times a request from
                   its own arrival, so a client sees at least what it reports: outside holds for
                   the clients too. TPOT the same way, over the requests finished in the window (as
                   a benchmark client counts them), where the page has vLLM's per-request histogram
                   (vllm:request_time_per_output_token_seconds: one observation per finished
                   request, its decode time over its tokens after the first); the inter-token
                   histograms hold the gap between streamed outputs, not a request's TPOT, and are
                   shown, not judged.
Reported, not judged (the plan's latency holds at the rate it was sized for, and the pages do not
say what rate the deployment is sent; links have no measured band): running and waiting requests
(beside the batch of a plan estimated as one static batch), TTFT and TPOT p50/p90/p99 from the
histograms' buckets (Prometheus' histogram_quantile: linear within the bucket; since start on the first
scrape, over the last interval afterwards) beside the plan's figures (a plan judged under
traffic: its p50/p90/p99 at the rate to plan for, `predicted.load.plan_for`, and that rate;
otherwise its one static batch's) and, from the second scrape, the requests the engine started
per second over the interval (the TTFT histogram's count), and link throughput against the profile's bandwidth
(DCGM_FI_PROF_*_BYTES are rates; DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL is a counter whose rate
needs two scrapes: with one there is none, and the row says so).

Bounds: at most MAX_PAGE_BYTES read per page, MAX_SERIES sample lines (MAX_LINES in all), lines of
MAX_LINE_CHARS, MAX_PARSED_CHARS of the known exporters' lines handed to the (pure Python) parser,
TIMEOUT_SECONDS per socket operation and FETCH_DEADLINE_SECONDS per page, http(s) only (redirects
too). NUL bytes, non-UTF-8,
unparseable text, NaN or Inf in a series watch reads: the endpoint is unreadable (exit 5). Label
values are untrusted: every string from a page is escaped (control characters, ANSI escapes, bidi
controls) and cut to MAX_LABEL_CHARS before it reaches a result.
"""

from __future__ import annotations

import http.client
import ipaddress
import math
import re
import time
import urllib.error
import urllib.request
from bisect import bisect_left
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field, ValidationError, model_validator

from shardplan import units
from shardplan.errors import EXIT_VERIFY_FAILED, EXIT_VERIFY_MISMATCH, InputFileError, ShardplanError
from shardplan.knowledge.load import metrics_file
from shardplan.knowledge.schema import MetricName, MetricsFile, parse_version
from shardplan.plan.manifest import load_manifest
from shardplan.plan.readback import plan_hardware
from shardplan.plan.schema import DeploymentManifest, PercentilesSection, ServingTime, SlaSection
from shardplan.specs._base import StrictModel
from shardplan.specs.hardware import HardwareProfile, LinkKind
from shardplan.specs.loading import read_structured, validation_error
from shardplan.tasks._results import Result, absent

MAX_PAGE_BYTES = 16 * 2**20  # a vLLM page is ~100 KiB, a DCGM page of 8 GPUs ~200 KiB
MAX_SERIES = 100_000  # sample lines per page
# What to do about a page watch cannot read (the address is not an engine's or DCGM's exporter page,
# or that page is broken).
PAGE_HINT = ("point --metrics at a vLLM or SGLang server's /metrics page or a DCGM exporter's, the page Prometheus "
             "scrapes, with finite 'name{labels} value' lines")
MAX_LINES = 4 * MAX_SERIES  # all lines, comments included
MAX_LINE_CHARS = 65_536  # vLLM's cache_config_info line, the longest real one, is ~1 KiB
MAX_PARSED_CHARS = 4 * 2**20  # of vLLM, SGLang and DCGM lines: the parser is pure Python; this bounds its time
TIMEOUT_SECONDS = 5.0  # connect, and each read
FETCH_DEADLINE_SECONDS = 15.0  # a whole page, however slowly it trickles in
MAX_LABEL_CHARS = 96
MAX_ENDPOINTS = 64
_READ_CHUNK_BYTES = 1 << 16
_QUANTILES = (0.5, 0.9, 0.99)
_PREFIXES = {"vllm": "vllm:", "sglang": "sglang:", "dcgm": "DCGM_FI_"}

Verdict = Literal["within", "outside", "not judged"]


class EndpointUnreadable(ShardplanError):
    """An endpoint could not be read: refused, timed out, an HTTP error, or not a metrics page."""

    exit_code = EXIT_VERIFY_FAILED


class OutsideBand(ShardplanError):
    """A shard's measurement is outside the band of the plan's prediction."""

    exit_code = EXIT_VERIFY_MISMATCH


# ----- untrusted text ------------------------------------------------------------------------------

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def safe_text(text: str, limit: int = MAX_LABEL_CHARS) -> str:
    """`text` from a page, fit for a terminal and a one-line message: control characters (ANSI
    escapes, newlines), zero-width and bidi controls escaped as \\xNN / \\uNNNN; at most `limit`
    characters."""
    out = _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                      text[: limit * 8])
    return out if len(out) <= limit else out[: limit - 1] + "…"


# ----- the edge: fetching ------------------------------------------------------------------------


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    max_redirections = 3

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if urlsplit(newurl).scheme not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirect to a non-HTTP URL", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def check_url(url: str) -> str:
    """An http(s) URL with a host, or a ShardplanError naming --metrics (exit 2)."""
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # a port out of range or not a number raises here
    except ValueError:  # an unclosed IPv6 bracket, a bad port
        host = None
    if host is None or parts.scheme not in ("http", "https") or len(url) > 2048:
        raise ShardplanError(f"not an http(s) URL: {safe_text(url)}", field="--metrics",
                             hint="give the endpoint as http://HOST:PORT/metrics")
    return url


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def fetch_page(url: str, *, timeout_seconds: float = TIMEOUT_SECONDS, max_bytes: int = MAX_PAGE_BYTES,
               deadline_seconds: float = FETCH_DEADLINE_SECONDS) -> bytes:
    """The body of GET `url`, at most `max_bytes`, within `deadline_seconds`; EndpointUnreadable
    (exit 5) for a refused connection, a timeout, an HTTP error or a page over the limit."""
    label = safe_text(url)
    handlers: list[urllib.request.BaseHandler] = [_HttpOnlyRedirects()]
    if _loopback(urlsplit(url).hostname or ""):
        handlers.append(urllib.request.ProxyHandler({}))  # a loopback endpoint is never behind a proxy
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4", "User-Agent": "shardplan-watch"})
    deadline = time.monotonic() + deadline_seconds
    too_big = EndpointUnreadable(f"the page is over the {max_bytes:,}-byte limit", source=label,
                                 hint="point --metrics at one exporter's /metrics page")
    try:
        with opener.open(request, timeout=timeout_seconds) as resp:
            length = resp.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise too_big
            chunks, n = [], 0
            # read1: what has arrived (up to a chunk), so that a page trickling in a few bytes at a time
            # meets the deadline check between arrivals (read() waits for a whole chunk or the end).
            while chunk := resp.read1(_READ_CHUNK_BYTES):
                n += len(chunk)
                if n > max_bytes:
                    raise too_big
                if time.monotonic() > deadline:
                    raise EndpointUnreadable(f"the page took over {deadline_seconds:g} s", source=label)
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as e:
        raise EndpointUnreadable(f"HTTP {e.code} {safe_text(str(e.reason), 40)}", source=label,
                                 hint="check the path (usually /metrics)") from None
    except urllib.error.URLError as e:
        reason = e.reason
        what = "timed out" if isinstance(reason, TimeoutError) else safe_text(str(getattr(reason, "strerror", None)
                                                                                   or reason), 60)
        raise EndpointUnreadable(f"cannot connect: {what}", source=label,
                                 hint="check that the exporter runs and the host and port are right") from None
    except TimeoutError:
        raise EndpointUnreadable(f"timed out after {timeout_seconds:g} s", source=label) from None
    except (http.client.HTTPException, OSError, ValueError) as e:
        raise EndpointUnreadable(f"not an HTTP response ({type(e).__name__})", source=label) from None


# ----- pure: a page's text and samples -------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    name: str  # as the parser reports it: it appends `_total` to a counter's samples that lack it
    family: str  # the metric family (a histogram's base name)
    labels: dict[str, str]
    value: float

    def named(self, name: str, suffix: str = "") -> bool:
        """This sample is `name`'s (with `suffix`: its `_bucket`, ... sample), however the page typed it."""
        if suffix:
            return self.name == name + suffix
        return self.family == name or self.name == name


def decode_page(data: bytes, url: str) -> str:
    """The page as text, or EndpointUnreadable: binary data, not UTF-8, too many series."""
    label = safe_text(url)
    if b"\x00" in data:
        raise EndpointUnreadable("binary data (NUL bytes), not a Prometheus text page", source=label, hint=PAGE_HINT)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EndpointUnreadable(f"not UTF-8 text (byte {e.start})", source=label, hint=PAGE_HINT) from None
    # Lines counted without splitting the text (a page of tiny lines would be millions of strings).
    lines = text.count("\n") + 1
    skipped = text.count("\n#") + text.count("\n\n") + text.startswith("#")
    if lines - skipped > MAX_SERIES or lines > MAX_LINES:
        raise EndpointUnreadable(f"over {MAX_SERIES:,} series ({lines - skipped:,} sample lines)", source=label,
                                 hint="point --metrics at one exporter's /metrics page, not a federation of many")
    if _longest_line(text) > MAX_LINE_CHARS:
        raise EndpointUnreadable(f"a line over {MAX_LINE_CHARS:,} characters", source=label, hint=PAGE_HINT)
    return text


def _longest_line(text: str) -> int:
    """The longest line's length, one str.find per line (a regex would rescan each long line from
    every position in it)."""
    longest, start = 0, 0
    while (end := text.find("\n", start)) != -1:
        longest, start = max(longest, end - start), end + 1
    return max(longest, len(text) - start)


_KNOWN_LINE = re.compile(r"^(?:# (?:HELP|TYPE) )?(?:" + "|".join(map(re.escape, _PREFIXES.values())) + r")[^\n]*$", re.M)


def parse_page(text: str, url: str) -> list[Sample]:
    """The samples of the exporters watch knows (vllm:, sglang:, DCGM_FI_), parsed by
    prometheus_client's parser; EndpointUnreadable when it cannot parse the page. Only those
    exporters' lines reach the parser, at most MAX_PARSED_CHARS of them (it is pure Python)."""
    known = "\n".join(m.group() for m in _KNOWN_LINE.finditer(text))
    if len(known) > MAX_PARSED_CHARS:
        raise EndpointUnreadable(f"over {MAX_PARSED_CHARS:,} characters of vLLM, SGLang or DCGM series",
                                 source=safe_text(url), hint="point --metrics at one exporter's /metrics page")
    if text.strip() and not known and not _looks_like_exposition(text):
        raise EndpointUnreadable("not a Prometheus text page (no metric line)", source=safe_text(url), hint=PAGE_HINT)
    out: list[Sample] = []
    try:
        for family in text_string_to_metric_families(known + "\n"):
            for s in family.samples:
                if s.name.startswith(tuple(_PREFIXES.values())):
                    out.append(Sample(s.name, family.name, dict(s.labels), float(s.value)))
    except Exception as e:  # noqa: BLE001 - a hostile page can make the third-party parser raise anything
        raise EndpointUnreadable(f"not a Prometheus text page ({type(e).__name__}: {safe_text(str(e), 60)})",
                                 source=safe_text(url), hint=PAGE_HINT) from None
    return out


def _looks_like_exposition(text: str) -> bool:
    """The first non-comment line parses as a sample (an HTML page or a JSON body does not)."""
    first = next((m.group() for m in re.finditer(r"^[^#\n][^\n]*$", text[: 1 << 16], re.M)), "")
    try:
        return any(True for _ in text_string_to_metric_families(first + "\n"))
    except Exception:  # noqa: BLE001 - the third-party parser's errors on a hostile line vary
        return False


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile (promql/quantile.go, bucketQuantile): the q-quantile of
    cumulative `buckets` [(upper bound, count)], linear within the bucket it falls in, the first
    bucket starting at 0 (for a positive bound). None without a +Inf bucket or observations. A
    quantile in the +Inf bucket is the highest finite bound; counts are made monotonic first."""
    b = sorted(buckets)
    if len(b) < 2 or not math.isinf(b[-1][0]):
        return None
    counts, top = [], 0.0
    for _, c in b:
        top = max(top, c)
        counts.append(top)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = bisect_left(counts, rank, hi=len(b) - 1)
    if i == len(b) - 1:
        return b[-2][0]
    if i == 0 and b[0][0] <= 0:
        return b[0][0]
    start, end, in_bucket = (0.0, b[0][0], counts[0]) if i == 0 else (b[i - 1][0], b[i][0], counts[i] - counts[i - 1])
    if i > 0:
        rank -= counts[i - 1]
    return end if in_bucket <= 0 else start + (end - start) * (rank / in_bucket)


def sla_check(percentile: int, limit_seconds: float, buckets: list[tuple[float, float]],
              window: Literal["since start", "last interval"], metric: str, quantity: str = "TTFT",
              unseen: float = 0.0) -> SlaCheck:
    """Whether the requests counted in cumulative `buckets` [(upper bound, count)] meet "the
    `percentile`-th percentile is at most `limit_seconds`", as far as the buckets decide it: an
    observation is certainly within the limit up to the last bound at or under it, and may be
    within it up to the first bound at or past it (module docstring). `unseen`: requests the
    histogram has not counted yet whose figure may still break the limit (TTFT: the requests
    waiting for their first token); "within" must hold with them counted as over it. Shares
    are compared in whole numbers (100 x count against percentile x total)."""
    b = sorted(buckets)
    total = b[-1][1] if b and math.isinf(b[-1][0]) else 0.0
    limit = f"{limit_seconds * 1e3:,.4g} ms"
    within = max((c for bound, c in b if bound <= limit_seconds), default=0.0)
    may_be_within = next((c for bound, c in b if bound >= limit_seconds), total)
    over = max(0.0, total - may_be_within)
    needed = math.ceil(200 / (100 - percentile))  # two requests beyond the percentile
    counts = [c for _, c in b]
    verdict: Verdict = "not judged"
    if any(later < earlier for earlier, later in zip(counts, counts[1:])):
        within = over = 0.0
        note = ("the buckets' counts do not rise with their bounds (series of different bucket sets summed, or a "
                "page read while it was written): not judged")
    elif total < needed:
        note = f"{total:,.0f} request(s) in the window; a p{percentile} needs {needed} (two beyond the percentile)"
    elif 100 * may_be_within < percentile * total:
        verdict = "outside"
        note = (f"p{percentile} {quantity} over the SLA's {limit}: at least {over:,.0f} of {total:,.0f} requests took "
                f"longer (the p{percentile} allows {(100 - percentile) * total // 100:,.0f})")
    elif 100 * within >= percentile * (total + unseen):
        verdict = "within"
        note = f"p{percentile} {quantity} within the SLA's {limit}: at least {within:,.0f} of {total:,.0f} requests within it"
        if unseen:
            note += f", and would be with the {unseen:,.0f} still waiting over it"
    elif 100 * within >= percentile * total:
        note = (f"{within:,.0f} of {total:,.0f} requests within the SLA's {limit}, but {unseen:,.0f} are still waiting "
                f"for theirs: the p{percentile} is not decided")
    else:
        lo = max((bound for bound, _ in b if bound <= limit_seconds), default=0.0)
        hi = next((bound for bound, _ in b if bound >= limit_seconds), math.inf)
        note = (f"the SLA's {limit} falls inside the bucket ({lo:g}, {hi:g}] s that holds the p{percentile}: "
                "the histogram cannot say")
    return SlaCheck(percentile=percentile, limit_seconds=limit_seconds, verdict=verdict, within_at_least=within,
                    over_at_least=over, num_observations=total, window=window, metric=metric, note=note)


# ----- the map file ----------------------------------------------------------------------------------


class ReplicaMapping(StrictModel):
    """Which serving replica (dp index) the series of one engine are: every field given must match."""

    endpoint: str | None = Field(None, max_length=2048, description="the --metrics URL, as given")
    engine: str | None = Field(None, max_length=64, description="vLLM's `engine` label (its data-parallel engine)")
    pod: str | None = Field(None, max_length=256, description="the `pod` label of a federated page")
    replica: int = Field(ge=0, description="the plan's replica (dp index), from 0")

    @model_validator(mode="after")
    def _some(self) -> "ReplicaMapping":
        if self.endpoint is None and self.engine is None and self.pod is None:
            raise ValueError("give endpoint, engine or pod")
        return self


class WatchMap(StrictModel):
    """`--map FILE`: when the labels do not say which rank or replica a series is."""

    nodes: dict[str, int] = Field(default_factory=dict, max_length=4096,
                                  description="a DCGM host label (Hostname/hostname/instance) -> the plan's node, from 0")
    gpus: dict[str, int] = Field(default_factory=dict, max_length=65536, description="a GPU UUID -> the plan's rank")
    replicas: list[ReplicaMapping] = Field(default_factory=list, max_length=4096)


def load_map(path: Path, m: DeploymentManifest) -> WatchMap:
    """The map file, checked against the plan: nodes, ranks and replicas that exist."""
    label = str(path)
    try:
        wm = WatchMap.model_validate(read_structured(path))
    except ValidationError as e:
        raise validation_error(e, label) from None
    hw, L = m.hardware, m.layout
    for host, node in wm.nodes.items():
        if not 0 <= node < hw.num_nodes:
            raise InputFileError(f"node {node} for {safe_text(host)!r}: the plan has {hw.num_nodes} node(s)",
                                 source=label, field=f"nodes.{safe_text(host)}", hint=f"use 0 to {hw.num_nodes - 1}")
    for uuid, rank in wm.gpus.items():
        if not 0 <= rank < hw.num_gpus:
            raise InputFileError(f"rank {rank}: the plan has {hw.num_gpus} GPUs", source=label,
                                 field=f"gpus.{safe_text(uuid)}", hint=f"use 0 to {hw.num_gpus - 1}")
    for i, r in enumerate(wm.replicas):
        if r.replica >= L.dp:
            raise InputFileError(f"replica {r.replica}: the plan has {L.dp} replica(s)", source=label,
                                 field=f"replicas.{i}.replica", hint=f"use 0 to {L.dp - 1}")
    return wm


# ----- what the plan predicts ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanFacts:
    """The figures of a plan that a deployment's pages can be held against (SI units)."""

    source: str
    serving: bool
    engine: str | None
    engine_version: str | None
    tp: int
    cp: int
    dp: int
    gpus_per_node: int
    num_nodes: int
    num_gpus: int
    stage_total_bytes: tuple[float, ...]
    memory_band: tuple[float | None, ...]  # per stage, fraction
    memory_band_note: str
    kv_capacity_tokens: int | None
    kv_band: float | None
    kv_band_note: str
    request_tokens: int | None
    batch_size: int | None
    ttft_seconds: float | None
    tpot_seconds: float | None
    # A plan judged under traffic (`predicted.load`): the rate to plan for, one replica's share, and
    # TTFT and TPOT there; its static-batch figures above are then None.
    load_request_rate_per_replica: float | None
    ttft_plan_seconds: PercentilesSection | None
    tpot_plan_seconds: PercentilesSection | None
    gpu_memory_utilization: float | None
    sla: SlaSection | None  # the latency limits the plan was ranked within (serving)
    nvlink_bytes_per_second: float | None  # per GPU per direction; None: the intra-node link is not NVLink
    pcie_bytes_per_second: float | None  # the host link, per direction; None: the profile could not be read

    def stage_of(self, rank: int) -> int:
        return rank // (self.tp * self.cp * self.dp)

    def replica_of(self, rank: int) -> int:
        return (rank // (self.tp * self.cp)) % self.dp


def plan_facts(m: DeploymentManifest, hw: HardwareProfile | None, source: str) -> PlanFacts:
    """What `m` predicts, with the band each judged figure carries (module docstring)."""
    p = m.predicted
    bands = {b.quantity: b for b in p.bands if b.band_abs_error is not None}
    serving = m.workload.kind == "inference"
    kv = bands.get("kv_capacity")
    totals = tuple(s.per_gpu_bytes["total"] for s in p.memory.stages)
    if serving:
        mem_band = tuple(None if kv is None or not s.per_gpu_bytes["total"] else
                         kv.band_abs_error * s.per_gpu_bytes.get("kv_cache", 0.0) / s.per_gpu_bytes["total"]  # type: ignore[operator]
                         for s in p.memory.stages)
        mem_note = ("serving: the KV-capacity band in bytes over the stage's total" if kv else
                    "the plan records no KV-capacity band (no engine version): memory is not judged")
    else:
        peak = bands.get("peak_memory")
        mem_band = tuple(peak.band_abs_error if peak else None for _ in p.memory.stages)
        mem_note = f"training: the peak-memory band ({peak.note})" if peak else \
            "the plan records no peak-memory band: memory is not judged"
    t = p.time
    w = m.workload
    intra = hw.intra_node if hw is not None else None
    static = isinstance(t, ServingTime) and p.load is None
    rate = ttft_plan = tpot_plan = None
    if p.load is not None:
        total, ttft_plan, tpot_plan = p.load.plan_for
        rate = None if total is None else total / p.load.num_replicas
    return PlanFacts(
        source=source, serving=serving, engine=getattr(w, "engine", None), engine_version=getattr(w, "engine_version", None),
        tp=m.layout.tp, cp=m.layout.cp, dp=m.layout.dp, gpus_per_node=m.hardware.gpus_per_node,
        num_nodes=m.hardware.num_nodes, num_gpus=m.hardware.num_gpus, stage_total_bytes=totals, memory_band=mem_band,
        memory_band_note=mem_note, kv_capacity_tokens=p.kv_cache.capacity_tokens if p.kv_cache else None,
        kv_band=kv.band_abs_error if kv else None,
        kv_band_note=kv.note if kv else "the plan records no KV-capacity band: KV figures are not judged",
        request_tokens=(w.input_len + w.output_len) if serving else None,  # type: ignore[union-attr]
        batch_size=t.batch_size if static else None,  # type: ignore[union-attr]
        ttft_seconds=t.ttft_seconds if static else None,  # type: ignore[union-attr]
        tpot_seconds=t.tpot_seconds if static else None,  # type: ignore[union-attr]
        load_request_rate_per_replica=rate, ttft_plan_seconds=ttft_plan, tpot_plan_seconds=tpot_plan,
        gpu_memory_utilization=getattr(w, "gpu_memory_utilization", None), sla=m.sla if serving else None,
        nvlink_bytes_per_second=intra.bandwidth_bytes_per_second
        if intra is not None and intra.kind in (LinkKind.NVLINK, LinkKind.NVSWITCH) else None,
        pcie_bytes_per_second=hw.host_link.bandwidth_bytes_per_second if hw is not None else None)


# ----- typed results ---------------------------------------------------------------------------------


class EndpointReport(Result):
    url: str = Field(description="the --metrics URL (escaped)")
    exporters: list[Literal["vllm", "sglang", "dcgm"]] = Field(description="whose series the page holds")
    num_series: int = Field(ge=0, description="samples of the exporters watch knows")
    fetch_seconds: float = Field(ge=0, description="time to fetch the page, s")
    error: str | None = absent("why the endpoint could not be read (then nothing of it is judged)")


class Percentiles(Result):
    p50_seconds: float | None = Field(description="median, s; null: no observations")
    p90_seconds: float | None
    p99_seconds: float | None
    num_observations: float = Field(ge=0, description="observations in the window")
    above_highest_bucket: float = Field(ge=0, description="observations above the highest finite bucket: a "
                                                          "quantile among them reads as that bound (a lower bound)")
    highest_bucket_seconds: float | None = Field(description="the highest finite bucket bound, s")
    window: Literal["since start", "last interval"] = Field(description="cumulative buckets, or their change since the last scrape")
    metric: str = Field(description="the histogram read")
    observations_per_second: float | None = Field(
        None, description="observations per second since the last scrape (the count's change over the interval; for "
                          "TTFT: requests that got their first token); null on the first scrape or after a reset")


class SlaCheck(Result):
    """One per-request latency histogram's window (TTFT, or vLLM's per-request TPOT) held against the
    plan's SLA limit at its percentile (`sla_check`)."""

    percentile: int = Field(description="the SLA's percentile")
    limit_seconds: float = Field(description="the SLA's limit, s")
    verdict: Verdict
    within_at_least: float = Field(ge=0, description="requests certainly within the limit (buckets up to it)")
    over_at_least: float = Field(ge=0, description="requests certainly over it (above the first bound at or past it)")
    num_observations: float = Field(ge=0, description="requests in the window")
    window: Literal["since start", "last interval"]
    metric: str = Field(description="the histogram read")
    note: str = Field(description="the verdict in words")


class PlanPercentiles(Result):
    p50_seconds: float
    p90_seconds: float
    p99_seconds: float

    @classmethod
    def of(cls, q: PercentilesSection | None) -> PlanPercentiles | None:
        return None if q is None else cls(p50_seconds=q.p50, p90_seconds=q.p90, p99_seconds=q.p99)


class GpuRow(Result):
    """One GPU: a DCGM series set, mapped to the plan's rank when the labels or map say which."""

    rank: int | None = Field(description="the plan's rank; null: not mapped (see note)")
    node: int | None
    stage: int | None
    replica: int | None = Field(description="serving: the dp replica the rank belongs to")
    gpu: str = Field(description="the `gpu` label (local index)")
    uuid: str
    host: str
    endpoint: str
    memory_used_bytes: float | None = Field(description="DCGM_FI_DEV_FB_USED, bytes")
    memory_free_bytes: float | None = Field(description="DCGM_FI_DEV_FB_FREE, bytes")
    memory_predicted_bytes: float | None = Field(description="the stage's predicted total per GPU, bytes")
    memory_band_abs_error: float | None = Field(description="the band applied, fraction")
    memory_error: float | None = Field(description="predicted / measured - 1; null: not both known, or measured 0")
    memory_verdict: Verdict
    nvlink_tx_bytes_per_second: float | None = Field(description="DCGM_FI_PROF_NVLINK_TX_BYTES (a rate)")
    nvlink_total_bytes_per_second: float | None = Field(description="the NVLINK_BANDWIDTH_TOTAL counter's rate between scrapes")
    nvlink_bandwidth_fraction: float | None = Field(description="the larger NVLink rate over the profile's NVLink bandwidth (x2 for rx+tx)")
    pcie_tx_bytes_per_second: float | None = Field(description="DCGM_FI_PROF_PCIE_TX_BYTES (a rate)")
    pcie_bandwidth_fraction: float | None = Field(description="over the profile's host link bandwidth (per direction)")
    notes: list[str] = Field(default_factory=list)


class ReplicaRow(Result):
    """One serving engine (a dp replica): its gauges and histograms against the plan."""

    replica: int | None = Field(description="the plan's dp replica; null: not mapped")
    endpoint: str
    exporter: Literal["vllm", "sglang"]
    engine: str = Field(description="vLLM's `engine` label (empty when absent)")
    pod: str = Field(description="the `pod` (else Prometheus' `instance`) label of a federated page; empty when absent")
    running_requests: float | None
    waiting_requests: float | None
    predicted_batch_size: int | None = Field(description="the concurrency the plan's time figures are for; null for a "
                                                         "plan judged under traffic")
    kv_usage_fraction: float | None
    kv_usage_ceiling_fraction: float | None = Field(description="the plan's usage for the running requests, before the band")
    kv_usage_verdict: Verdict
    kv_capacity_tokens: float | None = Field(description="the engine's cache, tokens (measured)")
    kv_capacity_predicted_tokens: int | None
    kv_band_abs_error: float | None
    kv_capacity_error: float | None = Field(description="predicted / measured - 1")
    kv_capacity_verdict: Verdict
    ttft: Percentiles | None
    ttft_predicted_seconds: float | None = Field(description="the plan's one static batch TTFT; null for a plan judged "
                                                             "under traffic (ttft_predicted)")
    tpot: Percentiles | None
    tpot_predicted_seconds: float | None = Field(description="the plan's one static batch TPOT; null for a plan judged "
                                                             "under traffic (tpot_predicted)")
    predicted_request_rate_per_second: float | None = Field(
        None, description="a plan judged under traffic: this replica's share of the rate to plan for (the rate a long "
                          "run holds where the judged one breaks the SLA over one; `predicted.load.plan_for`)")
    ttft_predicted: PlanPercentiles | None = Field(None, description="a plan judged under traffic: its TTFT at that rate")
    ttft_sla: SlaCheck | None = Field(None, description="the TTFT histogram against the plan's SLA; null: the plan has no "
                                                        "TTFT limit, or the page no TTFT histogram")
    request_tpot: Percentiles | None = Field(None, description="vLLM's per-request TPOT histogram (one observation per "
                                                               "finished request); null: the page has none")
    tpot_sla: SlaCheck | None = Field(None, description="the per-request TPOT histogram against the plan's SLA; null: the "
                                                        "plan has no TPOT limit, or the page no per-request histogram")
    tpot_predicted: PlanPercentiles | None = Field(None, description="a plan judged under traffic: its TPOT at that rate")
    metrics_read: list[str] = Field(description="the series names this row was read from")
    notes: list[str] = Field(default_factory=list)


class WatchScrape(Result):
    """One scrape of every endpoint, held against the plan; `--json` prints one per line."""

    plan: str
    scrape_index: int = Field(ge=0)
    interval_seconds: float | None = Field(description="since the previous scrape, s; null: the first")
    status: Literal["ok", "outside", "unreadable"] = Field(
        description="ok: everything judged is within its band (exit 0); outside: a figure is not, or a replica's TTFT "
                    "or TPOT breaks the plan's SLA (exit 4); "
                    "unreadable: an endpoint could not be read (exit 5)")
    endpoints: list[EndpointReport]
    gpus: list[GpuRow]
    replicas: list[ReplicaRow]
    outside: list[str] = Field(description="one line per figure outside its band, and per latency that breaks the plan's SLA")
    notes: list[str] = Field(description="what could not be mapped or compared, and why")
    assumptions: list[str] = Field(description="the rules applied (bands, mapping)")


# ----- pure: pages -> rows ---------------------------------------------------------------------------


def _labels(s: Sample, names: tuple[str, ...]) -> str:
    return next((s.labels[n] for n in names if n in s.labels), "")


def _non_finite(samples: list[Sample], known: set[str]) -> str | None:
    for s in samples:
        base = re.sub(r"_(bucket|sum|count|total)$", "", s.name)
        if (s.name in known or s.family in known or base in known) and not math.isfinite(s.value):
            lab = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            return (f"{safe_text(s.name)}{{{safe_text(lab, 60)}}} is {s.value}: a measurement must be a finite number "
                    f"(fix: {PAGE_HINT})")
    return None


@dataclass
class _EngineGroup:
    exporter: str
    url: str
    endpoint_index: int
    engine: str
    pod: str
    samples: list[Sample] = field(default_factory=list)


def _engine_groups(pages: list[tuple[int, str, list[Sample]]], k: MetricsFile) -> list[_EngineGroup]:
    """One group per serving engine: per page, exporter and pod, by vLLM's `engine` label. Series
    without it (vllm:cache_config_info before 0.10, info gauges) belong to every engine of the page;
    a page without any engine label is one engine. Groups without a running-requests or KV-usage
    series (info gauges alone) are no engine."""
    out: list[_EngineGroup] = []
    for i, url, samples in pages:
        for exporter in ("vllm", "sglang"):
            prefix = _PREFIXES[exporter]
            engine_names, pod_names = k.label_names(exporter, "engine_index"), k.label_names(exporter, "pod")
            own: dict[tuple[str, str], list[Sample]] = {}
            shared: dict[str, list[Sample]] = {}
            for s in samples:
                if not s.name.startswith(prefix):
                    continue
                engine, pod = _labels(s, engine_names), _labels(s, pod_names)
                (own.setdefault((engine, pod), []) if engine else shared.setdefault(pod, [])).append(s)
            if not own:
                own = {("", pod): [] for pod in shared}
            core = {m.name for q in ("running_requests", "kv_usage_fraction") for m in k.names(exporter, q)}
            for (engine, pod), mine in sorted(own.items(), key=lambda kv: (kv[0][0].zfill(8), kv[0][1])):
                group = _EngineGroup(exporter, url, i, engine, pod, mine + shared.get(pod, []))
                if any(s.name in core or s.family in core for s in group.samples):
                    out.append(group)
    return out


def _pick(rules: tuple[MetricName, ...], samples: list[Sample], kind_suffix: str = "") -> tuple[MetricName, list[Sample]] | None:
    for rule in rules:
        found = [s for s in samples if s.named(rule.name, kind_suffix)]
        if found:
            return rule, found
    return None


def _version_note(rule: MetricName, facts: PlanFacts) -> str | None:
    if facts.engine_version is None or not rule.range_established or facts.engine != rule.exporter:
        return None
    if rule.emitted_at(parse_version(facts.engine_version)):
        return None
    span = " and ".join(x for x in (f"from {rule.since}" if rule.since else "", f"before {rule.until}" if rule.until else "") if x)
    return f"the page has {rule.name}, which {rule.exporter} emits {span}; the plan names {rule.exporter} {facts.engine_version}"


@dataclass
class _Previous:
    at: float
    counters: dict[tuple, float]
    histograms: dict[tuple, list[tuple[float, float]]]


class Watcher:
    """One plan and its endpoints; `scrape()` fetches every page once and returns a WatchScrape.
    Counters and histograms are remembered between scrapes (rates, last-interval percentiles)."""

    def __init__(self, plan: Path, urls: list[str], map_path: Path | None = None, *,
                 fetch: Callable[[str], bytes] = fetch_page, clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ShardplanError("no endpoint to watch", field="--metrics", hint="give --metrics URL at least once")
        if len(urls) > MAX_ENDPOINTS:
            raise ShardplanError(f"{len(urls)} endpoints; at most {MAX_ENDPOINTS}", field="--metrics",
                                 hint="watch a federating Prometheus' page, or fewer endpoints")
        self.urls = [check_url(u) for u in urls]
        self.manifest = load_manifest(plan)
        try:
            hw: HardwareProfile | None = plan_hardware(self.manifest, str(plan))
            self._hw_note = ""
        except ShardplanError as e:  # a profile file on another machine: only the link bandwidths need it
            hw, self._hw_note = None, f"the plan's hardware profile cannot be read here ({e.one_line()}): links not compared"
        self.facts = plan_facts(self.manifest, hw, str(plan))
        self.map = load_map(map_path, self.manifest) if map_path is not None else WatchMap()
        self.knowledge: MetricsFile = metrics_file()
        self._fetch, self._clock = fetch, clock
        self._previous: _Previous | None = None
        self._index = 0

    # -- one scrape --------------------------------------------------------------------------
    def scrape(self) -> WatchScrape:
        with ThreadPoolExecutor(max_workers=min(16, len(self.urls))) as pool:
            fetched = list(pool.map(self._one, self.urls))
        now = self._clock()
        interval = None if self._previous is None else now - self._previous.at
        known = {m.name for m in self.knowledge.metrics}
        endpoints: list[EndpointReport] = []
        pages: list[tuple[int, str, list[Sample]]] = []
        for i, (url, samples, error, seconds) in enumerate(fetched):
            if error is None:
                error = _non_finite(samples, known)
            exporters = sorted({e for e, p in _PREFIXES.items() if any(s.name.startswith(p) for s in samples)})
            if error is None and not exporters:
                error = ("holds no vLLM, SGLang or DCGM series shardplan knows (knowledge/metrics.yaml) "
                         f"(fix: {PAGE_HINT})")
            endpoints.append(EndpointReport(url=safe_text(url), exporters=exporters, num_series=len(samples),  # type: ignore[arg-type]
                                            fetch_seconds=round(seconds, 4), error=error))
            if error is None:
                pages.append((i, url, samples))
        notes: list[str] = []
        counters: dict[tuple, float] = {}
        histograms: dict[tuple, list[tuple[float, float]]] = {}
        gpus = self._gpu_rows(pages, interval, notes, counters)
        replicas = self._replica_rows(pages, notes, histograms, interval)
        self._previous = _Previous(at=now, counters=counters, histograms=histograms)
        outside = [line for r in gpus for line in _gpu_outside(r)] + \
                  [line for r in replicas for line in _replica_outside(r, self.facts)]
        status = "unreadable" if any(e.error for e in endpoints) else "outside" if outside else "ok"
        result = WatchScrape(plan=self.facts.source, scrape_index=self._index,
                             interval_seconds=None if interval is None else round(interval, 3), status=status,
                             endpoints=endpoints, gpus=gpus, replicas=replicas, outside=outside, notes=notes,
                             assumptions=self._assumptions())
        self._index += 1
        return result

    def _one(self, url: str) -> tuple[str, list[Sample], str | None, float]:
        t0 = self._clock()
        try:
            samples = parse_page(decode_page(self._fetch(url), url), url)
            return url, samples, None, self._clock() - t0
        except EndpointUnreadable as e:
            return url, [], e.message + (f" (fix: {e.hint})" if e.hint else ""), self._clock() - t0

    def _assumptions(self) -> list[str]:
        f = self.facts
        out = [f"memory band: {f.memory_band_note}", f"KV band: {f.kv_band_note}"]
        if f.serving:
            out.append(f"KV usage ceiling: running requests x the plan's {f.request_tokens:,} tokens per request "
                       f"(input_len + output_len) over the predicted cache")
        sla = f.sla
        if sla is not None:
            kind = "shardplan's default SLA" if sla.defaulted else "the SLA given"
            limits = [f"{q} <= {v * 1e3:,.0f} ms" for q, v in (("TTFT", sla.max_ttft_seconds), ("TPOT", sla.max_tpot_seconds))
                      if v is not None]
            out.append(f"SLA ({kind}, p{sla.percentile}): {', '.join(limits)}; held against the engine's per-request "
                       "histograms where the buckets decide it: TTFT, and TPOT where the page has vLLM's per-request "
                       "histogram (vllm:request_time_per_output_token_seconds); the inter-token histograms are a gap "
                       "between streamed outputs, not a request's TPOT, and are shown, not judged")
        out.append("the plan's TTFT and TPOT figures are reported, not judged: they hold at the rate it was sized for, "
                   "and the pages do not say what rate the deployment is sent; link throughput has no measured band")
        if self._hw_note:
            out.append(self._hw_note)
        return out

    # -- GPUs (DCGM) -------------------------------------------------------------------------
    def _gpu_rows(self, pages: list[tuple[int, str, list[Sample]]], interval: float | None, notes: list[str],
                  counters: dict[tuple, float]) -> list[GpuRow]:
        k, f = self.knowledge, self.facts
        idx_names, uuid_names = k.label_names("dcgm", "gpu_index"), k.label_names("dcgm", "gpu_uuid")
        host_names, mig_names = k.label_names("dcgm", "host"), k.label_names("dcgm", "mig_instance")
        model_names = k.label_names("dcgm", "gpu_model")
        models: dict[tuple, str] = {}
        by_quantity = {q: {m.name for m in k.names("dcgm", q)} for q in
                       ("memory_used_mib", "memory_free_mib", "nvlink_bytes_total", "nvlink_tx_bytes_per_second",
                        "pcie_tx_bytes_per_second")}
        groups: dict[tuple, dict[str, float]] = {}
        for i, url, samples in pages:
            for s in samples:
                q = next((q for q, names in by_quantity.items() if s.name in names or s.family in names), None)
                if q is None:
                    continue
                key = (i, url, _labels(s, host_names), _labels(s, idx_names), _labels(s, uuid_names), _labels(s, mig_names))
                groups.setdefault(key, {})[q] = s.value
                models.setdefault(key, _labels(s, model_names))
        rows, taken = [], set()
        for key, values in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3].zfill(8), kv[0][5])):
            i, url, host, gpu, uuid, mig = key
            row_notes: list[str] = []
            model = models.get(key, "")
            if model and model.lower() not in self.manifest.hardware.gpu_model.lower() \
                    and self.manifest.hardware.gpu_model.lower() not in model.lower():
                row_notes.append(f"the GPU is a {safe_text(model, 48)}; the plan's are {self.manifest.hardware.gpu_model}")
            rank = self._rank(host, gpu, uuid, mig, row_notes)
            if rank is not None and rank in taken:
                row_notes.append(f"a second series set for rank {rank}: not mapped")
                rank = None
            if rank is not None:
                taken.add(rank)
            used = values.get("memory_used_mib")
            used_b = None if used is None else used * units.BYTES_PER_MIB
            stage = f.stage_of(rank) if rank is not None else None
            predicted = f.stage_total_bytes[stage] if stage is not None else None
            band = f.memory_band[stage] if stage is not None else None
            err, verdict = _judge(predicted, used_b, band)
            if rank is not None and used_b is None:
                row_notes.append("no DCGM_FI_DEV_FB_USED on the page")
            total_key = (url, host, gpu, uuid, mig)
            nv_total = None
            if "nvlink_bytes_total" in values:
                counters[total_key] = values["nvlink_bytes_total"]
                prev = self._previous.counters.get(total_key) if self._previous else None
                if interval is None or prev is None:
                    row_notes.append("NVLink counter: one scrape gives no rate (run without --once)")
                elif values["nvlink_bytes_total"] < prev or interval <= 0:
                    row_notes.append("NVLink counter went back (a reset): no rate this scrape")
                else:
                    nv_total = (values["nvlink_bytes_total"] - prev) / interval
            nv_tx = values.get("nvlink_tx_bytes_per_second")
            nv_frac = None
            if f.nvlink_bytes_per_second and (nv_tx is not None or nv_total is not None):
                nv_frac = max((nv_tx or 0.0) / f.nvlink_bytes_per_second, (nv_total or 0.0) / (2 * f.nvlink_bytes_per_second))
            elif nv_tx is not None or nv_total is not None:
                row_notes.append("the profile's intra-node link is not NVLink: no bandwidth to compare with")
            pcie = values.get("pcie_tx_bytes_per_second")
            rows.append(GpuRow(
                rank=rank, node=None if rank is None else rank // f.gpus_per_node, stage=stage,
                replica=f.replica_of(rank) if rank is not None and f.serving else None, gpu=safe_text(gpu),
                uuid=safe_text(uuid), host=safe_text(host), endpoint=safe_text(url), memory_used_bytes=used_b,
                memory_free_bytes=None if "memory_free_mib" not in values else values["memory_free_mib"] * units.BYTES_PER_MIB,
                memory_predicted_bytes=predicted, memory_band_abs_error=band, memory_error=err, memory_verdict=verdict,
                nvlink_tx_bytes_per_second=nv_tx, nvlink_total_bytes_per_second=nv_total, nvlink_bandwidth_fraction=nv_frac,
                pcie_tx_bytes_per_second=pcie,
                pcie_bandwidth_fraction=None if pcie is None or not f.pcie_bytes_per_second else pcie / f.pcie_bytes_per_second,
                notes=row_notes))
        missing = sorted(set(range(f.num_gpus)) - taken) if rows else []
        if missing:
            notes.append(f"no DCGM series for rank(s) {_span(missing)}")
        if not rows:
            notes.append("no DCGM page: memory per GPU and links are not measured (add the exporter's --metrics URL)")
        return sorted(rows, key=lambda r: (r.rank is None, r.rank or 0))

    def _rank(self, host: str, gpu: str, uuid: str, mig: str, notes: list[str]) -> int | None:
        f = self.facts
        if mig:
            notes.append("a MIG instance (GPU_I_ID): not a whole GPU of the plan")
            return None
        if uuid in self.map.gpus:
            return self.map.gpus[uuid]
        if host in self.map.nodes:
            node = self.map.nodes[host]
        elif f.num_nodes == 1:
            node = 0
        else:
            notes.append(f"host {safe_text(host)!r} is not in the map file's nodes: (the plan has {f.num_nodes} nodes)")
            return None
        if not gpu.isdigit() or int(gpu) >= f.gpus_per_node:
            notes.append(f"gpu label {safe_text(gpu)!r} is not a GPU index below the plan's {f.gpus_per_node} per node")
            return None
        return node * f.gpus_per_node + int(gpu)

    # -- serving engines ---------------------------------------------------------------------
    def _replica_rows(self, pages: list[tuple[int, str, list[Sample]]], notes: list[str],
                      histograms: dict[tuple, list[tuple[float, float]]], interval: float | None) -> list[ReplicaRow]:
        k, f = self.knowledge, self.facts
        groups = _engine_groups(pages, k)
        if groups and not f.serving:
            notes.append("a training plan: serving-engine pages have nothing to be held against")
            return []
        rows, taken, sequential = [], set(), 0
        for g in groups:
            replica, how = self._replica(g)
            if replica is None:
                while sequential in taken:
                    sequential += 1
                replica = sequential if sequential < f.dp else None
            if replica is not None and replica in taken:
                replica = None
            if replica is not None:
                taken.add(replica)
            unmapped = None if replica is not None else f"not mapped: the plan has {f.dp} replica(s)" + (f" ({how})" if how else "")
            rows.append(self._replica_row(g, replica, histograms, unmapped, interval))
        missing = sorted(set(range(f.dp)) - taken) if rows else []
        if missing:
            notes.append(f"no engine page for replica(s) {_span(missing)}")
        return rows

    def _replica(self, g: _EngineGroup) -> tuple[int | None, str]:
        for r in self.map.replicas:
            if (r.endpoint in (None, g.url)) and (r.engine in (None, g.engine)) and (r.pod in (None, g.pod)):
                return r.replica, ""
        return None, "" if not self.map.replicas else "no map entry matches"

    def _replica_row(self, g: _EngineGroup, replica: int | None, histograms: dict[tuple, list[tuple[float, float]]],
                     unmapped: str | None, interval: float | None) -> ReplicaRow:
        k, f = self.knowledge, self.facts
        version = f.engine_version if f.engine == g.exporter else None
        read: list[str] = []
        notes: list[str] = [unmapped] if unmapped else []

        def gauge(quantity: str) -> float | None:
            hit = _pick(k.names(g.exporter, quantity, version), g.samples)
            if hit is None:
                return None
            rule, found = hit
            if rule.name not in read:
                read.append(rule.name)
            if (n := _version_note(rule, f)) is not None and n not in notes:
                notes.append(n)
            if len(found) > 1:
                notes.append(f"{len(found)} series of {rule.name}: the first is read")
            return found[0].value

        running, waiting = gauge("running_requests"), gauge("waiting_requests")
        usage = gauge("kv_usage_fraction")
        capacity, comparable = self._capacity(g, gauge, notes)
        same_engine = f.engine == g.exporter
        if not same_engine and f.engine is not None:
            notes.append(f"a {g.exporter} page, a plan sized by {f.engine}'s rules: KV figures are not judged")
        predicted = f.kv_capacity_tokens
        cap_err, cap_verdict = _judge(predicted, capacity, f.kv_band if comparable and same_engine else None)
        ceiling = usage_verdict = None
        if predicted and f.request_tokens and running is not None:
            ceiling = min(1.0, max(running, 1.0) * f.request_tokens / predicted)
        if usage is None or ceiling is None or f.kv_band is None or not same_engine:
            usage_verdict = "not judged"
        else:
            usage_verdict = "outside" if ceiling * (1 + f.kv_band) < 1 and usage > ceiling * (1 + f.kv_band) else "within"
        ttft, (ttft_buckets, ttft_window) = self._percentiles(g, "ttft_seconds", version, histograms, read, interval)
        tpot, _ = self._percentiles(g, "tpot_seconds", version, histograms, read, interval)
        request_tpot, (tpot_buckets, tpot_window) = self._percentiles(g, "request_tpot_seconds", version, histograms,
                                                                      read, interval)
        sla = f.sla
        # TTFT: a request still waiting has no first token in the histogram yet, and may be over the limit.
        ttft_sla = None if sla is None or sla.max_ttft_seconds is None or ttft is None else \
            sla_check(sla.percentile, sla.max_ttft_seconds, ttft_buckets, ttft_window, ttft.metric,
                      unseen=waiting or 0.0)
        # TPOT over the requests finished in the window, as a benchmark client counts it.
        tpot_sla = None if sla is None or sla.max_tpot_seconds is None or request_tpot is None else \
            sla_check(sla.percentile, sla.max_tpot_seconds, tpot_buckets, tpot_window, request_tpot.metric, "TPOT")
        for c in (ttft_sla, tpot_sla):
            if c is not None and c.verdict == "not judged":
                notes.append(f"SLA not judged: {c.note}")
        if sla is not None and sla.max_tpot_seconds is not None and request_tpot is None:
            notes.append("SLA's TPOT not judged: the page has no per-request TPOT histogram (vLLM's "
                         "vllm:request_time_per_output_token_seconds); its inter-token histogram is not a request's TPOT")
        return ReplicaRow(
            replica=replica, endpoint=safe_text(g.url), exporter=g.exporter, engine=safe_text(g.engine),  # type: ignore[arg-type]
            pod=safe_text(g.pod), running_requests=running, waiting_requests=waiting, predicted_batch_size=f.batch_size,
            kv_usage_fraction=usage, kv_usage_ceiling_fraction=ceiling, kv_usage_verdict=usage_verdict,
            kv_capacity_tokens=capacity, kv_capacity_predicted_tokens=predicted,
            kv_band_abs_error=f.kv_band, kv_capacity_error=cap_err, kv_capacity_verdict=cap_verdict, ttft=ttft,
            ttft_predicted_seconds=f.ttft_seconds, tpot=tpot, tpot_predicted_seconds=f.tpot_seconds,
            predicted_request_rate_per_second=f.load_request_rate_per_replica,
            ttft_predicted=PlanPercentiles.of(f.ttft_plan_seconds), tpot_predicted=PlanPercentiles.of(f.tpot_plan_seconds),
            ttft_sla=ttft_sla, request_tpot=request_tpot, tpot_sla=tpot_sla, metrics_read=read, notes=notes)

    def _capacity(self, g: _EngineGroup, gauge: Callable[[str], float | None], notes: list[str]) -> tuple[float | None, bool]:
        """The engine's KV cache in tokens, and whether it may be held against the plan."""
        f = self.facts
        if g.exporter == "sglang":
            cap = gauge("kv_capacity_tokens")
            if cap is not None:
                return cap, True
            used, usage = gauge("kv_used_tokens"), gauge("kv_usage_fraction")
            if used is None or not usage:
                return None, False
            notes.append("capacity = num_used_tokens / token_usage (token_usage has two decimals)")
            cap = used / usage
            return (cap, True) if math.isfinite(cap) and cap >= 0 else (None, False)
        hit = _pick(self.knowledge.names("vllm", "cache_config"), g.samples)
        if hit is None:
            return None, False
        rule, found = hit
        info = next((s.labels for s in found if s.labels.get("engine", g.engine) == g.engine), found[0].labels)
        try:
            cap = float(info["kv_cache_size_tokens"]) if info.get("kv_cache_size_tokens", "None") != "None" else \
                float(info["num_gpu_blocks"]) * float(info["block_size"])
        except (KeyError, ValueError):
            notes.append(f"{rule.name} states no num_gpu_blocks and block_size")
            return None, False
        if not math.isfinite(cap) or cap < 0:
            return None, False
        if info.get("cpu_kvcache_space_bytes", "None") not in ("None", ""):
            notes.append("a CPU-backend engine (cpu_kvcache_space_bytes): its cache is not sized by GPU memory")
            return cap, False
        if info.get("num_gpu_blocks_override", "None") not in ("None", ""):
            notes.append("num_gpu_blocks_override is set: the engine was told its cache size")
            return cap, False
        util = info.get("gpu_memory_utilization")
        try:
            if util is not None and f.gpu_memory_utilization is not None and abs(float(util) - f.gpu_memory_utilization) > 1e-6:
                notes.append(f"the engine runs gpu_memory_utilization {safe_text(util, 12)}, the plan "
                             f"{f.gpu_memory_utilization:g}: different runs, capacity not judged")
                return cap, False
        except ValueError:
            pass
        return cap, True

    def _percentiles(self, g: _EngineGroup, quantity: str, version: str | None,
                     histograms: dict[tuple, list[tuple[float, float]]], read: list[str],
                     interval: float | None) -> tuple[Percentiles | None, tuple[list[tuple[float, float]], Literal["since start", "last interval"]]]:
        """The histogram's percentiles over their window (since start, or the last interval when it
        saw requests), and the cumulative buckets an SLA is judged over with their window (the last
        interval, even an empty one, once there was a scrape before: the history was judged then)."""
        hit = _pick(self.knowledge.names(g.exporter, quantity, version), g.samples, "_bucket")
        if hit is None:
            return None, ([], "since start")
        rule, found = hit
        if rule.name not in read:
            read.append(rule.name)
        buckets: dict[float, float] = {}
        for s in found:
            try:
                le = float(s.labels.get("le", "nan"))
            except ValueError:
                continue
            if not math.isnan(le):
                buckets[le] = buckets.get(le, 0.0) + s.value
        now = sorted(buckets.items())
        key = (g.url, g.exporter, g.engine, g.pod, rule.name)
        histograms[key] = now
        prev = self._previous.histograms.get(key) if self._previous else None
        window: Literal["since start", "last interval"] = "since start"
        use = judged = now
        judged_window: Literal["since start", "last interval"] = "since start"
        rate = None
        if prev is not None and [b for b, _ in prev] == [b for b, _ in now]:
            delta = [(b, c - p) for (b, c), (_, p) in zip(now, prev)]
            if all(d >= 0 for _, d in delta):  # else the engine restarted: its counts began again
                if interval and interval > 0 and delta and math.isinf(delta[-1][0]):
                    rate = delta[-1][1] / interval
                # The SLA is judged over the interval, even an empty one: the history was judged before.
                judged, judged_window = delta, "last interval"
                if delta[-1][1] > 0:
                    use, window = delta, "last interval"
        qs = [histogram_quantile(q, use) for q in _QUANTILES]
        finite = [(b, c) for b, c in use if math.isfinite(b)]
        total = use[-1][1] if use and math.isinf(use[-1][0]) else 0.0
        return Percentiles(p50_seconds=qs[0], p90_seconds=qs[1], p99_seconds=qs[2], num_observations=total,
                           above_highest_bucket=max(0.0, total - finite[-1][1]) if finite else 0.0,
                           highest_bucket_seconds=finite[-1][0] if finite else None, window=window, metric=rule.name,
                           observations_per_second=rate), (judged, judged_window)


# ----- judging and one-line summaries ------------------------------------------------------------------


def _judge(predicted: float | None, measured: float | None, band: float | None) -> tuple[float | None, Verdict]:
    """predicted / measured - 1, and the verdict against `band` (|error| > band: outside)."""
    if predicted is None or measured is None:
        return None, "not judged"
    if measured <= 0:
        return None, ("not judged" if band is None or predicted <= 0 else "outside")
    err = predicted / measured - 1
    if band is None:
        return err, "not judged"
    return err, ("outside" if abs(err) > band else "within")


def _gib(n: float) -> str:
    return f"{n / units.BYTES_PER_GIB:.2f} GiB"


def _gpu_outside(r: GpuRow) -> list[str]:
    if r.memory_verdict != "outside":
        return []
    assert r.memory_used_bytes is not None and r.memory_predicted_bytes is not None and r.memory_band_abs_error is not None
    return [f"GPU rank {r.rank} (node {r.node}, gpu {r.gpu}, host {r.host or '-'}): memory {_gib(r.memory_used_bytes)} "
            f"measured, {_gib(r.memory_predicted_bytes)} predicted ±{r.memory_band_abs_error:.1%}"]


def _replica_outside(r: ReplicaRow, f: PlanFacts) -> list[str]:
    out = []
    where = f"replica {r.replica} ({r.exporter} {r.endpoint}" + (f" engine {r.engine}" if r.engine else "") + ")"
    if r.kv_capacity_verdict == "outside":
        out.append(f"{where}: KV cache {r.kv_capacity_tokens:,.0f} tokens measured, {r.kv_capacity_predicted_tokens:,} "
                   f"predicted ±{r.kv_band_abs_error:.1%}")
    if r.kv_usage_verdict == "outside":
        assert r.kv_usage_ceiling_fraction is not None and r.kv_band_abs_error is not None
        out.append(f"{where}: KV usage {r.kv_usage_fraction:.1%} with {r.running_requests:,.0f} running requests, "
                   f"predicted at most {r.kv_usage_ceiling_fraction:.1%} +{r.kv_band_abs_error:.1%} "
                   f"({f.request_tokens:,} tokens a request in a {r.kv_capacity_predicted_tokens:,}-token cache)")
    rate = r.ttft.observations_per_second if r.ttft is not None else None  # requests started over the interval
    planned = r.predicted_request_rate_per_second
    whose = " (shardplan's default SLA: recommend's --max-ttft-ms / --max-tpot-ms set yours)" \
        if f.sla is not None and f.sla.defaulted else ""
    for c in (r.ttft_sla, r.tpot_sla):
        if c is not None and c.verdict == "outside":
            if c.window == "since start":
                out.append(f"{where}: {c.note} since the engine started{whose}")
                continue
            load = ""
            if rate is not None and planned is not None:
                load = (f" at {rate:,.2f} req/s, " + ("above" if rate > planned else "within") +
                        f" the {planned:,.2f} a replica was planned for")
            out.append(f"{where}: {c.note} over the last interval{load}{whose}")
    return out


def _span(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:8])) + (f" and {len(xs) - 8} more" if len(xs) > 8 else "")


def open_watch(plan: Path, urls: list[str], map_path: Path | None = None, *,
               fetch: Callable[[str], bytes] = fetch_page) -> Watcher:
    """The task: read the plan (and map file) once; each `scrape()` returns a typed WatchScrape.
    Bad input (plan, map, URLs) raises a ShardplanError (exit 2) before anything is fetched."""
    return Watcher(plan, urls, map_path, fetch=fetch)


def exit_error(result: WatchScrape) -> ShardplanError | None:
    """The one-line error a scrape's status maps to (exit 5 before 4), or None when it is ok."""
    bad = [e for e in result.endpoints if e.error]
    if bad:
        more = f" (and {len(bad) - 1} more endpoint(s))" if len(bad) > 1 else ""
        return EndpointUnreadable(f"{bad[0].error}{more}", source=bad[0].url)
    if result.outside:
        more = f" (and {len(result.outside) - 1} more)" if len(result.outside) > 1 else ""
        return OutsideBand(f"outside: {result.outside[0]}{more}", source=result.plan)  # the line says which band or limit
    return None


__all__ = ["EndpointReport", "EndpointUnreadable", "SlaCheck", "FETCH_DEADLINE_SECONDS", "GpuRow", "MAX_LINE_CHARS", "MAX_LINES",
           "MAX_PAGE_BYTES", "MAX_PARSED_CHARS", "MAX_SERIES",
           "OutsideBand", "Percentiles", "PlanFacts", "ReplicaRow", "TIMEOUT_SECONDS", "WatchMap", "WatchScrape",
           "Watcher", "check_url", "decode_page", "exit_error", "fetch_page", "histogram_quantile", "load_map",
           "open_watch", "parse_page", "plan_facts", "safe_text", "sla_check"]
