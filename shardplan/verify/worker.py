"""One rank of `shardplan verify`: join the process group, build this rank's part of the model
with the plan's layout, run the work while measuring it, send the measurements to rank 0,
which checks the numerics against an unsharded single-process reference and compares
everything with the cost model. The same code runs under NCCL on GPUs and gloo on CPUs.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from contextlib import nullcontext
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
from shardplan.verify.model import Decoder
from shardplan.verify.runspec import RUN_DIR_ENV, RunSpec

SEED = 1234
LEARNING_RATE = 1e-3
FAULT_ENV = "SHARDPLAN_VERIFY_FAULT"  # testing hook: "raise:RANK", "kill:RANK" or "hang:RANK", after step 0


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
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


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


def _make_optimizer(run: RunSpec, params) -> torch.optim.Optimizer:
    # foreach=False: the foreach kernels reject a mix of DTensor and plain tensors (TP without SP).
    if run.optimizer.value == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9, foreach=False)
    return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=False)


def run_training(run: RunSpec, splits: dict[str, str], gpus_per_node: int, mesh, c: parallel.Coords,
                 device: torch.device, rank: int) -> dict[str, Any]:
    L = run.layout
    tracker = measure.StorageTracker()
    peak = measure.Peak()
    gloo = dist.get_backend() == "gloo"
    with tracker:
        chunks = parallel.build_chunks(run.spec, L, c.pp)
        ep = experts.ExpertParallel.build(device.type, L, run.spec) if L.ep > 1 else None
        for ch in chunks:
            if ep is not None:
                ep.apply(ch, run.spec, serving=False, force_load_balance=run.force_load_balance)
            if L.tp > 1:
                parallel.apply_tp(ch, mesh["tp"], splits, loss_parallel=True, sequence_parallel=L.sequence_parallel)
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
    at_rest = measure.param_storage_keys(chunks)
    params = [p for ch in chunks for p in ch.parameters()]
    optimizer = _make_optimizer(run, params)

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
    schedule = _schedule(run, chunks, mesh, device) if L.pp > 1 else None
    loss_ctx = _loss_parallel if L.tp > 1 else nullcontext
    dp_group = context.batch_group(mesh, L)  # dp x cp: gradients and the loss are averaged over it
    rows = L.micro_batch_size * run.num_microbatches
    losses, step_seconds = [], []
    grads_bytes = opt_bytes = 0
    host = measure.HostBytes(offloaded=parallel.fsdp_offloads(chunks))
    for step in range(run.steps):
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
                (ep.all_reduce_grads if ep is not None else parallel.all_reduce_grads)(chunks, dp_group)
            grads = [p.grad for p in params if p.grad is not None]
            grads_bytes = max(grads_bytes, host.device_bytes(grads))
            host.offer("gradients", grads)
            optimizer.step()
            states = measure.optimizer_state_tensors(optimizer)
            opt_bytes = max(opt_bytes, host.device_bytes(states))
            host.offer("optimizer", states)
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
        step_seconds.append(time.perf_counter() - t0)
        if last:
            losses.append(sum(_scalar(t) for t in step_losses) / len(step_losses))
        maybe_fault(rank)
    if last and dp_group is not None:
        t = torch.tensor(losses, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=dp_group)
        losses = (t / dist.get_world_size(dp_group)).tolist()
    weights = host.device_bytes(params)
    host.offer("weights", params)
    measured = {
        "weights_at_rest_bytes": weights,
        "gathered_params_peak_bytes": peak.get("gathered"),
        "gradients_bytes": grads_bytes,
        "optimizer_states_bytes": opt_bytes,
        "offloaded_states_bytes": host.total(),
        "activations_bytes": peak.get("activations"),
    }
    if device.type == "cuda":
        measured["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return {
        "stage": c.pp, "measured": measured, "losses": losses if last and c.tp == 0 and c.dp == 0 and c.cp == 0 else None,
        "step_seconds": step_seconds,
    }


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


def _received(batch: int, seq: int, hidden: int, src: int, device: torch.device) -> torch.Tensor:
    """The previous stage's hidden states."""
    buf = torch.empty(batch, seq, hidden, device=device)
    dist.recv(buf, src=src)
    return buf


def _sample(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's sampler buffers: fp32 logits, probabilities, and the top-p sort's values and
    int64 indices over the vocabulary; greedy pick (the first of the sorted)."""
    probs = torch.softmax(logits.float(), dim=-1)
    _, order = probs.sort(dim=-1, descending=True)
    return order[:, 0].contiguous()  # a column view: collectives need contiguous memory


def run_serving(run: RunSpec, splits: dict[str, str], mesh, c: parallel.Coords, device: torch.device,
                rank: int) -> dict[str, Any]:
    L = run.layout
    spec = run.spec
    tracker = measure.StorageTracker()
    with tracker:
        (chunk,) = parallel.build_chunks(spec, L, c.pp)
        if L.ep > 1:  # ep = tp: whole experts, their partial sums all-reduced over the tp ranks
            experts.ExpertParallel.build(device.type, L, spec).apply(chunk, spec, serving=True)
            splits = experts.ExpertParallel.whole_experts(splits)
        if L.tp > 1:
            parallel.apply_tp(chunk, mesh["tp"], splits, loss_parallel=False)
        parallel.materialise(chunk, device, SEED)
        kv_local = spec.kv_heads // L.tp
        shape = (run.batch_size, run.prompt_len + run.decode_steps, kv_local, spec.attention_head_dim)
        chunk.caches = {n: (torch.zeros(shape, device=device), torch.zeros(shape, device=device)) for n in chunk.layers}
    chunk.eval()
    chunk.last_position_only = True
    first, last = c.pp == 0, c.pp == L.pp - 1
    pp_ranks = mesh["pp"].mesh.tolist()
    group = mesh["pp"].get_group() if L.pp > 1 else None
    tokens = serving_prompts(run, c.dp).to(device)
    logits_seen: list[list[list[float]]] = []
    generated: list[list[int]] = []
    step_seconds: list[float] = []
    act_peak = 0
    for step in range(run.decode_steps + 1):
        s = tokens.shape[1]
        _sync(device)
        t0 = time.perf_counter()
        with tracker, torch.no_grad():
            tracker.phase = measure.FORWARD
            tracker.reset_peaks()
            base = tracker.peak_running[measure.FORWARD]
            if first:
                out = chunk(tokens)
            else:
                chunk.pending_input = _received(run.batch_size, s, spec.hidden_size, pp_ranks[c.pp - 1], device)
                out = chunk()
            chunk.pos += s
            if not last:
                dist.send(out.contiguous(), dst=pp_ranks[c.pp + 1])
                nxt = torch.empty(run.batch_size, dtype=torch.long, device=device)
            else:
                final = out[:, -1]
                nxt = _sample(final)
                logits_seen.append(final.float().cpu().tolist())
            del out
            if step == 0:
                act_peak = tracker.peak_running[measure.FORWARD] - base
            tracker.phase = measure.OTHER
            if group is not None:
                dist.broadcast(nxt, src=pp_ranks[-1], group=group)
        _sync(device)
        step_seconds.append(time.perf_counter() - t0)
        generated.append(nxt.cpu().tolist())
        tokens = nxt[:, None]
        if step == 0:
            maybe_fault(rank)
    weights = measure.tensors_bytes([*chunk.parameters(), *chunk.buffers()])
    kv = measure.tensors_bytes(t for pair in chunk.caches.values() for t in pair)
    measured = {"weights_bytes": weights, "kv_cache_bytes": kv, "activations_bytes": act_peak}
    if device.type == "cuda":
        measured["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    keep = last and c.tp == 0
    return {
        "stage": c.pp, "measured": measured, "step_seconds": step_seconds,
        "prefill_seconds": step_seconds[0], "decode_seconds_per_token": sum(step_seconds[1:]) / max(1, run.decode_steps),
        "replica": c.dp, "logits": logits_seen if keep else None, "tokens": generated if keep else None,
    }


def reference_training(run: RunSpec) -> list[float]:
    """The same model, data and optimizer in one process, unsharded, fp32 on CPU."""
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
    shape = (run.batch_size, run.prompt_len + run.decode_steps, spec.kv_heads, spec.attention_head_dim)
    model.caches = {n: (torch.zeros(shape), torch.zeros(shape)) for n in model.layers}
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


def _probes(device: torch.device) -> dict[str, Any]:
    """The hardware probes, after the plan's work and its memory are gone."""
    gc.collect()
    torch.cuda.empty_cache()
    return probes.run_probes(device)


def run_rank(run: RunSpec, splits: dict[str, str], gpus_per_node: int, backend: str,
             collective_timeout_seconds: float) -> tuple[int, list[dict[str, Any]] | None]:
    """Run this rank; returns (rank, every rank's result on rank 0, else None)."""
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
    try:
        c = parallel.coords(rank, run.layout)
        mesh = parallel.build_mesh(device.type, run.layout, gpus_per_node, run.training)
        t0 = time.perf_counter()
        if run.training:
            result = run_training(run, splits, gpus_per_node, mesh, c, device, rank)
        else:
            result = run_serving(run, splits, mesh, c, device, rank)
        result.update(rank=rank, pp=c.pp, dp=c.dp, tp=c.tp, cp=c.cp, wall_seconds=time.perf_counter() - t0)
        if device.type == "cuda":  # what `shardplan calibrate` turns into efficiencies
            result["probes"] = _probes(device)
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        dist.barrier()  # nobody tears gloo down while a peer still talks to it (that aborts the process)
        write_status(rank, state="done")
        return rank, gathered
    except BaseException as e:
        write_status(rank, state="error", error=f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        dist.destroy_process_group()
