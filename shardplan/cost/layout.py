"""The parallel layout: one small validated value object (after torchtitan's ParallelDims).

Degrees multiply to the GPU count: world = tp * pp * cp * dp. Expert parallelism does not add
GPUs: it folds over the data x context x tensor ranks of a pipeline stage (Megatron-Core's
expert-model-parallel group; vLLM's EP = TP x DP), and each expert may itself be split over
`etp` ranks (expert tensor parallelism). A degree of 1 means "not used".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING

from shardplan.cost.memo import hash_once
from shardplan.errors import LayoutError

if TYPE_CHECKING:  # annotations only: the command line reads the enums here without the model schema
    from shardplan.specs.model import ModelSpec


class Recompute(str, Enum):
    """Activation recomputation (Korthikanti et al. 2022, Sec. 4)."""

    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core (softmax, dropout, scores x V)
    FULL = "full"  # keep only each layer's input; recompute the layer in backward


class PipelineSchedule(str, Enum):
    GPIPE = "gpipe"  # all micro-batches forward, then all backward
    ONE_F_ONE_B = "1f1b"  # PipeDream-Flush (Narayanan et al. 2021, Sec. 2.2.1)
    INTERLEAVED = "interleaved"  # 1F1B with v virtual stages per GPU (Sec. 2.2.2)


class Offload(str, Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


@hash_once
@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None: tp when ep == 1, else 1
    zero_stage: int = 0  # 0 none, 1 optimizer states, 2 + gradients, 3 + parameters (FSDP full shard)
    hybrid_shard: bool = False  # ZeRO/FSDP sharding only among the data-parallel ranks of one node (HSDP)
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    virtual_stages: int = 1  # model chunks per GPU (interleaved schedule)
    micro_batch_size: int = 1  # sequences per micro-batch (training)
    offload_optimizer: Offload = Offload.NONE
    offload_params: Offload = Offload.NONE
    # Serving: decoder layers whose weights live at `offload_params` (host RAM, or NVMe: accelerate's
    # "disk") instead of the GPU; 0: none. Which layers, and whether they are streamed to the GPU
    # each forward or run on the CPU, is the engine's rule (knowledge/engines/*.yaml offload_eras).
    offload_layers: int = 0
    # Serving, mixture of experts: the first N decoder layers (by index, dense ones included, as
    # llama.cpp counts them) whose routed experts' weights live in host memory and run on the CPU,
    # while their attention, shared experts and KV stay on the GPU (llama.cpp --n-cpu-moe N); 0: none.
    offload_expert_layers: int = 0
    # Uneven pipeline splits (Megatron-LM): the embedding, and the output layer with the loss,
    # each count as one layer when the layers are split over the chunks
    # (--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split); or
    # the first and last stages hold a given number of layers and the others share the rest
    # (--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers).
    pp_embedding_as_layer: bool = False
    pp_loss_as_layer: bool = False
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        # Accept enum values given as their strings ("selective"), so `is` comparisons hold.
        for name, enum in (
            ("recompute", Recompute),
            ("pp_schedule", PipelineSchedule),
            ("offload_optimizer", Offload),
            ("offload_params", Offload),
        ):
            value = getattr(self, name)
            if not isinstance(value, enum):
                object.__setattr__(self, name, enum(value))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        if self.etp is not None:
            return self.etp
        return self.tp if self.ep == 1 else 1

    @property
    def num_virtual_chunks(self) -> int:
        return self.pp * self.virtual_stages


def _divisors_hint(n: int, limit: int | None = None) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]
    return ", ".join(map(str, ds[:12]))


def validate_layout(spec: ModelSpec, layout: Layout, num_gpus: int, *, training: bool) -> None:
    """Raise LayoutError for a layout that cannot exist; the message says which degree and why."""
    L = layout
    for name in ("tp", "pp", "dp", "cp", "ep", "virtual_stages", "micro_batch_size"):
        if getattr(L, name) < 1:
            raise LayoutError(f"{name} must be at least 1", field=name)
    if L.world_size != num_gpus:
        raise LayoutError(
            f"tp x pp x cp x dp = {L.tp} x {L.pp} x {L.cp} x {L.dp} = {L.world_size} does not equal the GPU count {num_gpus}",
            field="dp",
            hint="leave --dp out to derive it, or change --gpus/--nodes",
        )
    heads = spec.num_attention_heads
    if heads % L.tp:
        raise LayoutError(
            f"tp={L.tp} does not divide the {heads} attention heads",
            field="tp",
            hint=f"use one of {_divisors_hint(heads, 64)}",
        )
    if spec.mla is None:
        kv = spec.kv_heads
        if kv % L.tp and L.tp % kv:
            raise LayoutError(
                f"tp={L.tp} and the {kv} KV heads: neither divides the other",
                field="tp",
                hint="KV heads are split when tp divides them and replicated when they divide tp",
            )
    if spec.intermediate_size % L.tp:
        raise LayoutError(f"tp={L.tp} does not divide intermediate_size {spec.intermediate_size}", field="tp")
    if spec.vocab_size < L.tp:
        raise LayoutError(f"tp={L.tp} exceeds the vocabulary size", field="tp")
    if L.num_virtual_chunks > spec.num_layers + int(L.pp_embedding_as_layer) + int(L.pp_loss_as_layer):
        raise LayoutError(
            f"pp x virtual_stages = {L.num_virtual_chunks} exceeds the {spec.num_layers} layers",
            field="pp",
            hint="every pipeline chunk needs at least one layer (--pp-embedding-as-layer and --pp-loss-as-layer "
                 "let the embedding and the loss fill one each)",
        )
    uneven = L.pp_embedding_as_layer or L.pp_loss_as_layer or L.pp_first_stage_layers is not None \
        or L.pp_last_stage_layers is not None
    if uneven:
        if L.pp == 1:
            raise LayoutError("an uneven pipeline split needs pp > 1", field="pp")
        if (L.pp_first_stage_layers is not None or L.pp_last_stage_layers is not None) and L.virtual_stages > 1:
            raise LayoutError("first/last stage layer counts apply with one chunk per stage", field="virtual_stages",
                              hint="drop --virtual-stages, or count the embedding and loss as layers instead")
        sizes = chunk_sizes(spec.num_layers, L.pp, L.virtual_stages, embedding_as_layer=L.pp_embedding_as_layer,
                            loss_as_layer=L.pp_loss_as_layer, first=L.pp_first_stage_layers,
                            last=L.pp_last_stage_layers)
        # A chunk may hold only the embedding (the first) or only the loss (the last), as in
        # Llama 3 405B's 16 stages x 8 chunks over 126 layers; every stage keeps a layer.
        empty_ok = {0} if L.pp_embedding_as_layer else set()
        empty_ok |= {len(sizes) - 1} if L.pp_loss_as_layer else set()
        stage_totals = [sum(sizes[s::L.pp]) for s in range(L.pp)]
        bad = any(n < 0 or (n == 0 and i not in empty_ok) for i, n in enumerate(sizes))
        if bad or min(stage_totals) < 1 or sum(sizes) != spec.num_layers:
            raise LayoutError(
                f"the split gives chunks of {', '.join(map(str, sizes))} layers for {spec.num_layers} layers",
                field="pp_first_stage_layers" if L.pp_first_stage_layers or L.pp_last_stage_layers else "pp",
                hint="every chunk needs a layer (or the embedding or loss) and the counts must add up to the "
                     "model's layers")
    if L.virtual_stages > 1 and L.pp_schedule is not PipelineSchedule.INTERLEAVED:
        raise LayoutError("virtual_stages > 1 needs the interleaved schedule", field="virtual_stages")
    if L.pp_schedule is PipelineSchedule.INTERLEAVED and L.pp == 1:
        raise LayoutError("the interleaved schedule needs pp > 1", field="pp_schedule")
    if L.ep > 1 or (L.etp or 1) > 1:
        if spec.moe is None:
            raise LayoutError("ep/etp > 1 needs a mixture-of-experts model", field="ep", hint="drop --ep")
        if spec.moe.num_experts % L.ep:
            raise LayoutError(
                f"ep={L.ep} does not divide the {spec.moe.num_experts} experts",
                field="ep",
                hint=f"use one of {_divisors_hint(spec.moe.num_experts)}",
            )
        fold = L.dp * L.cp * L.tp
        if fold % (L.ep * L.expert_tp):
            raise LayoutError(
                f"ep x etp = {L.ep * L.expert_tp} does not divide the dp x cp x tp = {fold} ranks it folds over",
                field="ep",
            )
        if spec.moe.expert_intermediate_size % L.expert_tp:
            raise LayoutError(f"etp={L.expert_tp} does not divide the expert width", field="etp")
    if L.zero_stage not in (0, 1, 2, 3):
        raise LayoutError("zero_stage must be 0, 1, 2 or 3", field="zero_stage")
    if not training:
        if L.zero_stage or L.offload_optimizer is not Offload.NONE:
            raise LayoutError("ZeRO and optimizer offload apply to training only", field="zero_stage")
        if L.cp > 1:
            raise LayoutError("context parallelism is modelled for training only", field="cp")
    if L.sequence_parallel and L.tp == 1:
        raise LayoutError("sequence parallelism needs tp > 1", field="sequence_parallel")
    if L.offload_layers < 0:
        raise LayoutError("offload_layers must be at least 0", field="offload_layers")
    if L.offload_layers and training:
        raise LayoutError("offloading a number of layers applies to serving (training offloads all parameters "
                          "with ZeRO-3)", field="offload_layers", hint="drop --offload-layers")
    if not training and (L.offload_layers > 0) != (L.offload_params is not Offload.NONE):
        raise LayoutError("serving offload needs both where (--offload all-cpu or all-nvme) and how many layers "
                          "(--offload-layers N)", field="offload_layers",
                          hint="give --offload-layers N with --offload all-cpu, or neither")
    if L.offload_layers > spec.num_layers:
        raise LayoutError(f"offload_layers={L.offload_layers} exceeds the {spec.num_layers} layers",
                          field="offload_layers", hint=f"use at most {spec.num_layers}")
    if L.offload_expert_layers < 0:
        raise LayoutError("offload_expert_layers must be at least 0", field="offload_expert_layers")
    if L.offload_expert_layers:
        if training:
            raise LayoutError("holding experts in host memory applies to serving", field="offload_expert_layers",
                              hint="drop --n-cpu-moe")
        if spec.moe is None:
            raise LayoutError(f"{spec.name} is a dense model: it has no routed experts to hold in host memory",
                              field="offload_expert_layers", hint="drop --n-cpu-moe, or offload whole layers with "
                                                                  "--n-gpu-layers")
        last = max(i for i in range(spec.num_layers) if spec.is_moe_layer(i)) + 1
        if L.offload_expert_layers > last:
            raise LayoutError(f"offload_expert_layers={L.offload_expert_layers} exceeds the {last} layers that end "
                              f"with the model's last MoE layer", field="offload_expert_layers",
                              hint=f"use at most {last}")
        if L.pp > 1:
            raise LayoutError("holding experts in host memory is modelled for one pipeline stage",
                              field="offload_expert_layers", hint="use --pp 1")
    if L.offload_layers and L.pp > 1:
        raise LayoutError("offloading layers is modelled for one pipeline stage (engines offload within one "
                          "process)", field="offload_layers", hint="use --pp 1 (tensor parallelism works)")
    if L.offload_params is not Offload.NONE and training and L.zero_stage != 3:
        raise LayoutError(
            "parameter offload in training needs ZeRO stage 3 (DeepSpeed offload_param / FSDP CPU offload)",
            field="offload_params",
        )


def chunk_sizes(
    num_layers: int, pp: int, virtual_stages: int = 1, *, embedding_as_layer: bool = False,
    loss_as_layer: bool = False, first: int | None = None, last: int | None = None,
) -> tuple[int, ...]:
    """Decoder layers of each of the pp x v pipeline chunks, in pipeline order (chunk c runs on
    stage c mod pp). Balanced, earlier chunks taking the remainder (torchtitan, Megatron-LM);
    with the embedding or the loss counted as a layer, the chunks split L + 1 (or L + 2) units
    and the first (last) chunk gives one of its units to it (Megatron-Core
    `get_num_layers_to_build` with account_for_embedding/loss_in_pipeline_split); with `first`
    or `last`, those stages hold that many layers and the others share the rest
    (--decoder-first/last-pipeline-num-layers, v = 1 only). A size may come out below one;
    `validate_layout` refuses that."""
    chunks = pp * virtual_stages
    if first is not None or last is not None:
        inner = chunks - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        base, extra = divmod(rest, inner) if inner > 0 else (0, 0)
        sizes = [base + (1 if i < extra else 0) for i in range(inner)]
        return tuple(([first] if first is not None else []) + sizes + ([last] if last is not None else []))
    units = num_layers + int(embedding_as_layer) + int(loss_as_layer)
    base, extra = divmod(units, chunks)
    sizes = [base + (1 if c < extra else 0) for c in range(chunks)]
    sizes[0] -= int(embedding_as_layer)
    sizes[-1] -= int(loss_as_layer)
    return tuple(sizes)


@lru_cache(maxsize=4096)
def stage_layer_ranges(
    num_layers: int, pp: int, virtual_stages: int = 1, embedding_as_layer: bool = False, loss_as_layer: bool = False,
    first: int | None = None, last: int | None = None,
) -> tuple[tuple[range, ...], ...]:
    """Layers per pipeline stage, chunk by chunk (`chunk_sizes`). Stage s holds chunks s, s+pp,
    s+2pp, ... Cached: the search asks for the same split thousands of times."""
    sizes = chunk_sizes(num_layers, pp, virtual_stages, embedding_as_layer=embedding_as_layer,
                        loss_as_layer=loss_as_layer, first=first, last=last)
    ranges: list[range] = []
    start = 0
    for n in sizes:
        ranges.append(range(start, start + max(0, n)))
        start += max(0, n)
    return tuple(tuple(ranges[s + k * pp] for k in range(virtual_stages)) for s in range(pp))


def layout_stage_ranges(num_layers: int, layout: Layout) -> tuple[tuple[range, ...], ...]:
    """`stage_layer_ranges` for a layout, its uneven-split options included."""
    return stage_layer_ranges(num_layers, layout.pp, layout.virtual_stages, layout.pp_embedding_as_layer,
                              layout.pp_loss_as_layer, layout.pp_first_stage_layers, layout.pp_last_stage_layers)


@lru_cache(maxsize=4096)
def flat_layers(chunks: tuple[range, ...]) -> tuple[int, ...]:
    """A stage's layers: its chunks (one range each, from `layout_stage_ranges`) laid end to end."""
    return tuple(i for r in chunks for i in r)
