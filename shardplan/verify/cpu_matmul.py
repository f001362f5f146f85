"""16-bit matmuls on a CPU without 16-bit instructions: how verify's CPU ranks run a bf16 plan.

A bf16 (or fp16) GEMM on a GPU multiplies the 16-bit operands exactly and sums the products in
fp32 (tensor cores), then rounds the output to 16 bits. torch's CPU kernels do the same
arithmetic, but on a CPU without AVX512-BF16 or AMX (where `torch.ops.mkldnn.
_is_mkldnn_bf16_supported()` is False) they fall back to a scalar loop: on the 2-core
development machine (AMD EPYC, AVX2) a (128 x 512) @ (512 x 1792) product ran at 1.3 GFLOP/s in
bf16 against 68 GFLOP/s in fp32 (one thread, torch 2.13.0+cpu), and the bf16 proxy of an
expert-parallel Mixtral plan took 10.4 s a step where the same run in fp32 took 1.2 s.

On such a CPU verify's ranks run the four matmul ops (mm, addmm, bmm, baddbmm: every linear
layer and batched matmul; attention's fused kernel and `mm.out` keep torch's own) of 16-bit
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
NOTE = ("the bf16 linear layers' and batched matmuls (mm, addmm, bmm, baddbmm) ran as fp32 GEMMs of the bf16 values, "
        "rounded to bf16 (fp32 accumulation, as on a GPU's tensor cores): this CPU has no bf16 instructions, and "
        "torch's fallback kernel is about 50x slower; attention and other ops ran torch's own bf16 kernels")

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


def _half(*operands: torch.Tensor) -> bool:
    """All operands in one 16-bit format (torch refuses mixed formats: the native path raises as it does)."""
    return operands[0].dtype in HALF and all(t.dtype == operands[0].dtype for t in operands)


def _gemm(c: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float, dims: int) -> torch.Tensor:
    """beta c + alpha a @ b (c None: a @ b) of matrices (dims 2) or batches of them (dims 3), through
    the in-place op whose CPU kernel calls the GEMM itself: in fp32 over 16-bit operands, rounded back."""
    if a.dim() != dims or b.dim() != dims:
        raise RuntimeError(f"expected {dims}-D operands, got {a.dim()}-D and {b.dim()}-D")
    shape = (*a.shape[:-1], b.shape[-1])
    half = _half(a, b) if c is None else _half(a, b, c)
    dtype = torch.float32 if half else (a.dtype if c is None else c.dtype)
    # A contiguous output holding c broadcast, as torch's own kernels return (beta 0 ignores it, NaN included).
    out = torch.empty(shape, dtype=dtype) if c is None else torch.empty(shape, dtype=dtype).copy_(c.expand(shape))
    x, y = (a.float(), b.float()) if half else (a, b)
    accumulate = out.addmm_ if dims == 2 else out.baddbmm_
    accumulate(x, y, beta=0 if c is None else beta, alpha=alpha)
    return out.to(a.dtype) if half else out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _gemm(None, a, b, 0, 1, dims=2)


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    return _gemm(c, a, b, beta, alpha, dims=2)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _gemm(None, a, b, 0, 1, dims=3)


def _baddbmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    return _gemm(c, a, b, beta, alpha, dims=3)
