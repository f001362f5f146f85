"""What the hardware under a verify run does on its own, measured after the plan's work: dense
matmul FLOP/s, device-memory bandwidth and all-reduce bus bandwidth. `shardplan calibrate`
divides them by the profile's peaks to give the efficiencies later estimates use.

Conventions follow the sources the bundled profiles cite, so a calibrated efficiency means
the same thing as a bundled one:
- matmul: 2 m n k FLOPs per (m x k) @ (k x n) product, the best of the sizes tried (a torch
  matmul sweep, as in the profiles' `efficiency.matmul` source);
- memory: a copy reads and writes every byte, so 2 x bytes per copy (gpu-stream's "scale"
  kernel, 1 read + 1 write stream);
- all-reduce: nccl-tests' bus bandwidth, bytes x 2 (n - 1) / n per second, comparable with
  one link's bandwidth per direction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

MATMUL_SIZES_GPU = (4096, 8192)
MATMUL_SIZES_CPU = (256,)
COPY_BYTES_GPU = 1 << 30
COPY_BYTES_CPU = 1 << 22
ALL_REDUCE_BYTES_GPU = 256 << 20
ALL_REDUCE_BYTES_CPU = 1 << 20
REPEATS = 10
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # the profiles' peak keys


def _seconds_per_call(fn: Callable[[], Any], device: torch.device, repeats: int = REPEATS) -> float:
    """The best of `repeats` timed calls after one warm-up (the least disturbed one)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops_per_second(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> tuple[float, int]:
    """(the best FLOP/s over the square sizes tried, the size that gave it)."""
    best, best_n = 0.0, sizes[0]
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        rate = 2 * n**3 / _seconds_per_call(lambda: torch.mm(a, b), device)
        if rate > best:
            best, best_n = rate, n
    return best, best_n


def memory_bytes_per_second(device: torch.device, num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _seconds_per_call(lambda: dst.copy_(src), device)


def all_reduce_bus_bytes_per_second(device: torch.device, num_bytes: int, group: dist.ProcessGroup | None) -> float | None:
    n = dist.get_world_size(group)
    if n < 2:
        return None
    t = torch.zeros(num_bytes // 2, dtype=torch.bfloat16, device=device)
    seconds = _seconds_per_call(lambda: dist.all_reduce(t, group=group), device)
    return num_bytes * 2 * (n - 1) / n / seconds


def run_probes(device: torch.device, dtype: torch.dtype = torch.bfloat16, group: dist.ProcessGroup | None = None,
               collective: bool = True) -> dict[str, Any]:
    """Every rank runs this (the ranks agree whether the all-reduce can run); sizes are small
    on a CPU, where the figures only show that the probes run. A probe that runs out of
    memory is reported, not fatal. `collective=False`: this rank alone (its peers cannot
    join: it ran out of memory), no all-reduce."""
    gpu = device.type == "cuda"
    out: dict[str, Any] = {"device_name": torch.cuda.get_device_name(device) if gpu else "cpu",
                           "matmul_dtype": DTYPE_NAMES[dtype]}
    try:
        out["matmul_flops_per_second"], out["matmul_size"] = matmul_flops_per_second(
            device, dtype, MATMUL_SIZES_GPU if gpu else MATMUL_SIZES_CPU)
        out["memory_bytes_per_second"] = memory_bytes_per_second(device, COPY_BYTES_GPU if gpu else COPY_BYTES_CPU)
        ok = torch.ones(1, device=device)
    except torch.OutOfMemoryError as e:
        out["error"] = f"OutOfMemoryError: {e}"[:500]
        ok = torch.zeros(1, device=device)
    if collective and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        out["all_reduce_ranks"] = dist.get_world_size(group)
        if ok.item() == 1:
            out["all_reduce_bus_bytes_per_second"] = all_reduce_bus_bytes_per_second(
                device, ALL_REDUCE_BYTES_GPU if gpu else ALL_REDUCE_BYTES_CPU, group)
    return out
