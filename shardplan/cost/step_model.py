"""The time of one engine step of any composition, for the continuous-batching model.

A step of continuous batching carries decode tokens of some running requests and prompt chunks
of others in one forward (or, by the engine's schedule, only one kind). Its time splits into
terms each of which depends on one aggregate of the batch, because the roofline of every op
(compute.py) depends on one of them:

    step(T, S, C, U) = linear(T) + head(S) + a_kv C + a_seq D + a_prompt U

  linear(T)   every GEMM, norm, embedding, collective and the host's issuing over T tokens:
              `pass_time` of T one-token rows, attention and logits taken out
  head(S)     the final norm and lm_head over the S positions sampled (each decoding request's
              and each prompt that completes in the step)
  a_kv C      decode attention reads every cached K/V of the D decoding requests: C tokens in
              all (memory-bound: linear in C), a_seq per request for its query and output
  a_prompt U  prompt attention: U = sum over chunks of q x (p + (q + 1) / 2), the causal score
              area of q new tokens after p cached ones (FLOPs: Kaplan et al. 2020 Table 1)

linear() and head() are read off `pass_time` on a geometric grid of token counts (two points
an octave) and interpolated linearly between them; the attention coefficients come from two
`pass_time` calls each. Whether the layers replay a CUDA graph is the engine's rule: decode
steps up to cuda_graph_max_batch, and steps with prompt tokens only where the engine captures
them (vLLM V1's piecewise graphs: `graphs_for_prompt_steps`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import replace

from shardplan.cost.compute import expert_token_sets
from shardplan.cost.layout import Layout
from shardplan.cost.speculative import SpeculativeMethod
from shardplan.cost.time_serving import StepBreakdown, pass_time
from shardplan.cost.workload import InferenceWorkload, Quantization
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import ModelSpec

POINTS_PER_OCTAVE = 2
# Context lengths and batch between which the decode-attention slope is read: long enough that
# the per-request term is small beside the K/V reads, short enough to stay inside every window.
KV_PROBE_SHORT_TOKENS = 1024
KV_PROBE_LONG_TOKENS = 8192
KV_PROBE_SEQS = 64
PROMPT_PROBE_TOKENS = 4096


# An idle replica of a stepping group runs a dummy forward of one token (vLLM's DP ranks with no
# request, `execute_dummy_batch`; SGLang's idle batches under DP attention) so that the group's
# collectives meet: a step as `StepModel.group_seconds` takes it.
IDLE_STEP = ("step", 1, 0, 0, 0.0, 0.0, False)


def _grid(top: int) -> list[int]:
    points = {1}
    k = 0
    while True:
        t = round(2 ** (k / POINTS_PER_OCTAVE))
        points.add(min(t, top))
        if t >= top:
            return sorted(points)
        k += 1


class _Curve:
    """A function read at grid points, linear between them; each grid point is computed (one
    `pass_time`) the first time an interpolation needs it, so a step model costs only the points
    its steps fall between."""

    def __init__(self, xs: list[int], f: Callable[[int], float]) -> None:
        self.xs = tuple(xs)
        self._f = f
        self._ys: dict[int, float] = {}

    def _y(self, i: int) -> float:
        y = self._ys.get(i)
        if y is None:
            y = self._ys[i] = self._f(self.xs[i])
        return y

    def at(self, x: float) -> float:
        xs = self.xs
        if x <= xs[0]:
            return self._y(0) * x / xs[0] if x > 0 else 0.0
        if len(xs) == 1:
            return self._y(0) * x / xs[0]
        i = bisect.bisect_left(xs, x)
        if i >= len(xs):  # past the grid: the last segment's slope
            i = len(xs) - 1
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = self._y(i - 1), self._y(i)
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class StepModel:
    """Seconds of one step of one replica, by the batch's aggregates (module docstring)."""

    def __init__(self, spec: ModelSpec, hw: HardwareProfile, layout: Layout, wl: InferenceWorkload, max_tokens: int,
                 max_seqs: int) -> None:
        self.graph_max = 0 if wl.enforce_eager else wl.graph_max_at(layout.tp)
        self.pp = layout.pp  # pipeline stages of the replica (its scheduler's rules may depend on them)
        self.graphs_for_prompt_steps = wl.graphs_for_prompt_steps
        decode_passes: dict[tuple[int, int, bool], StepBreakdown] = {}

        def decode_pass(batch: int, logit_tokens: int, graphs: bool) -> StepBreakdown:
            # The eager curve's point and the head's pass without logits are the same pass at the
            # grid points the two curves share: computed once.
            key = (batch, logit_tokens, graphs)
            found = decode_passes.get(key)
            if found is None:
                found = decode_passes[key] = pass_time(spec, hw, layout, wl, batch=batch, q_len=1, kv_len=1, decode=True,
                                                       logit_tokens=logit_tokens, graphs=graphs)
            return found

        def linear(t: int, graphs: bool) -> float:
            b = decode_pass(t, 0, graphs)
            return b.total - b.attention

        def head(s: int) -> float:
            return max(0.0, decode_pass(s, s, False).total - decode_pass(s, 0, False).total)

        top = max(2, max_tokens + max_seqs)
        xs = _grid(top)
        self._eager = _Curve(xs, lambda t: linear(t, False))
        gx = [t for t in xs if t <= self.graph_max] or [1]
        self._graphs = _Curve(gx, lambda t: linear(t, bool(self.graph_max)))
        self._head = _Curve(_grid(max(2, max_seqs)), head)
        # A replica whose expert group spans `group` replicas (DP attention with expert or tensor
        # parallelism over them) steps with them: its routed experts' work is the group's, read off
        # `experts(G)`, the time the routed experts' GEMMs and their permutes take for G tokens routed
        # by the group in all (the pass at G less the pass at none; its other terms do not move with G).
        self.group = round(expert_token_sets(layout)) if spec.moe is not None else 1
        if self.group > 1:
            def routed(g: float) -> float:
                return pass_time(spec, hw, layout, wl, batch=1, q_len=1, kv_len=1, decode=True, logit_tokens=0,
                                 graphs=False, expert_group_tokens=g).total

            alone = routed(0)
            self._experts = _Curve(_grid(self.group * top), lambda g: max(0.0, routed(g) - alone))
        self._experts_of: dict[int, float] = {}  # experts(G) by G, as a group's steps ask for them
        # linear(T) + head(S) by (T, S, whether graphs replay), filled by `seconds` and `decode_terms`: a
        # simulation that finds a composition here may add the other terms itself, as `seconds` does.
        self.fixed_by_composition: dict[tuple[int, int, bool], float] = {}

        d = max(1, min(KV_PROBE_SEQS, max_seqs))

        def decode_attention(kv: int) -> float:
            return pass_time(spec, hw, layout, wl, batch=d, q_len=1, kv_len=kv, decode=True).attention

        short, long_ = decode_attention(KV_PROBE_SHORT_TOKENS), decode_attention(KV_PROBE_LONG_TOKENS)
        self.kv_seconds_per_token = max(0.0, (long_ - short) / (d * (KV_PROBE_LONG_TOKENS - KV_PROBE_SHORT_TOKENS)))
        self.seconds_per_decoding_seq = max(0.0, short / d - self.kv_seconds_per_token * KV_PROBE_SHORT_TOKENS)
        q = max(16, min(PROMPT_PROBE_TOKENS, max_tokens))
        prompt = pass_time(spec, hw, layout, wl, batch=1, q_len=q, kv_len=q, decode=False).attention
        self.prompt_seconds_per_unit = prompt / (q * (q + 1) / 2)
        # Speculative decoding (with an acceptance rate in the load): a decode step verifies K + 1
        # positions of each request and yields E = (1 - a^(K+1)) / (1 - a) tokens on average
        # (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via Speculative
        # Decoding", Eq. 1, a = each drafted token's acceptance rate); the proposals cost K passes
        # of the draft model over the decoding requests, or of one MTP layer and its head; n-gram
        # lookup runs on the host (not costed).
        self.width = 1
        self.tokens_per_decode_step = 1.0
        self._draft: StepModel | None = None
        self._mtp_layers = 0.0
        sp = wl.speculative
        acceptance = wl.load.spec_acceptance_rate if wl.load is not None else None
        if sp is not None and acceptance is not None:
            k = sp.num_speculative_tokens
            self.width = k + 1
            self.tokens_per_decode_step = (k + 1.0) if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
            self._proposals = k
            if sp.method is SpeculativeMethod.DRAFT_MODEL and sp.draft is not None:
                # The draft runs unquantized at the target's tp, one stage (cost/speculative.py).
                plain = replace(wl, speculative=None, load=None, quantization=Quantization.NONE)
                self._draft = StepModel(sp.draft, hw, Layout(tp=layout.tp), plain, max_tokens, max_seqs)
            elif sp.method is SpeculativeMethod.MTP:
                self._mtp_layers = 1.0 / max(1, spec.num_layers)

    def group_seconds(self, steps: list[tuple]) -> float:
        """One step of a group of replicas stepping together (`serving_load.simulate_group`), each
        with its batch (a composition as `seconds` takes it: ("step", tokens, sampled, decoding,
        kv_tokens, prompt_units, prompt_step)): the slowest replica's own work, each replica's step
        less its experts' share as if every replica carried its batch, plus the experts' work over
        the group's tokens in all."""
        k, own, tokens = self.group, 0.0, 0
        experts = self._experts_of
        for _, t, sampled, decoding, kv, units, prompt in steps:
            whole = self.seconds(tokens=t, sampled=sampled, decoding=decoding, kv_tokens=kv, prompt_units=units,
                                 prompt_step=prompt)
            if k > 1:
                x = experts.get(k * t)
                whole -= experts.setdefault(k * t, self._experts.at(k * t)) if x is None else x
            if whole > own:
                own = whole
            tokens += t
        if k <= 1:
            return own
        x = experts.get(tokens)
        return own + (experts.setdefault(tokens, self._experts.at(tokens)) if x is None else x)

    def alone_seconds(self, *, tokens: int, sampled: int, decoding: int, kv_tokens: float, prompt_units: float,
                      prompt_step: bool) -> float:
        """`seconds` of a step of this replica while the others of its group (if any) have nothing to run."""
        if self.group <= 1:
            return self.seconds(tokens=tokens, sampled=sampled, decoding=decoding, kv_tokens=kv_tokens,
                                prompt_units=prompt_units, prompt_step=prompt_step)
        step = ("step", tokens, sampled, decoding, kv_tokens, prompt_units, prompt_step)
        return self.group_seconds([step] + [IDLE_STEP] * (self.group - 1))

    def least_seconds_per_token(self) -> float:
        """No step takes less than this per token it carries: every step of T tokens takes at least
        linear(T), the curve it is read off (replayed graphs up to graph_max, else eager), and each
        linear piece of a curve divided by T is monotone in T, so its least value is at a grid point
        or at an end: graph_max for the graphs (read past their last grid point), and for the eager
        curve, which a step with speculative drafts can run past, the last piece's slope (what
        linear(T) / T tends to)."""
        least = math.inf
        for curve in (self._eager, self._graphs):
            for i, x in enumerate(curve.xs):
                least = min(least, curve._y(i) / x)
        if self.graph_max > self._graphs.xs[-1]:
            least = min(least, self._graphs.at(self.graph_max) / self.graph_max)
        xs = self._eager.xs
        if len(xs) > 1:
            slope = (self._eager._y(len(xs) - 1) - self._eager._y(len(xs) - 2)) / (xs[-1] - xs[-2])
            least = min(least, max(0.0, slope))
        return least

    def _proposal_seconds(self, decoding: int, kv_tokens: float) -> float:
        if self.width == 1 or decoding <= 0:
            return 0.0
        if self._draft is not None:
            step = self._draft.seconds(tokens=decoding, sampled=decoding, decoding=decoding, kv_tokens=kv_tokens,
                                       prompt_units=0, prompt_step=False)
            return self._proposals * step
        if self._mtp_layers:
            graphs = decoding <= self.graph_max
            layer = (self._graphs if graphs else self._eager).at(decoding) * self._mtp_layers
            return self._proposals * (layer + self._head.at(decoding))
        return 0.0

    def decode_terms(self, decoding: int) -> tuple[float, float, float]:
        """For a step of `decoding` requests only (no prompt chunk, one token each, no drafts): the
        terms of `seconds` that do not depend on the cached tokens C, and C's coefficient, so that
        `seconds(...) == (fixed + a_kv * C) + per_seq` exactly (the same sums in the same order)."""
        assert self.width == 1, "speculative steps have proposal terms"
        graphs = decoding <= self.graph_max
        key = (decoding, decoding, graphs)
        fixed = self.fixed_by_composition.get(key)
        if fixed is None:
            fixed = self.fixed_by_composition[key] = (self._graphs if graphs else self._eager).at(decoding) + self._head.at(decoding)
        return fixed, self.kv_seconds_per_token, self.seconds_per_decoding_seq * decoding

    def seconds(self, *, tokens: int, sampled: int, decoding: int, kv_tokens: float, prompt_units: float,
                prompt_step: bool) -> float:
        """One step of `tokens` tokens: `decoding` requests reading `kv_tokens` cached tokens in all,
        prompt chunks of causal area `prompt_units`, `sampled` positions sampled."""
        if tokens <= 0:
            return 0.0
        extra = decoding * (self.width - 1)  # the K drafted positions each decoding request verifies
        tokens, sampled = tokens + extra, sampled + extra
        graphs = tokens <= self.graph_max and (not prompt_step or self.graphs_for_prompt_steps)
        # linear(T) + head(S) is kept by (T, S, graphs): a simulation asks for the same few thousand
        # compositions hundreds of thousands of times; the sum below is evaluated in the same order.
        key = (tokens, sampled, graphs)
        fixed = self.fixed_by_composition.get(key)
        if fixed is None:
            fixed = self.fixed_by_composition[key] = (self._graphs if graphs else self._eager).at(tokens) + self._head.at(sampled)
        step = (fixed + self.kv_seconds_per_token * kv_tokens
                + self.seconds_per_decoding_seq * decoding + self.prompt_seconds_per_unit * prompt_units)
        # Without drafts the proposal term is 0.0, and adding 0.0 to a sum of non-negative terms leaves it as it is.
        return step if self.width == 1 else step + self._proposal_seconds(decoding, kv_tokens)
