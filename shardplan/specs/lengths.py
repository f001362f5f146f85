"""Request lengths for the serving simulator: how many prompt (input) and generated (output)
tokens each request has, as a distribution to sample from.

Three kinds (`LengthKind`):

- fixed: every request alike (`--input-len/--output-len`);
- uniform: input and output drawn independently and uniformly from integer ranges, as the
  benchmark clients' random datasets do with a range ratio (`uniform_vllm`, `uniform_sglang`
  state each client's formula, with its source);
- histogram: weighted bins of token ranges, either separate (input and output drawn
  independently) or joint (each bin a cell pairing an input range with an output range). Lists
  of per-request lengths are a joint histogram of one-token cells. Bundled: `sharegpt`
  (`knowledge/datasets/sharegpt.yaml`: ShareGPT as vLLM's benchmark client samples it, first
  turns, right-skewed outputs) and `sharegpt-sarathi` (the Sarathi-Serve/Vidur multi-turn trace);
  each file records its source, tokenizer and filter.

Within a bin every integer in [min_tokens, max_tokens] is equally likely, so the means are exact
sums over bins and the sampler draws a bin by weight, then an integer uniformly inside it.

A lengths file (`load_lengths`; YAML or JSON) holds exactly one of:

    input_tokens: [812, 20, 407]     # per-request lengths, paired by position
    output_tokens: [118, 300, 96]

    input_bins:                       # separate histograms (input and output independent)
      - {min_tokens: 1, max_tokens: 63, weight: 120}
    output_bins:
      - {min_tokens: 1, max_tokens: 127, weight: 75.5}

    joint_bins:                       # a joint histogram, one cell per row
      - {input_min_tokens: 1, input_max_tokens: 63,
         output_min_tokens: 1, output_max_tokens: 127, weight: 3}

and may add `description`, `source`, `tokenizer`, `filter`, `summary`, `source_summary`,
`notes` (what the bundled file records). Lengths are whole numbers of tokens in [1, 10,000,000];
weights are finite, >= 0, with a positive sum. At most 1,000,000 per-request lengths per list,
256 bins per separate histogram, 65,536 joint cells; a YAML file at most 256 KiB (parsing YAML
is slow: larger data goes in JSON), a JSON file at most 24 MiB. Every violation is an
InputFileError naming the file, the field and the fix.

Pure apart from `load_lengths` and its helpers (the I/O edge, through `fileio` and
`specs.loading`). Sampling is `random.Random(seed)`: the same seed gives the same requests.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, replace
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Iterator

from pydantic import Field, ValidationError, model_validator

from shardplan import fileio
from shardplan.errors import InputFileError, ShardplanError, UnknownNameError
from shardplan.specs._base import StrictModel
from shardplan.specs.loading import NESTING_HINT, read_structured, validation_error

MAX_TOKENS = 10_000_000  # one request's input or output; far above any model's context
MAX_REQUESTS_IN_FILE = 1_000_000
MAX_BINS_PER_AXIS = 256  # separate histograms: clipping walks every input x output pair of bins
MAX_JOINT_BINS = 65_536
MAX_SAMPLES = 10_000_000  # one sample() call
MAX_YAML_BYTES = 256 * 2**10  # PyYAML reads ~0.3 MB/s: this is about a second
MAX_JSON_BYTES = 24 * 2**20  # 1,000,000 requests with 8-digit lengths, twice over, fits
DATASETS_DIR = Path(__file__).resolve().parents[1] / "knowledge" / "datasets"
_FORMS_HINT = ("give input_tokens and output_tokens (per-request lengths), input_bins and output_bins "
               "(separate histograms) or joint_bins")


class LengthKind(str, Enum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class TokenBins:
    """Weighted inclusive token ranges: bin k holds every integer in [min_tokens[k],
    max_tokens[k]] with equal probability, and weight[k] / sum(weights) of the mass."""

    min_tokens: tuple[int, ...]
    max_tokens: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        # Loaders and factories check user input first (ShardplanError); this guards the code.
        if not self.weights or not len(self.min_tokens) == len(self.max_tokens) == len(self.weights):
            raise ValueError("TokenBins needs one min, max and weight per bin, and at least one bin")
        if not all(1 <= lo <= hi <= MAX_TOKENS for lo, hi in zip(self.min_tokens, self.max_tokens)):
            raise ValueError(f"every bin needs 1 <= min_tokens <= max_tokens <= {MAX_TOKENS}")
        if not all(math.isfinite(w) and w >= 0 for w in self.weights) or not sum(self.weights) > 0:
            raise ValueError("weights must be finite, >= 0 and sum to more than 0")

    @cached_property
    def mean_tokens(self) -> float:
        """sum_k w_k (lo_k + hi_k) / 2 / sum_k w_k: a uniform integer in [lo, hi] has mean (lo + hi) / 2."""
        total = math.fsum(self.weights)
        return math.fsum(w * (lo + hi) / 2 for lo, hi, w in zip(self.min_tokens, self.max_tokens, self.weights)) / total

    @cached_property
    def cum_weights(self) -> tuple[float, ...]:
        return tuple(itertools.accumulate(self.weights))

    def scaled(self, factor: float) -> TokenBins:
        """Every edge times `factor`, rounded half up, kept within [1, MAX_TOKENS]."""
        lo = [min(MAX_TOKENS, max(1, math.floor(x * factor + 0.5))) for x in self.min_tokens]
        hi = [max(a, min(MAX_TOKENS, math.floor(x * factor + 0.5))) for a, x in zip(lo, self.max_tokens)]
        return TokenBins(tuple(lo), tuple(hi), self.weights)


def _one_bin(lo: int, hi: int) -> TokenBins:
    return TokenBins((lo,), (hi,), (1.0,))


@dataclass(frozen=True)
class LengthDistribution:
    """Input and output tokens per request. `paired`: input bin k goes with output bin k (a
    joint histogram; both carry the cell weights), else the two are drawn independently.
    `max_total_tokens` (set by `clipped`): only requests with input + output within it are
    drawn; `refused_fraction` is the share of requests the clip removed. `source` names where
    it came from (a file, a bundled name, the options) for messages."""

    kind: LengthKind
    input_bins: TokenBins
    output_bins: TokenBins
    paired: bool
    source: str
    max_total_tokens: int | None = None
    refused_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.paired and (self.input_bins.weights != self.output_bins.weights
                            or len(self.input_bins.weights) != len(self.output_bins.weights)):
            raise ValueError("paired bins need one output bin per input bin, with the same weights")
        if self.max_total_tokens is not None and not self.paired:
            raise ValueError("a clipped distribution is paired (clipped() builds it)")

    # ----- construction ------------------------------------------------------------------

    @classmethod
    def fixed(cls, input_tokens: int, output_tokens: int, *, source: str = "--input-len/--output-len") -> LengthDistribution:
        _check_length(input_tokens, "--input-len")
        _check_length(output_tokens, "--output-len")
        return cls(LengthKind.FIXED, _one_bin(input_tokens, input_tokens), _one_bin(output_tokens, output_tokens),
                   paired=False, source=source)

    @classmethod
    def uniform(cls, *, input_min_tokens: int, input_max_tokens: int, output_min_tokens: int, output_max_tokens: int,
                source: str) -> LengthDistribution:
        """Input uniform on [input_min_tokens, input_max_tokens], output independently uniform
        on [output_min_tokens, output_max_tokens], all inclusive."""
        for value, name in ((input_min_tokens, "--input-len"), (input_max_tokens, "--input-len"),
                            (output_min_tokens, "--output-len"), (output_max_tokens, "--output-len")):
            _check_length(value, name)
        for lo, hi, name in ((input_min_tokens, input_max_tokens, "--input-len"),
                             (output_min_tokens, output_max_tokens, "--output-len")):
            if lo > hi:
                raise ShardplanError(f"the range [{lo}, {hi}] is empty", field=name, hint="give min <= max")
        kind = LengthKind.FIXED if (input_min_tokens == input_max_tokens and output_min_tokens == output_max_tokens) \
            else LengthKind.UNIFORM
        return cls(kind, _one_bin(input_min_tokens, input_max_tokens), _one_bin(output_min_tokens, output_max_tokens),
                   paired=False, source=source)

    @classmethod
    def uniform_vllm(cls, input_len: int, output_len: int, range_ratio: float, *,
                     num_special_tokens: int = 0) -> LengthDistribution:
        """vLLM's random dataset (`vllm bench serve --dataset-name random --random-range-ratio r`):
        input uniform on [floor(n (1 - r)), ceil(n (1 + r))] with n = input_len -
        num_special_tokens, output on [max(1, floor(m (1 - r))), max(1, ceil(m (1 + r)))], r in
        [0, 1). Source: vllm/benchmarks/datasets/random.py, RandomDataset.get_sampling_params, at
        vllm-project/vllm 237145ea190a901f93c570f157091fe43835bc63. The client draws
        n tokens and the server's tokenizer adds its special tokens back (a BOS: 1), which is what
        the engine then sees: pass num_special_tokens=0 for engine-side lengths at r = 0."""
        _check_length(input_len, "--input-len")
        _check_length(output_len, "--output-len")
        _check_ratio(range_ratio, upper_inclusive=False)
        real = max(0, input_len - num_special_tokens)
        in_lo, in_hi = math.floor(real * (1 - range_ratio)), math.ceil(real * (1 + range_ratio))
        out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
        out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
        if in_lo < 1:
            raise ShardplanError(f"vLLM would draw input lengths from {in_lo}", field="--input-len",
                                 hint="raise --input-len or lower --random-range-ratio (vLLM refuses it too)")
        return cls.uniform(input_min_tokens=in_lo, input_max_tokens=in_hi, output_min_tokens=out_lo,
                           output_max_tokens=out_hi, source=f"vLLM random dataset (range ratio {range_ratio:g})")

    @classmethod
    def uniform_sglang(cls, input_len: int, output_len: int, range_ratio: float) -> LengthDistribution:
        """SGLang's random dataset (`python -m sglang.bench_serving --dataset-name random
        --random-range-ratio r`): each length uniform on [max(int(n r), 1), n], r in [0, 1]; its
        default r = 0 draws from [1, n] (a mean near n / 2), r = 1 fixes n. Source:
        python/sglang/benchmark/datasets/common.py compute_random_lens (sgl-project/sglang
        0ae7bc27df040c8c6094ee52b35596d7e1e6c67e), called for input and output by
        sample_random_requests in python/sglang/benchmark/datasets/random.py. The client subtracts
        the tokenizer's special tokens and the server adds them back, so these are engine-side."""
        _check_length(input_len, "--input-len")
        _check_length(output_len, "--output-len")
        _check_ratio(range_ratio, upper_inclusive=True)
        return cls.uniform(input_min_tokens=max(int(input_len * range_ratio), 1), input_max_tokens=input_len,
                           output_min_tokens=max(int(output_len * range_ratio), 1), output_max_tokens=output_len,
                           source=f"SGLang random dataset (range ratio {range_ratio:g})")

    @classmethod
    def from_requests(cls, input_tokens: list[int], output_tokens: list[int], *, source: str) -> LengthDistribution:
        """Per-request lengths (paired by position) as a joint histogram of one-token cells,
        equal requests merged."""
        counts = Counter(zip(input_tokens, output_tokens))
        ins = tuple(i for i, _ in counts)
        outs = tuple(o for _, o in counts)
        weights = tuple(float(c) for c in counts.values())
        return cls(LengthKind.HISTOGRAM, TokenBins(ins, ins, weights), TokenBins(outs, outs, weights),
                   paired=True, source=source)

    # ----- what it holds -----------------------------------------------------------------

    @cached_property
    def mean_input_tokens(self) -> float:
        if self.max_total_tokens is None:
            return self.input_bins.mean_tokens
        return self._clipped_means[0]

    @cached_property
    def mean_output_tokens(self) -> float:
        if self.max_total_tokens is None:
            return self.output_bins.mean_tokens
        return self._clipped_means[1]

    @cached_property
    def _clipped_means(self) -> tuple[float, float]:
        """Weighted means of each cell's mean over its fitting points (`_fitting_moments`)."""
        limit = self.max_total_tokens or 0
        sum_in = sum_out = 0.0
        for a, b, c, d, w in self._cells():
            count, sx, sy = _fitting_moments(a, b, c, d, limit)
            sum_in += w * sx / count
            sum_out += w * sy / count
        total = math.fsum(self.input_bins.weights)
        return sum_in / total, sum_out / total

    @property
    def min_total_tokens(self) -> int:
        """The shortest request's input + output."""
        if self.paired:
            return min(a + c for a, c in zip(self.input_bins.min_tokens, self.output_bins.min_tokens))
        return min(self.input_bins.min_tokens) + min(self.output_bins.min_tokens)

    def describe(self) -> str:
        """One line for the assumptions printed beside a serving estimate."""
        i, o = self.input_bins, self.output_bins
        if self.kind is LengthKind.FIXED:
            text = f"{i.min_tokens[0]} input / {o.min_tokens[0]} output tokens per request"
        elif self.kind is LengthKind.UNIFORM:
            text = (f"input uniform on [{i.min_tokens[0]}, {i.max_tokens[0]}], output on "
                    f"[{o.min_tokens[0]}, {o.max_tokens[0]}] tokens")
        else:
            text = f"{self.source}: mean {self.mean_input_tokens:.0f} input / {self.mean_output_tokens:.0f} output tokens"
        if self.max_total_tokens is not None and self.refused_fraction > 0:
            text += (f"; {self.refused_fraction:.1%} of requests exceed the {self.max_total_tokens}-token context "
                     "and are refused")
        return text

    def _cells(self) -> Iterator[tuple[int, int, int, int, float]]:
        """(input min, input max, output min, output max, weight) of every cell."""
        i, o = self.input_bins, self.output_bins
        if self.paired:
            yield from zip(i.min_tokens, i.max_tokens, o.min_tokens, o.max_tokens, i.weights)
            return
        for a, b, wi in zip(i.min_tokens, i.max_tokens, i.weights):
            for c, d, wo in zip(o.min_tokens, o.max_tokens, o.weights):
                yield a, b, c, d, wi * wo

    # ----- sampling ----------------------------------------------------------------------

    def sample(self, num_requests: int, seed: int) -> tuple[tuple[int, int], ...]:
        """`num_requests` (input_tokens, output_tokens) pairs from random.Random(seed): first the
        bin (cell) of every request by weight (random.choices), then per request the input and
        the output uniformly in its bin; a clipped cell draws only pairs that fit (exactly
        uniform over them). The same seed gives the same tuple."""
        if isinstance(num_requests, bool) or not isinstance(num_requests, int) or not 0 <= num_requests <= MAX_SAMPLES:
            raise ShardplanError(f"cannot sample {num_requests!r} requests", field="--num-prompts",
                                 hint=f"give a whole number from 0 to {MAX_SAMPLES}")
        rng = random.Random(seed)
        i, o = self.input_bins, self.output_bins
        if not self.paired:
            ins = rng.choices(range(len(i.weights)), cum_weights=i.cum_weights, k=num_requests)
            outs = rng.choices(range(len(o.weights)), cum_weights=o.cum_weights, k=num_requests)
            return tuple((_uniform_int(rng, i.min_tokens[a], i.max_tokens[a]),
                          _uniform_int(rng, o.min_tokens[b], o.max_tokens[b])) for a, b in zip(ins, outs))
        cells = rng.choices(range(len(i.weights)), cum_weights=i.cum_weights, k=num_requests)
        limit = self.max_total_tokens
        if limit is None:
            return tuple((_uniform_int(rng, i.min_tokens[k], i.max_tokens[k]),
                          _uniform_int(rng, o.min_tokens[k], o.max_tokens[k])) for k in cells)
        return tuple(_fitting_pair(rng, i.min_tokens[k], i.max_tokens[k], o.min_tokens[k], o.max_tokens[k], limit)
                     for k in cells)

    # ----- transformations ---------------------------------------------------------------

    def scaled_to(self, mean_input_tokens: float, mean_output_tokens: float) -> LengthDistribution:
        """The same shape stretched so that the means are the ones given (within half a token
        unless edges clamp at 1 or MAX_TOKENS): every bin edge times a factor, rounded, at least
        1; the factor is refined a few times because rounding and the clamp move the mean. Scale
        first, then clip."""
        if self.max_total_tokens is not None:
            raise ValueError("scale a distribution before clipping it")
        return replace(self, input_bins=_scaled_bins(self.input_bins, mean_input_tokens, "mean_input_tokens"),
                       output_bins=_scaled_bins(self.output_bins, mean_output_tokens, "mean_output_tokens"),
                       source=f"{self.source} scaled to means {mean_input_tokens:g} / {mean_output_tokens:g}")

    def clipped(self, max_model_len: int) -> LengthDistribution:
        """Only the requests that fit a `max_model_len`-token context (input + output <=
        max_model_len), each cell's weight cut to its fitting share: an engine refuses the rest
        (vLLM's OpenAI server answers 400 "This model's maximum context length is ..." when the
        prompt plus max_tokens exceed max_model_len), and a benchmark client counts them as
        failed. A ShardplanError when no request fits."""
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 2 <= max_model_len <= 2 * MAX_TOKENS:
            raise ShardplanError(f"max_model_len {max_model_len!r} is not a context length", field="--max-model-len",
                                 hint=f"give a whole number from 2 to {2 * MAX_TOKENS}")
        limit = min(max_model_len, self.max_total_tokens or max_model_len)
        cells = []
        kept = total = 0.0
        for a, b, c, d, w in self._cells():
            total += w
            b2, d2 = min(b, limit - c), min(d, limit - a)  # no fitting point lies beyond these
            if b2 < a or d2 < c or w == 0:
                continue
            count = _fitting_moments(a, b2, c, d2, limit)[0]
            share = w * count / ((b - a + 1) * (d - c + 1))
            cells.append((a, b2, c, d2, share))
            kept += share
        if not cells:
            raise ShardplanError(
                f"every request is longer than the model's context: the shortest has {self.min_total_tokens} input + "
                f"output tokens, max_model_len is {max_model_len}", source=self.source, field="--max-model-len",
                hint="raise --max-model-len, or shorten --input-len/--output-len or the lengths file's requests")
        weights = tuple(w for *_, w in cells)
        refused = 1 - (1 - self.refused_fraction) * kept / total
        return LengthDistribution(
            self.kind, TokenBins(tuple(x[0] for x in cells), tuple(x[1] for x in cells), weights),
            TokenBins(tuple(x[2] for x in cells), tuple(x[3] for x in cells), weights), paired=True,
            source=self.source, max_total_tokens=limit, refused_fraction=max(0.0, refused))


# ----- the arithmetic of a cell under a context limit ----------------------------------------


def _sum_range(lo: int, hi: int) -> int:
    """sum of i for i in [lo, hi]."""
    return (lo + hi) * (hi - lo + 1) // 2


def _sum_squares(lo: int, hi: int) -> int:
    """sum of i^2 for i in [lo, hi], from n(n+1)(2n+1)/6."""
    def upto(n: int) -> int:
        return n * (n + 1) * (2 * n + 1) // 6
    return upto(hi) - upto(lo - 1)


def _fitting_moments(a: int, b: int, c: int, d: int, limit: int) -> tuple[int, int, int]:
    """(count, sum of x, sum of y) over the integer points a <= x <= b, c <= y <= d with
    x + y <= limit, in closed form. For x <= limit - d every y fits (a rectangle); above it
    y runs from c to limit - x, so the count falls by one per x (a triangle): sums of i and i^2."""
    b, d = min(b, limit - c), min(d, limit - a)
    if b < a or d < c:
        return 0, 0, 0
    count = sum_x = sum_y = 0
    full_hi = min(b, limit - d)
    if full_hi >= a:
        num_x, num_y = full_hi - a + 1, d - c + 1
        count += num_x * num_y
        sum_x += num_y * _sum_range(a, full_hi)
        sum_y += num_x * _sum_range(c, d)
    p = max(a, limit - d + 1)
    if p <= b:
        k = limit - c + 1  # y counts limit - x - c + 1 = k - x
        count += k * (b - p + 1) - _sum_range(p, b)
        sum_x += k * _sum_range(p, b) - _sum_squares(p, b)
        # with t = limit - x in [limit - b, limit - p]: sum of y in [c, t] = (t + c)(t - c + 1) / 2
        t0, t1 = limit - b, limit - p
        sum_y += (_sum_squares(t0, t1) + _sum_range(t0, t1) + (c - c * c) * (t1 - t0 + 1)) // 2
    return count, sum_x, sum_y


def _uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return lo if lo == hi else rng.randint(lo, hi)


def _fitting_pair(rng: random.Random, a: int, b: int, c: int, d: int, limit: int) -> tuple[int, int]:
    """A pair uniform over the cell's points with x + y <= limit: x with probability
    proportional to its number of fitting y (rejection against the first x's, which has the
    most; at least half the proposals are kept), then y uniform among them."""
    most = min(d, limit - a) - c + 1
    while True:
        x = _uniform_int(rng, a, b)
        n = min(d, limit - x) - c + 1
        if n == most or rng.random() * most < n:
            return x, _uniform_int(rng, c, c + n - 1)


def _scaled_bins(bins: TokenBins, target: float, name: str) -> TokenBins:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) \
            or not 1 <= target <= MAX_TOKENS:
        raise ShardplanError(f"{target!r} is not a mean length", field=name,
                             hint=f"give a number of tokens from 1 to {MAX_TOKENS}")
    factor = target / bins.mean_tokens
    scaled = bins.scaled(factor)
    for _ in range(8):  # rounding and the clamp at 1 move the mean; a few corrections settle it
        if abs(scaled.mean_tokens - target) <= 0.5:
            break
        factor *= target / scaled.mean_tokens
        scaled = bins.scaled(factor)
    return scaled


def _check_length(value: Any, field_name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise ShardplanError(f"{value!r} is not a length in tokens", field=field_name,
                             hint=f"give a whole number from 1 to {MAX_TOKENS}")


def _check_ratio(value: Any, *, upper_inclusive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        0 <= value and (value <= 1 if upper_inclusive else value < 1)
    if not ok:
        bound = "[0, 1]" if upper_inclusive else "[0, 1)"
        raise ShardplanError(f"range ratio {value!r} is outside {bound}", field="--random-range-ratio",
                             hint=f"give a number in {bound}")


# ----- the file schema ----------------------------------------------------------------------

Tokens = Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS)]
Weight = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]


class LengthBinFile(StrictModel):
    """One bin of a separate histogram: every length in [min_tokens, max_tokens] (tokens,
    inclusive) equally likely; `weight` its share, in any unit (a count, a fraction)."""

    min_tokens: Tokens
    max_tokens: Tokens
    weight: Weight

    @model_validator(mode="after")
    def _ordered(self) -> LengthBinFile:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} is above max_tokens {self.max_tokens}")
        return self


class JointBinFile(StrictModel):
    """One cell of a joint histogram: input in [input_min_tokens, input_max_tokens] and output in
    [output_min_tokens, output_max_tokens], each uniform and independent inside the cell."""

    input_min_tokens: Tokens
    input_max_tokens: Tokens
    output_min_tokens: Tokens
    output_max_tokens: Tokens
    weight: Weight

    @model_validator(mode="after")
    def _ordered(self) -> JointBinFile:
        if self.input_min_tokens > self.input_max_tokens or self.output_min_tokens > self.output_max_tokens:
            raise ValueError("a min_tokens is above its max_tokens")
        return self


class SourceFile(StrictModel):
    url: str = Field(..., max_length=2000)
    repository: str | None = Field(None, max_length=200)
    commit: str | None = Field(None, max_length=100)
    path: str | None = Field(None, max_length=1000)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class FilterFile(StrictModel):
    rule: str = Field(..., max_length=2000, description="which requests were dropped before counting")
    source: str = Field(..., max_length=2000, description="the code that applies the rule")


class SummaryFile(StrictModel):
    """Figures computed from the source data itself, to check the bins against."""

    num_requests: int = Field(..., gt=0)
    mean_input_tokens: float = Field(..., gt=0)
    median_input_tokens: float = Field(..., gt=0)
    mean_output_tokens: float = Field(..., gt=0)
    median_output_tokens: float = Field(..., gt=0)
    method: str = Field(..., max_length=2000)


class LengthsFile(StrictModel):
    """A lengths file (module docstring): one of the three forms, plus optional provenance."""

    input_tokens: list[Tokens] | None = Field(None, min_length=1, max_length=MAX_REQUESTS_IN_FILE)
    output_tokens: list[Tokens] | None = Field(None, min_length=1, max_length=MAX_REQUESTS_IN_FILE)
    input_bins: list[LengthBinFile] | None = Field(None, min_length=1, max_length=MAX_BINS_PER_AXIS)
    output_bins: list[LengthBinFile] | None = Field(None, min_length=1, max_length=MAX_BINS_PER_AXIS)
    joint_bins: list[JointBinFile] | None = Field(None, min_length=1, max_length=MAX_JOINT_BINS)
    description: str | None = Field(None, max_length=2000)
    source: SourceFile | str | None = None
    tokenizer: str | None = Field(None, max_length=200)
    filter: FilterFile | None = None
    summary: SummaryFile | None = None
    source_summary: SummaryFile | None = None
    notes: str | None = Field(None, max_length=10_000)


# ----- loading (the I/O edge) ---------------------------------------------------------------


def bundled_datasets() -> list[str]:
    return sorted(p.stem for p in DATASETS_DIR.glob("*.yaml"))


def load_lengths(path_or_name: str) -> LengthDistribution:
    """A lengths file (YAML or JSON, the module docstring's schema) or a bundled dataset by name
    (`sharegpt`, any case). An existing path wins over a bundled name."""
    path = Path(path_or_name).expanduser()
    if not _exists(path):
        by_lower = {n.lower(): n for n in bundled_datasets()}
        if path_or_name.lower() in by_lower:
            path = DATASETS_DIR / f"{by_lower[path_or_name.lower()]}.yaml"
        elif os.sep in path_or_name or path.suffix.lower() in (".yaml", ".yml", ".json"):
            raise InputFileError("file not found", source=str(path), hint="check the path")
        else:
            close = difflib.get_close_matches(path_or_name.lower(), list(by_lower), n=3, cutoff=0.4)
            hint = f"did you mean {', '.join(by_lower[c] for c in close)}?" if close else \
                f"give a lengths file (.yaml or .json) or one of: {', '.join(by_lower.values())}"
            raise UnknownNameError(f"unknown dataset '{path_or_name}'", field="--dataset-lengths", hint=hint)
    label = str(path)
    dist = lengths_from_data(_read_lengths_file(path, label), label)
    return replace(dist, source=path.stem) if path.parent == DATASETS_DIR and not _exists(Path(path_or_name)) else dist


def _exists(path: Path) -> bool:
    """Path.exists, with a name no file system holds as absent rather than an ENAMETOOLONG error."""
    return not fileio.no_file_can_have_name(path) and path.exists()


def _read_lengths_file(path: Path, label: str) -> Any:
    suffix = path.suffix.lower()
    if suffix == ".json":
        raw = fileio.read_regular_file_bytes(path, max_bytes=MAX_JSON_BYTES, label=label, what="a lengths file",
                                             hint=f"keep at most {MAX_REQUESTS_IN_FILE} requests, or give bins")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputFileError(f"not UTF-8 text (byte {e.start})", source=label, hint="save the file as UTF-8") from None
        try:
            # NaN and Infinity parse (as floats) so that the schema can refuse them by field.
            return json.loads(text, object_pairs_hook=fileio.unique_json_keys)
        except RecursionError:
            raise InputFileError("JSON nested too deeply", source=label, hint=NESTING_HINT) from None
        except json.JSONDecodeError as e:
            raise InputFileError(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}", source=label,
                                 hint="fix the JSON syntax") from None
        except ValueError as e:
            raise InputFileError(f"the JSON {e}", source=label, hint="give each key once") from None
    if suffix not in (".yaml", ".yml"):
        raise InputFileError(f"a lengths file is .yaml, .yml or .json, not '{suffix or 'no suffix'}'", source=label,
                             hint="rename it to say its format")
    # The size check first (a device or a pipe is refused here too), then the strict safe YAML reader.
    fileio.read_regular_file_bytes(path, max_bytes=MAX_YAML_BYTES, label=label, what="a YAML lengths file",
                                   hint="write larger lengths files as JSON (YAML is slow to read)")
    return read_structured(path, label)


def lengths_from_data(data: Any, source: str) -> LengthDistribution:
    """Parsed file content -> a distribution, or an InputFileError naming `source` and the field."""
    if data is None or data == "" or data == {}:
        raise InputFileError("the file is empty", source=source, hint=_FORMS_HINT)
    if not isinstance(data, dict):
        raise InputFileError(f"expected a mapping of keys to values at the top level, got {type(data).__name__}",
                             source=source, hint=_FORMS_HINT)
    for name in ("input_tokens", "output_tokens"):
        _check_lengths_list(data.get(name), name, source)
    try:
        f = LengthsFile.model_validate(data)
    except ValidationError as e:
        err = validation_error(e, source, known=list(LengthsFile.model_fields))
        err.hint = err.hint or _hint_for(err.field or "")
        raise err from None
    forms = [name for name, present in (("input_tokens/output_tokens", f.input_tokens or f.output_tokens),
                                        ("input_bins/output_bins", f.input_bins or f.output_bins),
                                        ("joint_bins", f.joint_bins)) if present]
    if len(forms) != 1:
        raise InputFileError(f"holds {' and '.join(forms)}" if forms else "holds no lengths", source=source,
                             field=forms[1].split("/")[0] if len(forms) > 1 else None,
                             hint=f"keep one of {', '.join(forms)}" if forms else _FORMS_HINT)
    if f.input_tokens or f.output_tokens:
        if f.input_tokens is None or f.output_tokens is None:
            missing = "output_tokens" if f.output_tokens is None else "input_tokens"
            raise InputFileError("required key is missing", source=source, field=missing,
                                 hint="give one input and one output length per request")
        if len(f.input_tokens) != len(f.output_tokens):
            raise InputFileError(f"has {len(f.output_tokens)} entries, input_tokens has {len(f.input_tokens)}",
                                 source=source, field="output_tokens", hint="give one output length per request")
        return LengthDistribution.from_requests(f.input_tokens, f.output_tokens, source=source)
    if f.joint_bins:
        bins = f.joint_bins
        weights = _positive_weights([b.weight for b in bins], "joint_bins", source)
        return LengthDistribution(
            LengthKind.HISTOGRAM,
            TokenBins(tuple(b.input_min_tokens for b in bins), tuple(b.input_max_tokens for b in bins), weights),
            TokenBins(tuple(b.output_min_tokens for b in bins), tuple(b.output_max_tokens for b in bins), weights),
            paired=True, source=source)
    axes = {}
    for name, bins in (("input_bins", f.input_bins), ("output_bins", f.output_bins)):
        if not bins:
            raise InputFileError("required key is missing", source=source, field=name,
                                 hint="give input_bins and output_bins together")
        weights = _positive_weights([b.weight for b in bins], name, source)
        axes[name] = TokenBins(tuple(b.min_tokens for b in bins), tuple(b.max_tokens for b in bins), weights)
    return LengthDistribution(LengthKind.HISTOGRAM, axes["input_bins"], axes["output_bins"], paired=False,
                              source=source)


def _hint_for(field_path: str) -> str:
    """The fix for a value the schema refused, by the field it is in."""
    last = field_path.rsplit(".", 1)[-1]
    if last == "weight":
        return "give a finite number >= 0"
    if last.endswith("tokens") and "." in field_path:
        return f"give a whole number of tokens from 1 to {MAX_TOKENS}"
    if last in ("input_tokens", "output_tokens"):
        return f"give a list of 1 to {MAX_REQUESTS_IN_FILE} lengths"
    if last.endswith("bins"):
        return f"give a list of bins (at most {MAX_BINS_PER_AXIS} per axis, {MAX_JOINT_BINS} joint)"
    if last.isdigit():
        return "give each bin min_tokens <= max_tokens"
    return "see the lengths file schema in shardplan/specs/lengths.py"


def _positive_weights(weights: list[float], name: str, source: str) -> tuple[float, ...]:
    if not math.fsum(weights) > 0:
        raise InputFileError("the weights sum to 0", source=source, field=name, hint="give at least one positive weight")
    return tuple(weights)


def _check_lengths_list(values: Any, name: str, source: str) -> None:
    """Per-request lengths checked before the schema sees them: a million bad entries would
    otherwise make a million error records; this stops at the first."""
    if not isinstance(values, list):
        return  # absent, or not a list: the schema says so
    if len(values) > MAX_REQUESTS_IN_FILE:
        raise InputFileError(f"holds {len(values)} lengths, more than {MAX_REQUESTS_IN_FILE}", source=source,
                             field=name, hint=f"sample at most {MAX_REQUESTS_IN_FILE} requests, or give bins")
    for index, v in enumerate(values):
        if type(v) is not int or not 1 <= v <= MAX_TOKENS:
            shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
            raise InputFileError(f"{shown} is not a length in tokens", source=source, field=f"{name}.{index}",
                                 hint=f"give whole numbers from 1 to {MAX_TOKENS}")
