"""A mixture-of-experts layer on the CPU's batch-invariant kernels (moe.cpp, invariant.cpp): routing,
the experts' matrices as one grouped GEMM each (the rows routed to an expert in one call of the linear
kernel; biases added to each row after), and the weighted sum of a token's experts, each a token's own
numbers whatever shares its step.

Routing is one loop a token (softmax and top-k in the family's order, renormalization), the sum over a
token's experts is in top-k order; the expert kernel's rows are independent of how many rows it runs, so
grouping tokens by expert keeps a token's bits independent of the batch."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels.cpu.invariant import PackedLinear, WeightForm, narrowest


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's weight [N, K] of one of a layer's expert matrices, packed as PackedLinear packs one,
    in one form for all: panels [E, bytes per expert]."""

    library: ctypes.CDLL
    panels: torch.Tensor
    out_features: int
    in_features: int
    form: WeightForm = WeightForm.F32
    scalar: bool = False

    @classmethod
    def pack(cls, library: ctypes.CDLL, weights: torch.Tensor) -> PackedExperts:
        """weights [E, N, K]: kept in the narrowest dtype that holds all their values (`narrowest`)."""
        experts = [PackedLinear.pack(library, weight) for weight in narrowest(weights)]
        first = experts[0]
        panels = torch.stack([expert.panels for expert in experts])
        return cls(library, panels, first.out_features, first.in_features, first.form)

    def grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [R, K] grouped by expert, counts[e] of them for expert e → [R, N], each row by its expert."""
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        self.library.sl_grouped_linear(
            self.form,
            self.scalar,
            rows.data_ptr(),
            self.in_features,
            counts.data_ptr(),
            counts.shape[0],
            self.panels.data_ptr(),
            self.panels.shape[1],
            self.out_features,
            out.data_ptr(),
        )
        return out


@dataclass(frozen=True)
class InvariantExperts:
    """A mixture-of-experts layer's router and experts (their gate-up projections, then down; biases
    where the family has them) on the CPU's batch-invariant kernels."""

    library: ctypes.CDLL
    router: PackedLinear
    gate_up: PackedExperts
    down: PackedExperts
    # Each expert's biases [E, N] (float32), or None.
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def __call__(
        self, x: torch.Tensor, top_k: int, routing: int, gate: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """x [T, H] float32 → each token's top_k experts' outputs summed by their routing weights
        (`routing`: engine/model/moe.py's Routing); `gate`: a gate-up output → the down projection's input."""
        x = x.contiguous()
        num_tokens, num_experts = x.shape[0], self.gate_up.panels.shape[0]
        logits = self.router(x)
        slots = num_tokens * top_k
        weights = torch.empty(slots, dtype=torch.float32)
        experts = torch.empty(slots, dtype=torch.int64)
        counts = torch.empty(num_experts, dtype=torch.int64)
        source_rows = torch.empty(slots, dtype=torch.int64)
        positions = torch.empty(slots, dtype=torch.int64)
        self.library.sl_moe_route(
            logits.data_ptr(),
            num_tokens,
            num_experts,
            top_k,
            int(routing),
            weights.data_ptr(),
            experts.data_ptr(),
            counts.data_ptr(),
            source_rows.data_ptr(),
            positions.data_ptr(),
        )
        # Each grouped row's expert, for its biases.
        biased = self.gate_up_bias is not None or self.down_bias is not None
        row_experts = torch.repeat_interleave(counts) if biased else None
        gate_up = self.gate_up.grouped(x.index_select(0, source_rows), counts)
        if self.gate_up_bias is not None:
            gate_up += self.gate_up_bias.index_select(0, row_experts)
        y = self.down.grouped(gate(gate_up), counts)
        if self.down_bias is not None:
            y += self.down_bias.index_select(0, row_experts)
        out = torch.empty_like(x)
        self.library.sl_moe_combine(
            y.data_ptr(), weights.data_ptr(), positions.data_ptr(), num_tokens, top_k, x.shape[1], out.data_ptr()
        )
        return out
