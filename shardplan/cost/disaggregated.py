"""Disaggregated serving: a prefill pool and a decode pool, the KV cache of each prompt sent from
one to the other (DistServe, Zhong et al. 2024; Splitwise, Patel et al. 2024; what vLLM's and
SGLang's prefill/decode roles with a KV-transfer connector run).

- A prefill replica computes prompts only: each request is a prompt and one sampled token; its
  TTFT is its queueing and prefill there, plus the transfer of the prompt's KV cache.
- A decode replica receives requests with their KV in its cache and decodes them: its steps carry
  no prompt chunks, so TPOT is the decode steps' alone (the interference disaggregation removes),
  plus the wait for a decode slot, which the client sees between the first and second tokens.
- The transfer: each tensor-parallel rank of the prefill replica sends its shard of the prompt's
  KV (prompt tokens x KV bytes per token / tp) over the link between the pools: NVLink when both
  pools fit in one node, the inter-node network otherwise (the profile's links, at their
  efficiency), plus the link's latency.
- Rate matching: with P prefill and D decode replicas the plan carries min(P r_p, D r_d)
  requests/s, r_p and r_d the most each replica sustains within its half of the SLA (TTFT less
  the transfer for prefill, TPOT for decode; `traffic.best_rate`); the split of the GPUs is the
  one that maximises that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardplan.cost.kv import kv_cache_bytes_per_token
from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import serving_memory
from shardplan.cost.step_model import StepModel
from shardplan.cost.traffic import Sla, most_within_sla
from shardplan.cost.workload import InferenceWorkload, ServingLoad
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.lengths import TokenBins
from shardplan.specs.model import ModelSpec
from shardplan.units import bytes_per_element

# A decode replica's requests arrive with every prompt token cached but the last, which it
# computes to sample the second token (the prefill pool sampled the first).
ALL_BUT_ONE = 1.0


@dataclass(frozen=True)
class PoolRate:
    tp: int
    request_rate_per_second: float  # one replica, within its part of the SLA


@dataclass(frozen=True)
class DisaggregatedPlan:
    prefill_tp: int
    prefill_replicas: int
    decode_tp: int
    decode_replicas: int
    request_rate_per_second: float  # the plan's (the lesser pool)
    output_tokens_per_second_per_gpu: float
    kv_transfer_bytes_per_request: float
    kv_transfer_seconds: float
    link: str


def kv_transfer_seconds(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, prompt_tokens: float, tp: int,
                        across_nodes: bool) -> tuple[float, float, str]:
    """(bytes a request's KV takes, seconds to send it, the link) from a prefill replica of `tp` ranks."""
    elt = bytes_per_element(wl.kv_cache_dtype or wl.activation_dtype)
    total = prompt_tokens * kv_cache_bytes_per_token(spec, elt)
    link = hw.inter_node if across_nodes else hw.intra_node
    per_rank = total / max(1, tp)
    seconds = link.latency_seconds + per_rank / (link.bandwidth_bytes_per_second * link.efficiency)
    return total, seconds, link.kind.value if hasattr(link.kind, "value") else str(link.kind)


def _pool_rate(spec: ModelSpec, hw: HardwareProfile, tp: int, wl: InferenceWorkload, sla: Sla,
               traffic_load: ServingLoad, decode_pool: bool = False) -> float:
    layout = Layout(tp=tp)
    sm = serving_memory(spec, hw, layout, wl)
    if not sm.fits:
        return 0.0
    w = replace(wl, load=traffic_load)
    step = StepModel(spec, hw, layout, w, w.max_num_batched_tokens, w.max_num_seqs)
    point, _ = most_within_sla(step, w, sm.kv_account, sla, first_token_sent=decode_pool)
    return 0.0 if point is None else point.request_rate_per_second


def best_disaggregated(spec: ModelSpec, hw: HardwareProfile, wl: InferenceWorkload, sla: Sla, num_gpus: int,
                       tps: tuple[int, ...]) -> DisaggregatedPlan | None:
    """The disaggregated plan with the most goodput per GPU on `num_gpus` GPUs (tp of each pool from
    `tps`, one pipeline stage), or None when no split meets the SLA."""
    load = wl.load or ServingLoad()
    mean_in = wl.input_len if load.lengths is None else load.lengths.mean_input_tokens
    mean_out = wl.output_len if load.lengths is None else load.lengths.mean_output_tokens
    across = num_gpus > hw.gpus_per_node
    prefill: dict[int, tuple[float, float, float, str]] = {}  # tp -> (rate, bytes, seconds, link)
    decode: dict[int, float] = {}
    for tp in tps:
        nbytes, transfer, link = kv_transfer_seconds(spec, hw, wl, mean_in, tp, across)
        if sla.max_ttft_seconds is None or transfer < sla.max_ttft_seconds:
            limit = None if sla.max_ttft_seconds is None else sla.max_ttft_seconds - transfer
            rate = _pool_rate(spec, hw, tp, replace(wl, output_len=1), Sla(limit, None, sla.percentile),
                              replace(load, lengths=prompts_only(load.lengths)))
            if rate > 0:
                prefill[tp] = (rate, nbytes, transfer, link)
        cached = replace(load, prefix_cache_hit_fraction=1.0 - ALL_BUT_ONE / max(2.0, mean_in))
        rate = _pool_rate(spec, hw, tp, wl, Sla(None, sla.max_tpot_seconds, sla.percentile), cached, decode_pool=True)
        if rate > 0:
            decode[tp] = rate
    best: DisaggregatedPlan | None = None
    for tp_p, (r_p, nbytes, transfer, link) in prefill.items():
        for tp_d, r_d in decode.items():
            for p in range(1, num_gpus // tp_p + 1):
                d = (num_gpus - p * tp_p) // tp_d
                if d < 1:
                    break
                rate = min(p * r_p, d * r_d)
                goodput = rate * mean_out / num_gpus
                if best is None or goodput > best.output_tokens_per_second_per_gpu:
                    best = DisaggregatedPlan(tp_p, p, tp_d, d, rate, goodput, nbytes, transfer, link)
    return best


def prompts_only(lengths: Any) -> Any:
    """The same prompt lengths with one output token each (what a prefill replica runs)."""
    if lengths is None:
        return None
    one = TokenBins(tuple(1 for _ in lengths.output_bins.weights), tuple(1 for _ in lengths.output_bins.weights),
                    lengths.output_bins.weights)
    return replace(lengths, output_bins=one)


__all__ = ["DisaggregatedPlan", "best_disaggregated", "kv_transfer_seconds"]
