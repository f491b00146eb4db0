"""Batch-invariant linear layers and RMSNorm on a GPU, in Triton: a token's numbers depend on that
token's inputs alone, not on how many rows its step has.

cuBLAS chooses a GEMM kernel (tile, split-K) by the row count: on an H100 a down projection's rows
came out other bits in a step of 256 or 2048 rows than alone (bench/invariant_linear.py). So a
decode's logits changed with the batch it ran in and the graph bucket it was padded to, and a greedy
token with them where two logits nearly tie. torch's RMSNorm gave the same bits at every row count
there, but its reduction's launch shape follows the tensor's and nothing promises that; here it is
one program a row, and one kernel instead of Hugging Face's eight. These kernels fix the order for
every row count: a linear layer's output element is one chain of
BLOCK_K-wide dot products over k in increasing order, accumulated in float32 (BLOCK_K never
changes); a norm's row is summed by one program with a block as wide as the row. The row and column
tiles (`linear_config`) only choose which program computes an element, and are picked by the step's
size: on an H100 every tile gives the same bits (tests/unit/test_gpu_invariant.py checks it on
CUDA through row counts on both sides of the switch; `bench/invariant_linear.py --tiles` compares
each tile's bits and speed).

Triton compiles for CUDA; with TRITON_INTERPRET=1 set before this module is imported it runs on CPU
tensors too, which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class LinearConfig:
    """A linear layer's tiles: rows and output columns per program, and the k-step of its chain."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The k-step of every tile: it fixes each output element's order of summation.
BLOCK_K = 64


def linear_config(out_features: int, num_rows: int) -> LinearConfig:
    """Up to 64 rows (a decode step), narrow column tiles for narrow layers, so a few rows still spread
    over the GPU's multiprocessors (cuBLAS would split k for that, which a fixed order forbids); more
    rows, wide tiles that load each weight fewer times."""
    if num_rows > 64:
        return LinearConfig(block_m=128, block_n=64, block_k=BLOCK_K, num_warps=4, num_stages=4)
    block_n = 16 if out_features <= 2048 else 32 if out_features <= 4096 else 64
    return LinearConfig(block_m=64, block_n=block_n, block_k=BLOCK_K, num_warps=4, num_stages=4)


@dataclass(frozen=True)
class InvariantLinear:
    """A linear layer (weight [N, K], optional bias) run on the batch-invariant kernel."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    # float32 for an output head, so its logits need no second cast; else the weight's dtype.
    out_dtype: torch.dtype

    @classmethod
    def of(cls, linear: torch.nn.Linear, out_dtype: torch.dtype | None = None) -> InvariantLinear:
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(linear.weight.detach(), bias, out_dtype or linear.weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = invariant_linear(x, self.weight, self.out_dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, config: LinearConfig | None = None
) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T → [..., N] in out_dtype; float32 multiplies in full precision.
    `config` overrides linear_config's tiles (bench/invariant_linear.py compares them)."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty(num_rows, out_features, dtype=out_dtype, device=x.device)
    if num_rows:
        config = config or linear_config(out_features, num_rows)
        grid = (triton.cdiv(out_features, config.block_n), triton.cdiv(num_rows, config.block_m))
        _linear[grid](
            rows,
            weight,
            out,
            num_rows,
            out_features,
            in_features,
            rows.stride(0),
            weight.stride(0),
            out.stride(0),
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            IEEE=x.dtype == torch.float32,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return out.view(*x.shape[:-1], out_features)


# The row count is not specialized on (Triton would compile a variant for 1 row and for multiples of
# 16): one binary serves every step.
@triton.jit(do_not_specialize=["num_rows"])
def _linear(
    x_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    out_features,
    in_features,
    x_row_stride,
    w_row_stride,
    out_row_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Columns are the fast axis, so the programs running together share their rows of x.
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    column_mask = columns < out_features
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    w_columns = w_ptr + columns.to(tl.int64)[None, :] * w_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, in_features, BLOCK_K):
        inside = k + ks < in_features
        # Masked rows, columns and k read as 0: they add exact zeros to the sums they touch.
        x = tl.load(x_rows + (k + ks)[None, :], mask=row_mask[:, None] & inside[None, :], other=0.0)
        w = tl.load(w_columns + (k + ks)[:, None], mask=inside[:, None] & column_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + columns[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & column_mask[None, :],
    )


@dataclass(frozen=True)
class InvariantLinears:
    """Linear layers over the same input (q, k and v; gate and up) run as one layer whose weight is
    theirs stacked by output column: an output element's chain over k is the one it has alone, so the
    bits are each layer's own, in one launch instead of one a layer."""

    linear: InvariantLinear
    widths: tuple[int, ...]

    @classmethod
    def of(cls, linears: tuple[torch.nn.Linear, ...]) -> InvariantLinears:
        """Stacks the layers' weights (and biases) into one tensor and makes each layer's parameters
        views of it, so the stack costs no memory beside them."""
        weight = torch.cat([linear.weight.detach() for linear in linears])
        biases = [linear.bias for linear in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        start = 0
        for linear in linears:
            end = start + linear.out_features
            linear.weight.data = weight[start:end]
            if bias is not None:
                linear.bias.data = bias[start:end]
            start = end
        return cls(InvariantLinear(weight, bias, weight.dtype), tuple(linear.out_features for linear in linears))

    @staticmethod
    def fusable(linears: tuple[torch.nn.Module, ...]) -> bool:
        """Whether these layers can stack: plain linear layers of one input width and dtype, all with
        biases or none."""
        if not all(type(linear) is torch.nn.Linear for linear in linears):
            return False
        first = linears[0]
        return all(
            linear.in_features == first.in_features
            and linear.weight.dtype == first.weight.dtype
            and (linear.bias is None) == (first.bias is None)
            for linear in linears
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.widths, dim=-1)


class NormForm(enum.IntEnum):
    """How a family's RMSNorm scales the normalized row (float32 sum of squares and scale in all)."""

    # Llama's (and most): the row cast back to its dtype, then times the weight.
    LLAMA = 0
    # gpt-oss's: times the weight in float32, cast back once.
    FLOAT = 1
    # Gemma's: times (1 + weight) in float32, cast back once.
    OFFSET = 2


# The RMSNorm classes whose arithmetic is not Llama's; any other with `variance_epsilon` is Llama's.
NORM_FORMS = {
    "GptOssRMSNorm": NormForm.FLOAT,
    "GemmaRMSNorm": NormForm.OFFSET,
    "Gemma2RMSNorm": NormForm.OFFSET,
    "Gemma3RMSNorm": NormForm.OFFSET,
}


@dataclass(frozen=True)
class InvariantRMSNorm:
    """A Hugging Face RMSNorm run on the batch-invariant kernel, with its family's arithmetic (`form`)."""

    weight: torch.Tensor
    eps: float
    form: NormForm = NormForm.LLAMA

    @staticmethod
    def supports(norm: torch.nn.Module) -> bool:
        """Whether `norm` is an RMSNorm of a known arithmetic with a weight."""
        known = type(norm).__name__ in NORM_FORMS or hasattr(norm, "variance_epsilon")
        return known and isinstance(getattr(norm, "weight", None), torch.nn.Parameter)

    @classmethod
    def of(cls, norm: torch.nn.Module) -> InvariantRMSNorm:
        eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
        return cls(norm.weight.detach(), float(eps), NORM_FORMS.get(type(norm).__name__, NormForm.LLAMA))

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.promote_types(x.dtype, self.weight.dtype) if self.form == NormForm.LLAMA else x.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        rows = _rows(x)
        out = torch.empty(rows.shape, dtype=self._out_dtype(x), device=x.device)
        if rows.shape[0]:
            _rms_norm[(rows.shape[0],)](
                rows,
                self.weight,
                out,
                width,
                rows.stride(0),
                out.stride(0),
                self.eps,
                FORM=self.form.value,
                BLOCK=triton.next_power_of_2(width),
            )
        return out.view(*x.shape[:-1], width)

    def add(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, the norm of that sum) in one launch: the sum rounded to the residual's dtype
        as torch's add rounds it, then normalized as __call__ does, so both are the unfused bits."""
        width = residual.shape[-1]
        rows, deltas = _rows(residual), _rows(delta)
        total = torch.empty(rows.shape, dtype=residual.dtype, device=residual.device)
        out = torch.empty(rows.shape, dtype=self._out_dtype(residual), device=rows.device)
        if rows.shape[0]:
            _add_rms_norm[(rows.shape[0],)](
                rows,
                deltas,
                self.weight,
                total,
                out,
                width,
                rows.stride(0),
                deltas.stride(0),
                out.stride(0),
                self.eps,
                FORM=self.form.value,
                BLOCK=triton.next_power_of_2(width),
            )
        return total.view(residual.shape), out.view(residual.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


@triton.jit
def _normalize(x, w, width, eps, out_dtype: tl.constexpr, FORM: tl.constexpr):
    """One row x (in its dtype, masked columns 0) normalized and scaled by w as the family's RMSNorm
    (FORM, a NormForm) does."""
    wide = x.to(tl.float32)
    normed = wide * (1.0 / tl.sqrt(tl.sum(wide * wide, 0) / width + eps))
    if FORM == 0:
        normed = normed.to(x.dtype).to(tl.float32)
        scale = w.to(tl.float32)
    elif FORM == 1:
        scale = w.to(tl.float32)
    else:
        scale = 1.0 + w.to(tl.float32)
    return (scale * normed).to(out_dtype)


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, width, x_row_stride, out_row_stride, eps, FORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < width
    x = tl.load(x_ptr + row * x_row_stride + columns, mask=mask, other=0.0)
    w = tl.load(w_ptr + columns, mask=mask, other=0.0)
    out = _normalize(x, w, width, eps, out_ptr.dtype.element_ty, FORM)
    tl.store(out_ptr + row * out_row_stride + columns, out, mask=mask)


@triton.jit
def _add_rms_norm(
    x_ptr,
    delta_ptr,
    w_ptr,
    total_ptr,
    out_ptr,
    width,
    x_row_stride,
    delta_row_stride,
    out_row_stride,
    eps,
    FORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < width
    x = tl.load(x_ptr + row * x_row_stride + columns, mask=mask, other=0.0)
    delta = tl.load(delta_ptr + row * delta_row_stride + columns, mask=mask, other=0.0)
    total = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
    tl.store(total_ptr + row * width + columns, total, mask=mask)
    w = tl.load(w_ptr + columns, mask=mask, other=0.0)
    out = _normalize(total, w, width, eps, out_ptr.dtype.element_ty, FORM)
    tl.store(out_ptr + row * out_row_stride + columns, out, mask=mask)
