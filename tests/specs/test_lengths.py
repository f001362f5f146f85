"""Request-length distributions (shardplan/specs/lengths.py): the sampler is deterministic and its
sample means converge to the distribution's means; the bundled ShareGPT histogram reproduces the
figures computed from its source file; the uniform kinds follow the vLLM and SGLang benchmark
clients' formulas; clipping to a context is exact; hostile lengths files fail fast, with one line
naming the file and the field."""

from __future__ import annotations

import fnmatch
import itertools
import json
import math
import random
import statistics
import time
import tomllib
from pathlib import Path

import pytest
from conftest import REPO

from shardplan.errors import EXIT_BAD_INPUT, ShardplanError, UnknownNameError
from shardplan.specs import lengths as L
from shardplan.specs.lengths import LengthDistribution, LengthKind, TokenBins, load_lengths
from shardplan.specs.loading import read_structured

DATASETS = REPO / "shardplan" / "knowledge" / "datasets"


# ----- the sampler ----------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    for dist in (load_lengths("sharegpt"), LengthDistribution.uniform_sglang(1024, 256, 0.0),
                 load_lengths("sharegpt").clipped(600)):
        first = dist.sample(500, seed=7)
        assert first == dist.sample(500, seed=7)
        assert first != dist.sample(500, seed=8)
        assert len(first) == 500 and all(type(i) is int and type(o) is int for i, o in first)
    assert LengthDistribution.fixed(3, 5).sample(0, seed=1) == ()


# Tolerance: 5 standard errors of the sample mean (the sample's sd / sqrt(20,000)): a correct
# sampler misses by more once in ~1.7 million draws of the seed; a biased one (a bin edge off by
# one, a cell drawn with the wrong weight) moves the mean by far more on these distributions. A
# fixed distribution has sd 0 and must match exactly.
NUM_DRAWS = 20_000
NUM_STANDARD_ERRORS = 5


@pytest.mark.parametrize("dist", [
    LengthDistribution.fixed(1024, 128),
    LengthDistribution.uniform_sglang(2048, 512, 0.0),
    LengthDistribution.uniform_vllm(1000, 300, 0.9),
    load_lengths("sharegpt"),
    load_lengths("sharegpt").scaled_to(230, 200),
    load_lengths("sharegpt").clipped(700),
], ids=["fixed", "sglang-r0", "vllm-r0.9", "sharegpt", "sharegpt-scaled", "sharegpt-clipped"])
def test_sample_means_converge_to_the_distribution_means(dist):
    pairs = dist.sample(NUM_DRAWS, seed=2024)
    for values, mean in (([i for i, _ in pairs], dist.mean_input_tokens), ([o for _, o in pairs], dist.mean_output_tokens)):
        standard_error = statistics.stdev(values) / math.sqrt(NUM_DRAWS)
        assert abs(statistics.fmean(values) - mean) <= NUM_STANDARD_ERRORS * standard_error, (mean, standard_error)
    # and the sample means are within 2% either way (a check on the seed, not on the sampler)
    assert statistics.fmean(i for i, _ in pairs) == pytest.approx(dist.mean_input_tokens, rel=0.02)


def test_per_request_lengths_round_trip_through_the_sampler():
    ins, outs = [5, 5, 900, 17], [40, 40, 3, 2000]
    dist = LengthDistribution.from_requests(ins, outs, source="test")
    assert dist.paired and dist.kind is LengthKind.HISTOGRAM
    assert dist.mean_input_tokens == pytest.approx(statistics.fmean(ins))
    assert dist.mean_output_tokens == pytest.approx(statistics.fmean(outs))
    assert set(dist.sample(200, seed=0)) == set(zip(ins, outs))  # pairs stay pairs


# ----- the bundled ShareGPT histogram -------------------------------------------------------


# The figures each file's `summary` states, as computed from its source file (sha256 in the file):
# a changed summary must be a deliberate edit of this table too.
# name -> (requests, mean input, median input, mean output, median output)
SUMMARIES = {
    "sharegpt": (15460, 219.60, 105, 202.87, 135),  # vLLM's first-turn sampling, Qwen tokenizer
    "sharegpt-sarathi": (11035, 378.04, 297, 418.90, 402),  # the Sarathi-Serve trace, Llama-2 tokenizer
}


@pytest.mark.parametrize("name", sorted(SUMMARIES))
def test_sharegpt_bins_reproduce_the_figures_computed_from_the_source_file(name):
    """The YAML's `summary` is computed from the source (its header says how); the bins must give
    the same means within 2%, and their sampled medians within 5% (a median falls inside a bin
    whose within-bin shape the histogram does not keep)."""
    raw = read_structured(DATASETS / f"{name}.yaml")
    summary = raw["summary"]
    assert (summary["num_requests"], summary["mean_input_tokens"], summary["median_input_tokens"],
            summary["mean_output_tokens"], summary["median_output_tokens"]) == SUMMARIES[name]
    assert sum(b["weight"] for b in raw["input_bins"]) == summary["num_requests"]
    assert sum(b["weight"] for b in raw["output_bins"]) == summary["num_requests"]
    dist = load_lengths(name)
    assert dist.mean_input_tokens == pytest.approx(summary["mean_input_tokens"], rel=0.02)
    assert dist.mean_output_tokens == pytest.approx(summary["mean_output_tokens"], rel=0.02)
    pairs = dist.sample(20_001, seed=1)
    assert statistics.median(i for i, _ in pairs) == pytest.approx(summary["median_input_tokens"], rel=0.05)
    assert statistics.median(o for _, o in pairs) == pytest.approx(summary["median_output_tokens"], rel=0.05)


@pytest.mark.parametrize("name", sorted(SUMMARIES))
def test_sharegpt_respects_the_filter_it_records(name):
    """vLLM's filter keeps 4 <= prompt <= 1024, output >= 4, prompt + output <= 2048. Input and
    output are drawn independently, so a drawn pair can pass 2048 where no kept pair did: at most
    0.1% of draws (clipped(2048) refuses them, as the engine would)."""
    dist = load_lengths(name)
    assert min(dist.input_bins.min_tokens) >= 4 and max(dist.input_bins.max_tokens) <= 1024
    assert min(dist.output_bins.min_tokens) >= 4 and max(dist.output_bins.max_tokens) <= 2048 - 4
    assert 40 <= len(dist.input_bins.weights) + len(dist.output_bins.weights) <= 80
    assert dist.clipped(2048).refused_fraction <= 0.001


def test_vllms_sharegpt_outputs_are_right_skewed_and_the_trace_is_not():
    """What separates the two: vLLM's client sends the first answer of each conversation, whose
    length is right-skewed (median 135, mean 203 in the source), while the multi-turn trace's
    outputs are near-symmetric (median 402, mean 419). The tail is what drains last in a burst."""
    vllm, trace = load_lengths("sharegpt"), load_lengths("sharegpt-sarathi")
    for dist, skewed in ((vllm, True), (trace, False)):
        outs = sorted(o for _, o in dist.sample(20_001, seed=3))
        median, mean, p99 = outs[10_000], statistics.fmean(outs), outs[19_801]
        assert (median < 0.75 * mean) is skewed
        assert (p99 > 3.5 * mean) is skewed


def test_bundled_names_are_found_in_any_case_and_misspellings_get_a_suggestion():
    assert load_lengths("ShareGPT").source == "sharegpt"
    with pytest.raises(UnknownNameError) as e:
        load_lengths("sharegtp")
    assert "sharegpt" in e.value.one_line() and e.value.field == "--dataset-lengths"


def test_the_wheel_carries_the_bundled_datasets():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["shardplan.knowledge"]
    for path in (REPO / "shardplan" / "knowledge" / "datasets").glob("*.yaml"):
        rel = path.relative_to(REPO / "shardplan" / "knowledge").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"{rel} is not package data"


# ----- the benchmark clients' uniform formulas ------------------------------------------------


def _bounds(dist: LengthDistribution) -> tuple[int, int, int, int]:
    i, o = dist.input_bins, dist.output_bins
    return i.min_tokens[0], i.max_tokens[0], o.min_tokens[0], o.max_tokens[0]


@pytest.mark.parametrize("input_len,output_len", [(1024, 128), (1000, 1), (7, 3), (32768, 1500)])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.5, 0.9])
def test_vllm_random_dataset_bounds(input_len, output_len, ratio):
    """vllm/benchmarks/datasets/random.py get_sampling_params: input on [floor(n(1-r)),
    ceil(n(1+r))], output on [max(1, floor(m(1-r))), max(1, ceil(m(1+r)))], inclusive
    (rng.integers(low, high + 1))."""
    want = (math.floor(input_len * (1 - ratio)), math.ceil(input_len * (1 + ratio)),
            max(1, math.floor(output_len * (1 - ratio))), max(1, math.ceil(output_len * (1 + ratio))))
    if want[0] < 1:
        with pytest.raises(ShardplanError):
            LengthDistribution.uniform_vllm(input_len, output_len, ratio)
        return
    dist = LengthDistribution.uniform_vllm(input_len, output_len, ratio)
    assert _bounds(dist) == want
    assert dist.mean_input_tokens == (want[0] + want[1]) / 2


def test_vllm_subtracts_special_tokens_from_the_input_before_drawing():
    assert _bounds(LengthDistribution.uniform_vllm(1024, 128, 0.5, num_special_tokens=1))[:2] == (511, 1535)


@pytest.mark.parametrize("input_len,output_len", [(1024, 128), (1000, 1), (7, 3), (32768, 1500)])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_sglang_random_dataset_bounds(input_len, output_len, ratio):
    """sglang compute_random_lens: np.random.randint(max(int(n r), 1), n + 1) for input and output."""
    want = (max(int(input_len * ratio), 1), input_len, max(int(output_len * ratio), 1), output_len)
    dist = LengthDistribution.uniform_sglang(input_len, output_len, ratio)
    assert _bounds(dist) == want
    assert dist.kind is (LengthKind.FIXED if ratio == 1.0 or (want[0] == want[1] and want[2] == want[3])
                         else LengthKind.UNIFORM)


def test_a_narrow_uniform_range_is_sampled_to_both_ends_and_never_beyond():
    dist = LengthDistribution.uniform_vllm(10, 4, 0.5)  # input [5, 15], output [2, 6]
    pairs = dist.sample(3000, seed=3)
    assert {i for i, _ in pairs} == set(range(5, 16))
    assert {o for _, o in pairs} == set(range(2, 7))


@pytest.mark.parametrize("ratio", [-0.1, 1.0, math.nan, math.inf])
def test_vllm_refuses_a_range_ratio_outside_0_to_1(ratio):
    with pytest.raises(ShardplanError) as e:
        LengthDistribution.uniform_vllm(1024, 128, ratio)
    assert e.value.field == "--random-range-ratio"


@pytest.mark.parametrize("value", [0, -5, 10_000_001, True, 3.5])
def test_bad_option_lengths_are_refused(value):
    with pytest.raises(ShardplanError) as e:
        LengthDistribution.fixed(value, 10)
    assert e.value.field == "--input-len" and e.value.exit_code == EXIT_BAD_INPUT


# ----- rescaling and clipping ---------------------------------------------------------------


@pytest.mark.parametrize("target_in,target_out", [(230, 200), (50, 1000), (4, 2), (100_000, 8)])
def test_scaled_to_hits_the_means_within_half_a_token(target_in, target_out):
    dist = load_lengths("sharegpt").scaled_to(target_in, target_out)
    assert abs(dist.mean_input_tokens - target_in) <= 0.5
    assert abs(dist.mean_output_tokens - target_out) <= 0.5
    assert min(dist.input_bins.min_tokens) >= 1 and min(dist.output_bins.min_tokens) >= 1


def test_scaled_to_refuses_a_mean_below_one_token():
    with pytest.raises(ShardplanError) as e:
        load_lengths("sharegpt").scaled_to(0.5, 100)
    assert e.value.field == "mean_input_tokens"


def _brute(a: int, b: int, c: int, d: int, limit: int) -> tuple[int, int, int]:
    pts = [(x, y) for x in range(a, b + 1) for y in range(c, d + 1) if x + y <= limit]
    return len(pts), sum(x for x, _ in pts), sum(y for _, y in pts)


def test_the_closed_form_of_a_clipped_cell_matches_enumeration():
    rng = random.Random(0)
    for _ in range(400):
        a, c = rng.randint(1, 30), rng.randint(1, 30)
        b, d = a + rng.randint(0, 30), c + rng.randint(0, 30)
        limit = rng.randint(2, 100)
        assert L._fitting_moments(a, b, c, d, limit) == _brute(a, b, c, d, limit), (a, b, c, d, limit)


def test_clipping_keeps_only_requests_that_fit_with_exact_means_and_refused_share():
    dist = LengthDistribution.uniform(input_min_tokens=1, input_max_tokens=40, output_min_tokens=5,
                                      output_max_tokens=30, source="test")
    clipped = dist.clipped(40)
    count, sum_in, sum_out = _brute(1, 40, 5, 30, 40)
    assert clipped.mean_input_tokens == pytest.approx(sum_in / count)
    assert clipped.mean_output_tokens == pytest.approx(sum_out / count)
    assert clipped.refused_fraction == pytest.approx(1 - count / (40 * 26))
    pairs = clipped.sample(20_000, seed=5)
    assert max(i + o for i, o in pairs) <= 40
    # Uniform over the fitting points: every point drawn about equally often.
    counts = [pairs.count(p) for p in itertools.islice(((x, y) for x in range(1, 36) for y in range(5, 31)
                                                        if x + y <= 40), 0, None, 37)]
    expected = 20_000 / count
    assert all(abs(n - expected) < 5 * math.sqrt(expected) for n in counts), counts


def test_clipping_refuses_when_no_request_fits():
    with pytest.raises(ShardplanError) as e:
        LengthDistribution.fixed(4096, 512).clipped(4096)
    assert e.value.field == "--max-model-len" and "4608" in e.value.one_line()
    with pytest.raises(ShardplanError):
        load_lengths("sharegpt").clipped(7)  # the shortest ShareGPT request is 4 + 4 tokens
    assert load_lengths("sharegpt").clipped(8).sample(10, seed=0) == ((4, 4),) * 10


# ----- hostile files ------------------------------------------------------------------------

# Each one must fail with the file and (where the problem is in a value) the field named, and
# fast: loading is bounded by the size caps and stops at the first bad entry. CPU seconds of this
# process (the load runs in it), so that the rest of the machine's load does not count.
MAX_SECONDS = 2.0


def _fails(path: Path, field: str | None, *words: str) -> ShardplanError:
    start = time.process_time()
    with pytest.raises(ShardplanError) as e:
        load_lengths(str(path))
    elapsed = time.process_time() - start
    err = e.value
    assert elapsed < MAX_SECONDS, f"{path.name} took {elapsed:.2f} s"
    assert err.source == str(path) and err.exit_code == EXIT_BAD_INPUT
    assert err.field == field, err.one_line()
    line = err.one_line()
    assert "\n" not in line and str(path) in line and err.hint
    for w in words:
        assert w in line, line
    return err


@pytest.mark.parametrize("name", ["empty.yaml", "empty.json"])
def test_an_empty_file(tmp_path, name):
    path = tmp_path / name
    path.write_text("" if name.endswith(".yaml") else "{}")
    _fails(path, None, "empty", "input_tokens")


def test_a_million_and_one_requests(tmp_path):
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"input_tokens": [1] * 1_000_001, "output_tokens": [1] * 1_000_001}))
    _fails(path, "input_tokens", "1000001", "more than 1000000")


def test_a_million_requests_are_fine(tmp_path):
    path = tmp_path / "million.json"
    ins = [100 + i % 900 for i in range(1_000_000)]
    path.write_text(json.dumps({"input_tokens": ins, "output_tokens": [5 + i % 700 for i in range(1_000_000)]}))
    start = time.perf_counter()
    dist = load_lengths(str(path))
    assert time.perf_counter() - start < 10  # a budget for slow CI machines; about 1 s here
    assert dist.mean_input_tokens == pytest.approx(statistics.fmean(ins))


def test_nan(tmp_path):
    yaml_path = tmp_path / "nan.yaml"
    yaml_path.write_text("input_tokens: [10, .nan]\noutput_tokens: [5, 6]\n")
    _fails(yaml_path, "input_tokens.1", "nan")
    json_path = tmp_path / "nan.json"
    json_path.write_text('{"input_bins": [{"min_tokens": 1, "max_tokens": 9, "weight": NaN}],'
                         ' "output_bins": [{"min_tokens": 1, "max_tokens": 9, "weight": 1}]}')
    _fails(json_path, "input_bins.0.weight", "finite")


def test_negative_values(tmp_path):
    path = tmp_path / "negative.yaml"
    path.write_text("input_tokens: [10, 20]\noutput_tokens: [5, -6]\n")
    _fails(path, "output_tokens.1", "-6")
    bins = tmp_path / "negative_weight.yaml"
    bins.write_text("joint_bins:\n  - {input_min_tokens: 1, input_max_tokens: 2, output_min_tokens: 1,"
                    " output_max_tokens: 2, weight: -1}\n")
    _fails(bins, "joint_bins.0.weight", "greater than or equal to 0")


def test_strings_and_booleans(tmp_path):
    path = tmp_path / "strings.json"
    path.write_text('{"input_tokens": ["812", 3], "output_tokens": [1, 2]}')
    _fails(path, "input_tokens.0", "'812'")
    flags = tmp_path / "bools.yaml"
    flags.write_text("input_tokens: [true]\noutput_tokens: [1]\n")
    _fails(flags, "input_tokens.0", "True")
    bins = tmp_path / "string_bin.yaml"
    bins.write_text("input_bins: [{min_tokens: one, max_tokens: 9, weight: 1}]\n"
                    "output_bins: [{min_tokens: 1, max_tokens: 9, weight: 1}]\n")
    _fails(bins, "input_bins.0.min_tokens", "integer")


@pytest.mark.parametrize("suffix,cap", [(".json", L.MAX_JSON_BYTES), (".yaml", L.MAX_YAML_BYTES)])
def test_a_huge_file_is_refused_before_it_is_read(tmp_path, suffix, cap):
    path = tmp_path / f"huge{suffix}"
    with path.open("wb") as f:
        f.truncate(cap + 1)  # sparse: costs no disk
    _fails(path, None, "limit")


def test_a_device_is_not_read(tmp_path):
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    _fails(link, None, "not a regular file")


@pytest.mark.parametrize("text,field,word", [
    ("input_tokens: [1, 2]\n", "output_tokens", "missing"),
    ("input_tokens: [1, 2]\noutput_tokens: [3]\n", "output_tokens", "has 1 entries"),
    ("input_tokens: []\noutput_tokens: []\n", "input_tokens", "at least 1"),
    ("input_bins: [{min_tokens: 9, max_tokens: 1, weight: 1}]\noutput_bins: [{min_tokens: 1, max_tokens: 1, weight: 1}]\n",
     "input_bins.0", "above max_tokens"),
    ("input_bins: [{min_tokens: 1, max_tokens: 9, weight: 0}]\noutput_bins: [{min_tokens: 1, max_tokens: 1, weight: 1}]\n",
     "input_bins", "sum to 0"),
    ("input_tokens: [1]\noutput_tokens: [1]\njoint_bins: [{input_min_tokens: 1, input_max_tokens: 1, "
     "output_min_tokens: 1, output_max_tokens: 1, weight: 1}]\n", "joint_bins", "and"),
    ("input_token: [1]\noutput_tokens: [1]\n", "input_token", "did you mean 'input_tokens'"),
    ("- 1\n- 2\n", None, "mapping"),
    ("input_tokens: [1, 2]\ninput_tokens: [3]\n", None, "duplicate key"),
])
def test_malformed_files(tmp_path, text, field, word):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    _fails(path, field, word)


def test_a_missing_file_and_an_unknown_suffix(tmp_path):
    with pytest.raises(ShardplanError) as e:
        load_lengths(str(tmp_path / "nope.yaml"))
    assert "file not found" in e.value.one_line()
    odd = tmp_path / "lengths.txt"
    odd.write_text("1 2 3")
    _fails(odd, None, ".json")


def test_token_bins_guard_the_code_that_builds_them():
    with pytest.raises(ValueError):
        TokenBins((0,), (3,), (1.0,))
    with pytest.raises(ValueError):
        TokenBins((1,), (3,), (0.0,))
