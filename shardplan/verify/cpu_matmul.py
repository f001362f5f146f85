"""16-bit matmuls on a CPU without 16-bit instructions: how verify's CPU ranks run a bf16 plan.

A bf16 (or fp16) GEMM on a GPU multiplies the 16-bit operands exactly and sums the products in
fp32 (tensor cores), then rounds the output to 16 bits. torch's CPU kernels do the same
arithmetic, but on a CPU without AVX512-BF16 or AMX (where `torch.ops.mkldnn.
_is_mkldnn_bf16_supported()` is False) they fall back to a scalar loop: on the 2-core
development machine (AMD EPYC, AVX2) a (128 x 512) @ (512 x 1792) product ran at 1.3 GFLOP/s in
bf16 against 68 GFLOP/s in fp32 (one thread, torch 2.13.0+cpu), and the bf16 proxy of an
expert-parallel Mixtral plan took 10.4 s a step where the same run in fp32 took 1.2 s.

On such a CPU verify's ranks run the four matmul ops (mm, addmm, bmm, baddbmm) of 16-bit
operands as the fp32 GEMM of the same values (each product of two 8- or 11-bit significands is
exact in fp32's 24 bits), rounded once to the operands' format: a 16-bit GEMM with fp32
accumulation, up to the order of the sums, which the numerics tolerances already allow for
(compare.py). The fp32 copies live inside the kernel, under the dispatch mode that measures memory
(measure.StorageTracker sees the op's 16-bit inputs and output only), as a GPU GEMM's registers and
workspace do. Every other dtype computes as torch's own kernel does (through the in-place ops,
whose CPU kernels call the GEMM directly, not the functional ops replaced here).
"""

from __future__ import annotations

import warnings

import torch

HALF = (torch.bfloat16, torch.float16)
NOTE = ("bf16 matmuls ran as fp32 GEMMs of the bf16 values, rounded to bf16 (fp32 accumulation, as on a GPU's "
        "tensor cores): this CPU has no bf16 instructions, and torch's fallback kernel is about 50x slower")

_library: torch.library.Library | None = None


def needed() -> bool:
    """Whether this CPU lacks the 16-bit GEMM instructions torch's CPU kernels use."""
    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def install() -> bool:
    """Replace the CPU kernels of mm, addmm, bmm and baddbmm in this process (once) where the CPU
    lacks 16-bit GEMM instructions; True when they are replaced."""
    global _library
    if _library is not None:
        return True
    if not needed():
        return False
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        lib.impl("mm", _mm, "CPU")
        lib.impl("addmm", _addmm, "CPU")
        lib.impl("bmm", _bmm, "CPU")
        lib.impl("baddbmm", _baddbmm, "CPU")
    _library = lib
    return True


def uninstall() -> None:
    """Give the four ops their own CPU kernels back (the tests' way out)."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def _half(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype in HALF and b.dtype == a.dtype


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _half(a, b):
        out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32)
        return out.addmm_(a.float(), b.float(), beta=0).to(a.dtype)
    return a.new_empty((a.shape[0], b.shape[1])).addmm_(a, b, beta=0)


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    shape = (a.shape[0], b.shape[1])
    if _half(a, b):
        out = c.to(torch.float32).expand(shape).clone()
        return out.addmm_(a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype)
    return c.expand(shape).clone().addmm_(a, b, beta=beta, alpha=alpha)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if _half(a, b):
        out = torch.empty(shape, dtype=torch.float32)
        return out.baddbmm_(a.float(), b.float(), beta=0).to(a.dtype)
    return a.new_empty(shape).baddbmm_(a, b, beta=0)


def _baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if _half(a, b):
        out = c.to(torch.float32).expand(shape).clone()
        return out.baddbmm_(a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype)
    return c.expand(shape).clone().baddbmm_(a, b, beta=beta, alpha=alpha)
