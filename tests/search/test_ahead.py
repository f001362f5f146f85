"""Work ahead on forked workers (search/ahead.py) changes the wall time of a search, never what it
finds: `in_order` yields each index's own answer in the order given, skips exactly what `keep`
leaves out when its turn comes, and falls back to this process where a worker fails; a serving
search with workers returns the same plans, figures, Pareto front and counts as on one core, and
`recommend` the same answer, estimates included. Each case checks that workers ran."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from shardplan.cost import inputs
from shardplan.cost.workload import Quantization, ServingLoad
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import engine_rules
from shardplan.search import Goal, Objective, Space, ahead, search
from shardplan.search.space import SearchResult
from shardplan.specs.loading import load_hardware, load_model

pytestmark = pytest.mark.skipif(not ahead._can_fork(), reason="workers are forked: Linux only")


@pytest.fixture
def started(monkeypatch):
    """How many indices the parent gave to workers (Ahead.start runs in the parent)."""
    count = [0]
    real = ahead.Ahead.start

    def start(self, i, args=()):
        count[0] += 1
        return real(self, i, args)
    monkeypatch.setattr(ahead.Ahead, "start", start)
    return count


def _square_with_pid(i: int) -> tuple[int, int]:
    return i * i, os.getpid()


def test_in_order_gives_each_index_its_own_answer_in_order(started):
    order = [5, 3, 8, 1, 0, 9, 2, 7, 4, 6]
    got = list(ahead.in_order(order, _square_with_pid, workers=2))
    assert [i for i, _ in got] == order
    assert [answer[0] for _, answer in got] == [i * i for i in order]
    assert started[0] > 0
    assert {pid for _, (_, pid) in got} - {os.getpid()}  # some answers came from a worker


def test_in_order_skips_what_keep_leaves_out_at_its_turn(started):
    """`keep` may change as answers are used (a search's bar rises): an index is skipped when its
    turn comes, whatever a worker computed for it before."""
    bar = [0]
    kept = []
    for i, answer in ahead.in_order(list(range(12)), _square_with_pid, workers=1, keep=lambda i: i % 3 != bar[0] % 3):
        if answer is ahead.SKIPPED:
            continue
        kept.append((i, answer[0]))
        bar[0] = i + 1  # skip the next index if it is one more than a multiple of 3 away
    expected, bar2 = [], 0
    for i in range(12):
        if i % 3 != bar2 % 3:
            expected.append((i, i * i))
            bar2 = i + 1
    assert kept == expected and started[0] > 0


def _fails_in_a_worker(i: int) -> int:
    if os.getpid() != PARENT:
        raise RuntimeError("a worker's failure")
    return i + 100


PARENT = os.getpid()


def test_a_failed_worker_answer_is_computed_here(started):
    global PARENT
    PARENT = os.getpid()  # the pytest worker this runs in
    assert [a for _, a in ahead.in_order(list(range(6)), _fails_in_a_worker, workers=1)] == [100, 101, 102, 103, 104, 105]
    assert started[0] > 0


def _dies_in_a_worker(i: int) -> int:
    if os.getpid() != PARENT and i == 2:
        os._exit(1)  # killed, out of memory: the pool never answers for it
    return i + 100


def test_a_dead_worker_is_not_waited_for(started):
    """A worker that dies takes its point with it; the search costs it itself and goes on."""
    global PARENT
    PARENT = os.getpid()
    assert [a for _, a in ahead.in_order(list(range(8)), _dies_in_a_worker, workers=1)] == [100 + i for i in range(8)]
    assert started[0] > 0


def _unpicklable_in_a_worker(i: int):
    if os.getpid() != PARENT:
        return lambda: i  # a worker's answer that cannot be sent back
    return i


def test_an_answer_that_cannot_come_back_is_computed_here(started):
    global PARENT
    PARENT = os.getpid()
    assert [a for _, a in ahead.in_order(list(range(6)), _unpicklable_in_a_worker, workers=1)] == list(range(6))
    assert started[0] > 0


def _raises_for_3(i: int) -> int:
    if i == 3:
        raise ValueError("point 3 cannot be costed")
    return i


@pytest.mark.parametrize("workers", [0, 1])
def test_an_error_ahead_of_its_turn_is_raised_at_its_turn_only(workers):
    """An index computed early that raises: nothing if it is left out when its turn comes, and the
    error at its turn otherwise, as on one core."""
    skip3 = list(ahead.in_order(list(range(6)), _raises_for_3, workers, keep=lambda i: i != 3))
    assert [a for _, a in skip3] == [0, 1, 2, ahead.SKIPPED, 4, 5]
    seen = []
    with pytest.raises(ValueError, match="point 3"):
        for i, a in ahead.in_order(list(range(6)), _raises_for_3, workers):
            seen.append(a)
    assert seen == [0, 1, 2]


def _negate(i: int) -> int:
    return -i


def test_two_searches_in_two_threads_keep_their_own_tasks():
    """Each pool's workers get their task from the pool's own start arguments."""
    import threading

    out: dict[str, list] = {}

    def run(name, task):
        out[name] = [a for _, a in ahead.in_order(list(range(40)), task, workers=2)]
    threads = [threading.Thread(target=run, args=(name, task)) for name, task in
               (("square", _square_with_pid), ("negate", _negate))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [a[0] for a in out["square"]] == [i * i for i in range(40)]
    assert out["negate"] == [-i for i in range(40)]


@pytest.mark.parametrize("args", [
    ("recommend", "llama-3.1-8b", "--gpus", "2", "--json"),
    ("recommend", "llama-3.1-8b", "--gpus", "2", "--workload", "training", "--json"),  # no worker would run
])
@pytest.mark.parametrize("value,words", [("two", "whole number"), ("-1", "negative")])
def test_bad_worker_count_is_one_line(cli, monkeypatch, args, value, words):
    monkeypatch.setenv(ahead.WORKERS_ENV, value)
    r = cli(*args)
    assert r.exit_code == 2 and words in r.stderr and ahead.WORKERS_ENV in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_worker_count_setting(monkeypatch):
    monkeypatch.setenv(ahead.WORKERS_ENV, "0")
    assert ahead.search_workers() == 0
    monkeypatch.setenv(ahead.WORKERS_ENV, "3")
    assert ahead.search_workers() == 3
    monkeypatch.setenv(ahead.WORKERS_ENV, "1000")
    assert ahead.search_workers() == ahead.MAX_WORKERS
    monkeypatch.setenv(ahead.WORKERS_ENV, "x")
    with pytest.raises(ShardplanError):
        ahead.search_workers()


def _goodput_case(model: str, formats: tuple[str, ...], rate: float | None = None):
    spec = load_model(model).spec
    hw = load_hardware("h100-sxm-80gb")
    wl = inputs.inference_workload(
        engine=engine_rules("vllm", None), hw=hw, model_max_len=spec.max_position_embeddings,
        max_model_len=8192, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
        input_len=1024, output_len=128, batch_size=None)
    wl = replace(wl, load=ServingLoad() if rate is None else ServingLoad(request_rate_per_second=rate, num_requests=200))
    space = replace(Space(), quantizations=(Quantization.NONE, *map(Quantization, formats)),
                    kv_cache_dtypes=(wl.kv_cache_dtype,))
    goal = Goal(Objective.GOODPUT, top_k=5, max_ttft_seconds=1.0, max_tpot_seconds=0.05, slo_percentile=90)
    return spec, hw, wl, space, goal


def _view(res: SearchResult) -> tuple:
    return ([(e.layout, e.workload, e.objective_value, e.key, e.figures, e.tight) for e in res.top],
            [(e.layout, e.objective_value) for e in res.pareto],
            res.num_candidates, res.num_evaluated, res.num_costed, res.num_feasible, res.num_steps,
            dict(res.rejected), dict(res.invalid), dict(res.sla_floor_seconds))


@pytest.mark.parametrize("model,formats,max_gpus,rate", [
    ("llama-3.1-70b", ("fp8", "int4"), 8, None),  # several counts, bounded-out points, memo hits across counts
    ("qwen3-30b-a3b", ("fp8",), 4, None),  # MoE
    ("llama-3.1-70b", ("fp8", "int4"), 8, 6.0),  # at a given rate: every point, in order
])
def test_goodput_search_with_workers_equals_one_core(started, model, formats, max_gpus, rate):
    spec, hw, wl, space, goal = _goodput_case(model, formats, rate)
    one = search(spec, hw, wl, space, goal, max_gpus=max_gpus)  # Space.workers 0: this process alone
    assert started[0] == 0
    two = search(spec, hw, wl, replace(space, workers=1), goal, max_gpus=max_gpus)
    assert started[0] > 0
    assert one.top and _view(one) == _view(two)


def test_recommend_answer_with_workers_equals_one_core(cli, monkeypatch, started):
    """The whole answer: the search and each top plan's estimate under its traffic (simulated again,
    by the workers too), the disaggregated comparison, the Pareto front."""
    args = ("recommend", "llama-3.1-8b", "--gpus", "4", "--json")
    monkeypatch.setenv(ahead.WORKERS_ENV, "0")
    one = cli(*args)
    monkeypatch.setenv(ahead.WORKERS_ENV, "1")
    two = cli(*args)
    assert one.exit_code == two.exit_code == 0 and started[0] > 0

    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in ("elapsed_seconds", "evaluated_per_second")}
        return [strip(x) for x in d] if isinstance(d, list) else d
    a, b = strip(json.loads(one.stdout)), strip(json.loads(two.stdout))
    assert a["top"] and a == b
