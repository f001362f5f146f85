"""One rank of `shardplan verify`: join the process group, build this rank's part of the model
with the plan's layout, run the work while measuring it, send the measurements to rank 0,
which checks the numerics against an unsharded single-process reference and compares
everything with the cost model. The same code runs under NCCL on GPUs and gloo on CPUs.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardplan.errors import VerifyRunFailed
from shardplan.fileio import write_text_atomic
from shardplan.verify import context, experts, measure, parallel, probes
from shardplan.verify.model import Decoder, model_dtype
from shardplan.verify.runspec import RUN_DIR_ENV, RunSpec

SEED = 1234
LEARNING_RATE = 1e-3
FAULT_ENV = "SHARDPLAN_VERIFY_FAULT"  # testing hook: "raise:RANK", "kill:RANK" or "hang:RANK", after step 0
# Testing hook for verify --from: "drop-optimizer" loads the model's state only, as a reshard
# that loses the optimizer's moments would (the check must then fail).
RESHARD_FAULT_ENV = "SHARDPLAN_VERIFY_RESHARD_FAULT"


def device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def write_status(rank: int, **fields: Any) -> None:
    """A small JSON status file per rank for the local launcher (pid, state, error)."""
    folder = os.environ.get(RUN_DIR_ENV)
    if not folder:
        return
    write_text_atomic(Path(folder) / f"rank{rank}.json",
                      json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(), **fields}))


def maybe_fault(rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    kind, _, who = spec.partition(":")
    if who != str(rank):
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} ({FAULT_ENV}={spec})")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _scalar(t: torch.Tensor) -> float:
    return float(t.full_tensor().item() if isinstance(t, DTensor) else t.item())


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on fp32 logits (torchtitan's `pred.float()`; a no-op in an fp32 run)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def training_batch(run: RunSpec) -> torch.Tensor:
    """Every data-parallel rank's tokens of a step, (dp x micro-batches x mbs, seq + 1). The
    same batch every step: uniform random tokens carry nothing to learn across batches, so
    only a repeated batch shows the optimizer working (its loss must fall)."""
    L = run.layout
    g = torch.Generator().manual_seed(SEED + 1000)
    return torch.randint(run.spec.vocab_size, (L.dp * run.num_microbatches * L.micro_batch_size, run.seq_len + 1),
                         generator=g)


def serving_prompts(run: RunSpec, replica: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 2000 + replica)
    return torch.randint(run.spec.vocab_size, (run.batch_size, run.prompt_len), generator=g)


def _torch_optimizer(run: RunSpec, params) -> torch.optim.Optimizer:
    # foreach=False: the foreach kernels reject a mix of DTensor and plain tensors (TP without SP).
    if run.optimizer.value == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9, foreach=False)
    return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=False)


@dataclass(frozen=True)
class Checkpointing:
    """verify --from: a torch.distributed.checkpoint (DCP) folder to load the model and the
    optimizer from before the first step, or to save them to after the last."""

    load_from: str | None = None
    save_to: str | None = None


def _train_state(chunks: list[Decoder], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and the optimizer's state as DCP keys them: parameter names of the unsharded
    model (wrappers' prefixes dropped), whatever the layout, so another layout can load them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if len(chunks) != 1 or not isinstance(optimizer, torch.optim.Optimizer):
        raise VerifyRunFailed("a checkpoint holds one model chunk per rank and a torch optimizer (fp32)")
    model_state, optim_state = get_state_dict(chunks[0], optimizer)
    return {"model": model_state, "optim": optim_state}


def _state_of(fqn: str) -> str:
    """Which state a checkpoint key belongs to: weights, optimizer_states (the moments), or
    other (step counters, hyper-parameters)."""
    if fqn.startswith("model."):
        return "weights"
    if fqn.startswith("optim.state.") and not fqn.endswith(".step"):
        return "optimizer_states"
    return "other"


def _element_bytes(metadata, fqn: str) -> int:
    props = getattr(metadata.state_dict_metadata[fqn], "properties", None)
    return torch.empty((), dtype=props.dtype).element_size() if props is not None else 1


def save_checkpoint(path: str, chunks: list[Decoder], optimizer) -> dict[str, Any]:
    """dcp.save of the model and optimizer; the bytes this rank wrote (after DCP's
    de-duplication: one replica of a replicated tensor writes it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    class Counting(dcp.DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__()
            self.written = self.items = 0

        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            for item in plan.items:
                if item.type is WriteItemType.BYTE_IO:
                    continue  # pickled hyper-parameters: a few bytes, their size unknown until written
                td = item.tensor_data
                self.written += math.prod(td.chunk.sizes) * torch.empty((), dtype=td.properties.dtype).element_size()
            self.items = len(plan.items)
            return plan

    planner = Counting()
    t0 = time.perf_counter()
    dcp.save(_train_state(chunks, optimizer), checkpoint_id=path, planner=planner)
    return {"written_bytes": planner.written, "num_write_items": planner.items, "seconds": time.perf_counter() - t0}


def load_checkpoint(path: str, chunks: list[Decoder], optimizer) -> dict[str, Any]:
    """dcp.load into this rank's model and optimizer (DCP reshards: each rank reads the pieces
    of the saved chunks that overlap its own), then set_state_dict. Returns the tensor bytes it
    loaded per state (`_state_of`), and the checkpoint file bytes read: DCP's file reader
    reads each saved chunk a piece overlaps whole, then narrows it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    class Counting(dcp.DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__()
            self.loaded: dict[str, int] = {}
            self.file_bytes = self.items = 0

        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            loaded = {"weights": 0, "optimizer_states": 0, "other": 0}
            storage = self.metadata.storage_data or {}
            for item in plan.items:
                fqn = item.dest_index.fqn
                stored = storage.get(item.storage_index)
                if item.type is LoadItemType.BYTE_IO:
                    loaded[_state_of(fqn)] += stored.length if stored is not None else 0
                else:
                    loaded[_state_of(fqn)] += math.prod(item.lengths) * _element_bytes(self.metadata, fqn)
                self.file_bytes += stored.length if stored is not None else 0
            self.loaded, self.items = loaded, len(plan.items)
            return plan

    state = _train_state(chunks, optimizer)
    if os.environ.get(RESHARD_FAULT_ENV) == "drop-optimizer":
        del state["optim"]
    planner = Counting()
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=path, planner=planner)
    if "optim" in state:
        set_state_dict(chunks[0], optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(chunks[0], state["model"])
    return {"loaded_bytes": planner.loaded, "file_bytes_read": planner.file_bytes, "num_read_items": planner.items,
            "seconds": time.perf_counter() - t0}


class MasterWeights:
    """16-bit weights with an fp32 master copy and fp32 optimizer states (the ZeRO paper's mixed
    precision, Sec. 3.1: 2 + 2 + 12 bytes a parameter with Adam; Megatron's and DeepSpeed's
    bf16 optimizers). Each step upcasts one parameter's gradient at a time into its master's
    gradient, steps the master (one optimizer per parameter: the same update as one optimizer
    over all of them with foreach=False) and rounds it back into the weight. The masters are
    made at the first step, as torch's optimizers make their states."""

    def __init__(self, run: RunSpec, params) -> None:
        self.run = run
        self.params = list(params)
        self.masters: list[torch.Tensor] = []
        self.optimizers: list[torch.optim.Optimizer] = []

    def step(self) -> None:
        if not self.masters:
            with torch.no_grad():
                self.masters = [p.detach().to(torch.float32) for p in self.params]
            self.optimizers = [_torch_optimizer(self.run, [m]) for m in self.masters]
        for p, master, opt in zip(self.params, self.masters, self.optimizers):
            if p.grad is None:
                continue
            master.grad = p.grad.to(torch.float32)
            opt.step()
            master.grad = None
            with torch.no_grad():
                p.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The fp32 masters and every optimizer's states (what the cost model's K bytes hold)."""
        return [*self.masters, *(t for opt in self.optimizers for t in measure.optimizer_state_tensors(opt))]


def _make_optimizer(run: RunSpec, params):  # type: ignore[no-untyped-def]
    """fp32 weights are their own master, and so are bf16 ones under a bf16 master (pure bf16:
    torch's optimizer steps them and keeps bf16 moments); other 16-bit weights get fp32 masters."""
    if run.dtype.value == "fp32" or run.optimizer_dtype is run.dtype:
        return _torch_optimizer(run, params)
    return MasterWeights(run, params)


def _local_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)


def device_peaks(device: torch.device, tracker: measure.StorageTracker) -> dict[str, int | None]:
    """This rank's peak memory since the last reset: on a GPU, the caching allocator's own
    counters (allocated and reserved); on a CPU, the tracked live tensors, and no reserved
    figure (there is no caching allocator to measure)."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"allocated_peak_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
                "reserved_peak_bytes": int(stats.get("reserved_bytes.all.peak", 0))}
    at = tracker.peak_at or {}
    return {"allocated_peak_bytes": int(tracker.peak_total), "reserved_peak_bytes": None,
            "peak_op": at.get("op"), "peak_component": at.get("component")}


def run_training(run: RunSpec, splits: dict[str, str], gpus_per_node: int, mesh, c: parallel.Coords,
                 device: torch.device, rank: int, progress: dict[str, Any] | None = None,
                 limit_bytes: int | None = None, checkpoint: Checkpointing | None = None) -> dict[str, Any]:
    """Train `run.steps` steps on this rank's part of the model, measuring it. `progress` is
    kept up to date with what was measured so far (after the build and after each step), for
    the report of a run that ran out of memory; `limit_bytes` (a CPU run) is the device memory
    left to torch, beyond which an allocation raises a simulated out-of-memory error.
    `checkpoint` (verify --from): load the model and optimizer before the first step, or save
    them after the last; what was read or written is the result's `checkpoint`."""
    L = run.layout
    progress = {} if progress is None else progress
    tracker = measure.StorageTracker(limit_bytes=limit_bytes if device.type == "cpu" else None)
    progress.update(tracker=tracker, stage=c.pp, step=None, steps_completed=0, measured={})
    peak = measure.Peak()
    gloo = dist.get_backend() == "gloo"
    tracker.component = measure.WEIGHTS
    with tracker:
        chunks = parallel.build_chunks(run.spec, L, c.pp)
        ep = experts.ExpertParallel.build(device.type, L, run.spec) if L.ep > 1 else None
        for ch in chunks:
            if ep is not None:
                ep.apply(ch, run.spec, serving=False, force_load_balance=run.force_load_balance)
            if L.tp > 1:
                parallel.apply_tp(ch, mesh["tp"], splits, loss_parallel=True, sequence_parallel=L.sequence_parallel)
            if run.force_load_balance:
                experts.force_load_balance(ch)
            parallel.apply_checkpointing(ch, L)
        sharder = parallel.fsdp_sharder(mesh, L, gpus_per_node)
        if ep is not None and sharder is not None:
            sharder = ep.sharder(sharder)
        positions = context.token_positions(run.seq_len, c.cp, L.cp) if L.cp > 1 else None  # this rank's tokens
        for ch in chunks:
            parallel.materialise(ch, device, SEED, sharder)
            if L.tp > 1 and sharder is None:
                parallel.keep_grads_sharded(ch)
            if L.cp > 1:
                context.apply_cp(ch, mesh["cp"], positions)
        gc.collect()  # the unsharded initial values are garbage now
        params = [p for ch in chunks for p in ch.parameters()]
        host = measure.HostBytes(offloaded=parallel.fsdp_offloads(chunks))
        progress["measured"] = {"weights_at_rest_bytes": host.device_bytes(params)}
        tracker.arm()
    tracker.component = None
    at_rest = measure.param_storage_keys(chunks)
    tracker.param_shapes = {tuple(p.shape) for p in params} | {_local_shape(p) for p in params}
    optimizer = _make_optimizer(run, params)
    checkpoint_io: dict[str, Any] | None = None
    if checkpoint is not None and checkpoint.load_from is not None:
        checkpoint_io = load_checkpoint(checkpoint.load_from, chunks, optimizer)
    tracker.reset_peak_total()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def chunk_pre(_m, _a):
        tracker.phase = measure.FORWARD

    def chunk_post(_m, _a, _o):
        exclude = measure.param_storage_keys(chunks) | {measure.storage_key(p.grad) for p in params if p.grad is not None}
        sample = lambda: tracker.live_bytes(measure.FORWARD, exclude)  # noqa: E731
        peak.offer("activations", measure.settled(sample) if gloo else sample())
        tracker.phase = measure.OTHER

    def block_sample(*_):
        peak.offer("gathered", measure.gathered_param_bytes(chunks, at_rest))

    for ch in chunks:
        ch.register_forward_pre_hook(chunk_pre)
        ch.register_forward_hook(chunk_post)
        if sharder is not None:
            for blk in ch.layers.values():
                blk.register_forward_pre_hook(block_sample)
                blk.register_forward_hook(block_sample)
                for unit in experts.local_experts(blk):  # an FSDP unit of its own, gathered inside the block
                    unit.register_forward_pre_hook(block_sample)

    first = c.pp == 0
    last = c.pp == L.pp - 1
    tracker.last_stage = last
    schedule = _schedule(run, chunks, mesh, device) if L.pp > 1 else None
    loss_ctx = _loss_parallel if L.tp > 1 else nullcontext
    dp_group = context.batch_group(mesh, L)  # dp x cp: gradients and the loss are averaged over it
    rows = L.micro_batch_size * run.num_microbatches
    losses, step_seconds = [], []
    grads_bytes = opt_bytes = 0

    def measured_so_far() -> dict[str, int]:
        out = {
            "weights_at_rest_bytes": host.device_bytes(params),
            "gradients_bytes": grads_bytes,
            "optimizer_states_bytes": opt_bytes,
            "offloaded_states_bytes": host.total(),
            "activations_bytes": peak.get("activations"),
            **device_peaks(device, tracker),
        }
        if sharder is not None:
            out["gathered_params_peak_bytes"] = peak.get("gathered")
        return out

    for step in range(run.steps):
        progress["step"] = step
        batch = training_batch(run)[c.dp * rows:(c.dp + 1) * rows].to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        if L.cp > 1:  # every rank's loss is the mean over its tokens; their mean is the reference's
            x, y = x[:, positions], y[:, positions]
        _sync(device)
        t0 = time.perf_counter()
        step_losses: list[torch.Tensor] = []
        tracker.age()
        with tracker, loss_ctx():
            if schedule is not None:
                kwargs: dict[str, Any] = {}
                if last:
                    kwargs.update(target=y, losses=step_losses, return_outputs=False)
                schedule.step(x, **kwargs) if first else schedule.step(**kwargs)
            else:
                for mb in range(run.num_microbatches):
                    sl = slice(mb * L.micro_batch_size, (mb + 1) * L.micro_batch_size)
                    loss = _loss(chunks[0](x[sl]), y[sl])
                    (loss / run.num_microbatches).backward()
                    step_losses.append(loss.detach())
            if sharder is None and dp_group is not None:
                tracker.component = measure.GRADIENTS
                (ep.all_reduce_grads if ep is not None else parallel.all_reduce_grads)(chunks, dp_group)
            grads = [p.grad for p in params if p.grad is not None]
            grads_bytes = max(grads_bytes, host.device_bytes(grads))
            host.offer("gradients", grads)
            tracker.component = measure.OPTIMIZER
            optimizer.step()
            tracker.component = None
            states = measure.optimizer_state_tensors(optimizer)
            opt_bytes = max(opt_bytes, host.device_bytes(states))
            host.offer("optimizer", states)
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
        step_seconds.append(time.perf_counter() - t0)
        if last:
            losses.append(sum(_scalar(t) for t in step_losses) / len(step_losses))
        progress["steps_completed"] = step + 1
        progress["measured"] = measured_so_far()
        maybe_fault(rank)
    if last and dp_group is not None:
        t = torch.tensor(losses, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=dp_group)
        losses = (t / dist.get_world_size(dp_group)).tolist()
    if checkpoint is not None and checkpoint.save_to is not None:
        checkpoint_io = save_checkpoint(checkpoint.save_to, chunks, optimizer)
    measured = measured_so_far()
    host.offer("weights", params)
    measured["offloaded_states_bytes"] = host.total()
    measured["gathered_params_peak_bytes"] = peak.get("gathered")
    if device.type == "cuda":
        measured["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    out = {
        "stage": c.pp, "measured": measured, "losses": losses if last and c.tp == 0 and c.dp == 0 and c.cp == 0 else None,
        "step_seconds": step_seconds,
    }
    if checkpoint_io is not None:
        out["checkpoint"] = checkpoint_io
    return out


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _schedule(run: RunSpec, chunks: list[Decoder], mesh, device: torch.device):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    L = run.layout
    pp_rank = mesh["pp"].get_local_rank()
    group = mesh["pp"].get_group()
    num = L.pp * L.virtual_stages
    stages = [PipelineStage(ch, stage_index=i, num_stages=num, device=device, group=group)
              for ch, i in zip(chunks, parallel.chunk_ids(L, pp_rank))]
    name = L.pp_schedule.value
    if name == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=run.num_microbatches, loss_fn=_loss)
    cls = Schedule1F1B if name == "1f1b" else ScheduleGPipe
    return cls(stages[0], n_microbatches=run.num_microbatches, loss_fn=_loss)


def _received(batch: int, seq: int, hidden: int, src: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The previous stage's hidden states."""
    buf = torch.empty(batch, seq, hidden, device=device, dtype=dtype)
    dist.recv(buf, src=src)
    return buf


def _sample(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's sampler buffers: fp32 logits, probabilities, and the top-p sort's values and
    int64 indices over the vocabulary; greedy pick (the first of the sorted)."""
    probs = torch.softmax(logits.float(), dim=-1)
    _, order = probs.sort(dim=-1, descending=True)
    return order[:, 0].contiguous()  # a column view: collectives need contiguous memory


def run_serving(run: RunSpec, splits: dict[str, str], mesh, c: parallel.Coords, device: torch.device,
                rank: int, progress: dict[str, Any] | None = None, limit_bytes: int | None = None) -> dict[str, Any]:
    L = run.layout
    spec = run.spec
    dtype = model_dtype(spec)
    progress = {} if progress is None else progress
    tracker = measure.StorageTracker(limit_bytes=limit_bytes if device.type == "cpu" else None)
    progress.update(tracker=tracker, stage=c.pp, step=None, steps_completed=0, measured={})
    tracker.component = measure.WEIGHTS
    with tracker:
        (chunk,) = parallel.build_chunks(spec, L, c.pp)
        if L.ep > 1:  # ep = tp: whole experts, their partial sums all-reduced over the tp ranks
            experts.ExpertParallel.build(device.type, L, spec).apply(chunk, spec, serving=True)
            splits = experts.ExpertParallel.whole_experts(splits)
        if run.force_load_balance:
            experts.force_load_balance(chunk)
        if L.tp > 1:
            parallel.apply_tp(chunk, mesh["tp"], splits, loss_parallel=False)
        parallel.materialise(chunk, device, SEED)
        gc.collect()  # the unsharded initial values are garbage now
        progress["measured"] = {"weights_bytes": measure.tensors_bytes([*chunk.parameters(), *chunk.buffers()])}
        tracker.arm()
        tracker.component = measure.KV_CACHE
        kv_local = spec.kv_heads // L.tp
        shape = (run.batch_size, run.prompt_len + run.decode_steps, kv_local, spec.attention_head_dim)
        chunk.caches = {n: (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                        for n in chunk.layers}
        progress["measured"]["kv_cache_bytes"] = measure.tensors_bytes(t for pair in chunk.caches.values() for t in pair)
    tracker.component = None  # from here on: the forward's activations and the sampler's buffers
    tracker.reset_peak_total()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    chunk.eval()
    chunk.last_position_only = True
    first, last = c.pp == 0, c.pp == L.pp - 1
    pp_ranks = mesh["pp"].mesh.tolist()
    group = mesh["pp"].get_group() if L.pp > 1 else None
    tokens = serving_prompts(run, c.dp).to(device)
    logits_seen: list[list[list[float]]] = []
    generated: list[list[int]] = []
    step_seconds: list[float] = []
    gloo = dist.get_backend() == "gloo"

    def forward(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One step of the engine on this stage: (the next tokens, the last stage's final
        logits, the peak of forward-born storages over the step)."""
        s = tokens.shape[1]
        with tracker, torch.no_grad():
            tracker.phase = measure.FORWARD
            tracker.reset_peaks()
            base = tracker.peak_running[measure.FORWARD]
            if first:
                out = chunk(tokens)
            else:
                chunk.pending_input = _received(run.batch_size, s, spec.hidden_size, pp_ranks[c.pp - 1], device, dtype)
                out = chunk()
            final = None
            if not last:
                dist.send(out.contiguous(), dst=pp_ranks[c.pp + 1])
                nxt = torch.empty(run.batch_size, dtype=torch.long, device=device)
            else:
                final = out[:, -1]
                nxt = _sample(final)
            del out
            peak = tracker.peak_running[measure.FORWARD] - base
            tracker.phase = measure.OTHER
        return nxt, final, peak

    act_peak = 0
    for step in range(run.decode_steps + 1):
        progress["step"] = step
        if step == 0 and gloo:
            # The prefill once more before the one that counts, at the same positions (the
            # KV cache is written with the same values again), and the smaller of the two
            # peaks kept: gloo's worker thread lets go of a collective's buffer a moment
            # after the caller, and on a busy CPU that moment once fell inside the next
            # layer's MoE workspace (+3.6%: one tokens x hidden buffer counted at the
            # peak). The model's own peak is the same in both; a late release seldom is.
            act_peak = forward(tokens)[2]
        _sync(device)
        t0 = time.perf_counter()
        nxt, final, peak = forward(tokens)
        if step == 0:
            act_peak = min(act_peak, peak) if gloo else peak
        chunk.pos += tokens.shape[1]
        if final is not None:
            logits_seen.append(final.float().cpu().tolist())
        del final
        if group is not None:
            dist.broadcast(nxt, src=pp_ranks[-1], group=group)
        _sync(device)
        step_seconds.append(time.perf_counter() - t0)
        generated.append(nxt.cpu().tolist())
        tokens = nxt[:, None]
        progress["steps_completed"] = step + 1
        progress["measured"]["activations_bytes"] = act_peak
        if step == 0:
            maybe_fault(rank)
    weights = measure.tensors_bytes([*chunk.parameters(), *chunk.buffers()])
    kv = measure.tensors_bytes(t for pair in chunk.caches.values() for t in pair)
    measured = {"weights_bytes": weights, "kv_cache_bytes": kv, "activations_bytes": act_peak,
                **device_peaks(device, tracker)}
    if device.type == "cuda":
        measured["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    keep = last and c.tp == 0
    return {
        "stage": c.pp, "measured": measured, "step_seconds": step_seconds,
        "prefill_seconds": step_seconds[0], "decode_seconds_per_token": sum(step_seconds[1:]) / max(1, run.decode_steps),
        "replica": c.dp, "logits": logits_seen if keep else None, "tokens": generated if keep else None,
    }


def reference_training(run: RunSpec) -> list[float]:
    """The same model, data, format and optimizer in one process, unsharded, on CPU."""
    model = Decoder(run.spec)
    parallel.init_module(model, "", torch.device("cpu"), SEED)
    model.reset_buffers()
    if run.force_load_balance:
        experts.force_load_balance(model)
    optimizer = _make_optimizer(run, model.parameters())
    losses = []
    for step in range(run.steps):
        batch = training_batch(run)
        loss = _loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
    return losses


def reference_serving(run: RunSpec, replica: int) -> tuple[list[list[list[float]]], list[list[int]]]:
    spec = run.spec
    model = Decoder(spec)
    parallel.init_module(model, "", torch.device("cpu"), SEED)
    model.reset_buffers()
    if run.force_load_balance:
        experts.force_load_balance(model)
    shape = (run.batch_size, run.prompt_len + run.decode_steps, spec.kv_heads, spec.attention_head_dim)
    dtype = model_dtype(spec)
    model.caches = {n: (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for n in model.layers}
    model.last_position_only = True
    tokens = serving_prompts(run, replica)
    logits, generated = [], []
    with torch.no_grad():
        for _ in range(run.decode_steps + 1):
            final = model(tokens)[:, -1]
            model.pos += tokens.shape[1]
            nxt = _sample(final)
            logits.append(final.tolist())
            generated.append(nxt.tolist())
            tokens = nxt[:, None]
    return logits, generated


def _probes(device: torch.device, collective: bool = True) -> dict[str, Any]:
    """The hardware probes, after the plan's work and its memory are gone (`collective`: with
    the all-reduce, which every rank must join)."""
    gc.collect()
    torch.cuda.empty_cache()
    return probes.run_probes(device, collective=collective)


class RankOutOfMemory(Exception):
    """This rank ran out of (real or simulated) device memory; `details` says where, and what
    it had measured before."""

    def __init__(self, details: dict[str, Any]) -> None:
        super().__init__(details.get("error", "out of memory"))
        self.details = details


def _is_out_of_memory(e: BaseException, progress: dict[str, Any]) -> bool:
    tracker = progress.get("tracker")
    return isinstance(e, torch.OutOfMemoryError) or (tracker is not None and tracker.failure is not None)


def _out_of_memory_details(e: BaseException, progress: dict[str, Any], rank: int, c: parallel.Coords,
                           device: torch.device) -> dict[str, Any]:
    """What the rank knows about its out-of-memory error, then the memory freed (the frames of
    the failed step let go) and, on a GPU, the probes run on this rank alone."""
    tracker = progress.pop("tracker", None)
    failure = tracker.failure if tracker is not None and tracker.failure is not None else {
        "op": None, "shape": None, "dtype": None, "allocation_bytes": None, "live_bytes": None,
        "live_forward_bytes": None, "limit_bytes": None, "component": None,
        "simulated": isinstance(e, measure.SimulatedOutOfMemory), "message": str(e).strip().splitlines()[0][:500]}
    details: dict[str, Any] = {
        "rank": rank, "pp": c.pp, "dp": c.dp, "tp": c.tp, "cp": c.cp, "stage": progress.get("stage", c.pp),
        "step": progress.get("step"), "steps_completed": progress.get("steps_completed", 0),
        "measured": dict(progress.get("measured", {})), "failure": failure,
        "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500],
    }
    traceback.clear_frames(e.__traceback__)
    del tracker
    gc.collect()
    if device.type == "cuda":
        details["device_total_bytes"] = int(torch.cuda.mem_get_info(device)[1])
        try:
            details["probes"] = _probes(device, collective=False)  # the peers wait in a collective
        except Exception as probe_error:  # noqa: BLE001 - the report goes out without probes
            details["probes_error"] = f"{type(probe_error).__name__}: {probe_error}"[:500]
    return details


def _limit_device(device: torch.device, limit_bytes: int | None) -> None:
    """On a GPU, the caching allocator may reserve at most `limit_bytes` (the device memory the
    run simulates, less the runtime's share): torch raises OutOfMemoryError beyond it."""
    if device.type != "cuda" or limit_bytes is None:
        return
    total = torch.cuda.mem_get_info(device)[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(limit_bytes, 0) / total), device)


def run_rank(run: RunSpec, splits: dict[str, str], gpus_per_node: int, backend: str,
             collective_timeout_seconds: float, limit_bytes: int | None = None,
             on_out_of_memory: Callable[[dict[str, Any]], None] | None = None,
             checkpoint: Checkpointing | None = None) -> tuple[int, list[dict[str, Any]] | None]:
    """Run this rank; returns (rank, every rank's result on rank 0, else None). `limit_bytes`:
    the device memory torch may use (None: the device's own). When the rank runs out of memory,
    `on_out_of_memory` gets what it knows (while the peers still wait, so that its report is
    written before they are torn down), then RankOutOfMemory is raised. `checkpoint`: training
    loads or saves one (`run_training`)."""
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    write_status(rank, state="started")
    device = device_for(backend, local_rank)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout_seconds),
                                device_id=device if device.type == "cuda" else None)
    except dist.DistError as e:  # the store timed out waiting for peers, or the head cannot be reached
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        write_status(rank, state="error", error=f"rendezvous: {first}"[:2000])
        raise VerifyRunFailed(f"rank {rank}: the rendezvous of {os.environ.get('WORLD_SIZE', '?')} ranks did not complete "
                              f"within {collective_timeout_seconds:.0f} s ({type(e).__name__}: {first})",
                              hint="start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, "
                              "or raise --timeout") from None
    progress: dict[str, Any] = {}
    out_of_memory = False
    try:
        _limit_device(device, limit_bytes)
        c = parallel.coords(rank, run.layout)
        mesh = parallel.build_mesh(device.type, run.layout, gpus_per_node, run.training)
        t0 = time.perf_counter()
        try:
            if run.training:
                result = run_training(run, splits, gpus_per_node, mesh, c, device, rank, progress, limit_bytes,
                                      checkpoint)
            else:
                result = run_serving(run, splits, mesh, c, device, rank, progress, limit_bytes)
        except Exception as e:
            if not _is_out_of_memory(e, progress):
                raise
            out_of_memory = True
            details = _out_of_memory_details(e, progress, rank, c, device)
            details["wall_seconds"] = time.perf_counter() - t0
            del e
            write_status(rank, state="oom", error=details["error"])
            if on_out_of_memory is not None:
                on_out_of_memory(details)
            raise RankOutOfMemory(details) from None
        progress.clear()
        result.update(rank=rank, pp=c.pp, dp=c.dp, tp=c.tp, cp=c.cp, wall_seconds=time.perf_counter() - t0)
        if device.type == "cuda":  # what `shardplan calibrate` turns into efficiencies
            result["probes"] = _probes(device)
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        dist.barrier()  # nobody tears gloo down while a peer still talks to it (that aborts the process)
        write_status(rank, state="done")
        return rank, gathered
    except RankOutOfMemory:
        raise
    except BaseException as e:
        write_status(rank, state="error", error=f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        if not (out_of_memory and device.type == "cuda"):  # NCCL: peers wait in a collective; exiting tears it down
            dist.destroy_process_group()
