"""--min-throughput on a goodput search: a layout whose bound on goodput (search/serving.py
`_goodput_bound`, never below what its simulation finds) times its GPUs is short of the limit is
refused without simulating it; what the search returns is what it returned when every layout was
simulated and then held to the limit."""

from __future__ import annotations

from shardplan.search.serving import BOUNDED_UNDER_MIN_THROUGHPUT


def _plans(d: dict) -> list[tuple]:
    return [(e["plan"]["tp"], e["plan"]["pp"], e["plan"]["dp"], e["objective_value"]) for e in d["top"]]


def test_a_limit_between_the_plans_keeps_exactly_those_that_reach_it(cli):
    everything = cli("recommend", "llama-3.1-8b", "--gpus", "8", "--top", "30", "--json").json()
    totals = [-e["objective_value"] * e["num_gpus"] for e in everything["top"]]  # goodput per GPU x GPUs
    assert len(totals) >= 6 and totals == sorted(totals, reverse=True)
    kept = next(k for k in range(len(totals) // 2, len(totals)) if totals[k - 1] > totals[k])  # no tie at the limit
    limit = (totals[kept - 1] + totals[kept]) / 2
    held = cli("recommend", "llama-3.1-8b", "--gpus", "8", "--top", "30", "--min-throughput", repr(limit), "--json").json()
    assert _plans(held) == _plans(everything)[:kept]
    assert held["num_evaluated"] == everything["num_evaluated"]
    assert sum(held["rejected"].values()) == held["num_evaluated"] - held["num_feasible"] == len(totals) - kept
    # some are refused by their bound, without a simulation, the others after one
    assert held["rejected"].get(BOUNDED_UNDER_MIN_THROUGHPUT, 0) >= 1, held["rejected"]
    assert set(held["rejected"]) <= {"throughput under --min-throughput", BOUNDED_UNDER_MIN_THROUGHPUT}


def test_a_layout_no_batch_of_which_meets_the_tpot_limit_still_gives_the_default_slas_fallback(cli):
    """Its bound is 0: it goes the usual way, so the search knows the SLA's floor, and without a
    limit of the user's own the answer is ranked without the default SLA (as without --min-throughput)."""
    r = cli("recommend", "llama-3.1-8b", "--hardware", "l4-24gb", "--gpus", "1", "--min-throughput", "1", "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["top"]
    asked = cli("recommend", "llama-3.1-8b", "--hardware", "l4-24gb", "--gpus", "1", "--min-throughput", "1",
                "--max-tpot-ms", "40", "--json")
    assert asked.exit_code == 3
    assert any(s["change"].startswith("--max-tpot-ms ") for s in asked.json()["suggestions"])


def test_a_limit_no_bound_reaches_simulates_nothing_and_says_why(cli):
    r = cli("recommend", "llama-3.1-8b", "--gpus", "1", "--min-throughput", "1e9", "--json")
    assert r.exit_code == 3
    d = r.json()
    assert d["top"] == [] and d["rejected"] == {BOUNDED_UNDER_MIN_THROUGHPUT: d["num_evaluated"]}
    # No other change can reach it either: no GPU count up to the suggestion's limit, and no shorter
    # context (which frees memory, not time) is searched for.
    assert d["suggestions"] == []


def test_a_smaller_batch_is_still_suggested_where_it_lowers_tpot(cli):
    """Only a layout refused for --min-throughput alone skips the halvings: a smaller batch lowers TPOT."""
    r = cli("recommend", "llama-3.1-8b", "--gpus", "1", "--objective", "latency", "--batch-size", "256",
            "--max-tpot-ms", "12", "--json")
    assert r.exit_code == 3
    assert "--batch-size 64" in [s["change"] for s in r.json()["suggestions"]]
