"""verify's 16-bit matmuls on a CPU without 16-bit GEMM instructions (verify/cpu_matmul.py): the
same values as torch's own kernels, what the memory tracker sees, and the report's note."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardplan.verify import cpu_matmul as C

BF16 = torch.bfloat16


def _operands(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(48, 96, generator=g).to(dtype)
    b = torch.randn(96, 40, generator=g).to(dtype)
    c = torch.randn(40, generator=g).to(dtype)
    return a, b, c


def _ulps_apart(x: torch.Tensor, y: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors."""
    xi, yi = x.view(torch.int16).int(), y.view(torch.int16).int()
    return int((xi - yi).abs().max())


def test_bf16_products_are_the_fp32_gemm_of_the_same_values_rounded_once():
    a, b, c = _operands(BF16)
    exact = a.double() @ b.double()
    assert torch.equal(C._mm(a, b), (a.float() @ b.float()).to(BF16))
    # torch's own bf16 kernel accumulates in fp32 too: the two differ only in the order of the sums
    assert _ulps_apart(C._mm(a, b), torch.mm(a, b)) <= 1
    assert (C._mm(a, b).double() - exact).abs().max() <= exact.abs().max() * 2.0**-8
    assert _ulps_apart(C._addmm(c, a, b, beta=0.5, alpha=2.0), torch.addmm(c, a, b, beta=0.5, alpha=2.0)) <= 1
    a3, b3 = a.reshape(2, 24, 96), torch.stack([b, b.flip(0)])
    assert _ulps_apart(C._bmm(a3, b3), torch.bmm(a3, b3)) <= 1
    c3 = torch.ones(2, 24, 40, dtype=BF16)
    assert _ulps_apart(C._baddbmm(c3, a3, b3, beta=1, alpha=0.25), torch.baddbmm(c3, a3, b3, alpha=0.25)) <= 1
    # beta 0 ignores what the input holds, NaN included, as torch's addmm does
    assert not C._addmm(torch.full((40,), float("nan"), dtype=BF16), a, b, beta=0).isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_other_dtypes_compute_as_torchs_own_kernels(dtype):
    a, b, c = (t.to(dtype) if dtype is not torch.int64 else (t * 8).round().to(dtype) for t in _operands(torch.float32, 1))
    assert torch.equal(C._mm(a, b), torch.mm(a, b))
    assert torch.equal(C._addmm(c, a, b), torch.addmm(c, a, b))
    a3, b3 = a.reshape(2, 24, 96), torch.stack([b, b])
    assert torch.equal(C._bmm(a3, b3), torch.bmm(a3, b3))
    assert C._mm(a, b).dtype == dtype


class _Outputs(TorchDispatchMode):
    """The dtype of every tensor an op hands back, as verify's StorageTracker sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func.overloadpacket), t.dtype))
        return out


def test_installed_where_needed_the_tracker_sees_16_bit_tensors_only_and_autograd_runs_through_it():
    if not C.needed():  # a CPU with bf16 instructions keeps torch's kernels
        assert C.install() is False
        return
    w = torch.nn.Linear(96, 40, dtype=BF16)
    x = _operands(BF16)[0].requires_grad_()
    a3, b3 = x.detach().reshape(2, 24, 96), torch.stack([w.weight.detach().t()] * 2)
    try:
        assert C.install() is True
        assert C.install() is True  # once per process
        with _Outputs() as mode:
            y = w(x)
            y.sum().backward()
        # the kernels' fp32 copies stay inside them: every tensor an op hands back is bf16
        assert {d for _, d in mode.seen} == {BF16}, sorted({(op, str(d)) for op, d in mode.seen if d != BF16})
        assert {"aten.addmm", "aten.mm"} <= {op for op, _ in mode.seen}
        emulated = (y.detach(), x.grad.clone(), w.weight.grad.clone())
        batched = (torch.bmm(a3, b3), torch.baddbmm(torch.ones(2, 24, 40, dtype=BF16), a3, b3, alpha=0.5))
        assert torch.equal(batched[0], C._bmm(a3, b3))  # through the dispatcher: the replaced kernels ran
    finally:
        C.uninstall()
    x.grad = w.weight.grad = None
    y = w(x)
    y.sum().backward()
    for got, native in zip(emulated, (y.detach(), x.grad, w.weight.grad)):
        assert _ulps_apart(got, native) <= 1
    native = (torch.bmm(a3, b3), torch.baddbmm(torch.ones(2, 24, 40, dtype=BF16), a3, b3, alpha=0.5))
    for got, want in zip(batched, native):
        assert _ulps_apart(got, want) <= 1
