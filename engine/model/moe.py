"""The mixture-of-experts block of the families that have one (Mixtral, Qwen3-MoE, gpt-oss): a router picks
each token's top-k experts by its logits and weighs them (Routing, below), and the token's
output is the sum of those experts' gated MLPs times their weights.

Hugging Face (transformers 5) holds a layer's experts as 3D parameters, not as linear layers: `gate_up_proj`
and `down_proj`, [E, N, K] each as a linear layer's weights are or transposed ([E, K, N], gpt-oss's, whose
module says `is_transposed`), with biases where the family has them (gpt-oss), and a router whose weight
(and bias) is a parameter of its own (`gate`, or gpt-oss's `router`). The gate-up output's columns are in the
family's order, which its experts module's `_apply_gate` reads (gate then up for Mixtral; interleaved, and
clamped, for gpt-oss): every path here calls it, so each family's activation is its own.

Three ways to run them, chosen per layer by what LayerOps holds for its experts:
- the CPU's batch-invariant kernels (engine/kernels/cpu/experts.py: routing, a grouped GEMM by expert, the
  weighted sum, each a token's own numbers);
- a kernel per expert (`ExpertLinears`: the GPU's batch-invariant Triton linear layer), over tokens grouped
  by expert, with torch's routing (over a row: each row on its own) and the weighted sum in top-k order;
- torch's kernels, a loop over the experts hit as Hugging Face's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.nn.functional as F

from engine.model.layers import LayerOps, Replacement


class Routing(IntEnum):
    """How a token's top-k experts are weighted (moe.cpp's modes, by the same numbers)."""

    # A softmax over every expert's logit; the top-k probabilities as they are (Qwen3-MoE by default).
    SOFTMAX = 0
    # The same, divided by their sum (Mixtral, Qwen3-MoE's norm_topk_prob).
    SOFTMAX_RENORMALIZED = 1
    # A softmax over the top-k logits alone (gpt-oss): SOFTMAX_RENORMALIZED's numbers, rounded otherwise.
    TOP_K_SOFTMAX = 2


def is_experts(module: torch.nn.Module) -> bool:
    """Whether `module` holds a layer's experts as Hugging Face's 3D parameters."""
    gate_up = getattr(module, "gate_up_proj", None)
    return isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3


def router_of(block: torch.nn.Module) -> torch.nn.Module:
    """The block's router: a weight [E, H] and maybe a bias [E]."""
    return block.gate if hasattr(block, "gate") else block.router


def sparse_blocks(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The mixture-of-experts blocks of `model`: a router and `experts`."""
    for module in model.modules():
        if is_experts(getattr(module, "experts", None)) and (hasattr(module, "gate") or hasattr(module, "router")):
            yield module


@dataclass(frozen=True)
class ExpertMatrices:
    """A layer's experts as linear layers' weights, [E, N, K] (views of Hugging Face's parameters), and
    their biases [E, N] where the family has them."""

    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    @classmethod
    def of(cls, experts: torch.nn.Module) -> ExpertMatrices:
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if getattr(experts, "is_transposed", False):
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        return cls(
            gate_up.detach(),
            _detached(getattr(experts, "gate_up_proj_bias", None)),
            down.detach(),
            _detached(getattr(experts, "down_proj_bias", None)),
        )


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def sparse_moe(ops: LayerOps, block: torch.nn.Module, x: torch.Tensor, top_k: int, routing: Routing) -> torch.Tensor:
    """The block's output for x [T, H]: on its kernels where LayerOps has them, else torch's."""
    experts = block.experts
    kernel = ops.experts.get(block)
    if kernel is not None:
        return kernel(x, top_k, routing, experts._apply_gate)
    router = router_of(block)
    weights, chosen = route(F.linear(x, router.weight, getattr(router, "bias", None)), top_k, routing)
    matrices = ExpertMatrices.of(experts)
    out = torch.zeros_like(x)
    # As Hugging Face's loop: each expert hit, over the token slots routed to it.
    for expert in torch.unique(chosen).tolist():
        tokens, slots = torch.where(chosen == expert)
        gate_up = F.linear(x[tokens], matrices.gate_up[expert], _row(matrices.gate_up_bias, expert))
        y = F.linear(experts._apply_gate(gate_up), matrices.down[expert], _row(matrices.down_bias, expert))
        out.index_add_(0, tokens, (y * weights[tokens, slots, None]).to(x.dtype))
    return out


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def route(logits: torch.Tensor, top_k: int, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's routing weights [T, k] (float32) and top_k experts [T, k] from its router logits [T, E]."""
    if routing == Routing.TOP_K_SOFTMAX:
        top, chosen = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), chosen
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if routing == Routing.SOFTMAX_RENORMALIZED:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


@dataclass(frozen=True)
class ExpertLinears:
    """A layer's router and each expert's gate-up and down projections as kernels of their own (the GPU's
    batch-invariant Triton linear layer, biases included), run over the tokens grouped by expert: a token's
    result is its own whatever shares its step, as the kernels' rows are."""

    router: Replacement
    gate_up: Sequence[Replacement]
    down: Sequence[Replacement]

    def __call__(
        self, x: torch.Tensor, top_k: int, routing: Routing, gate: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        weights, chosen = route(self.router(x), top_k, routing)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.gate_up)).tolist()
        rows = x.index_select(0, order // top_k)
        grouped = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                part = self.gate_up[expert](rows[start : start + count])
                grouped[start : start + count] = self.down[expert](gate(part))
                start += count
        y = torch.empty_like(grouped)
        y[order] = grouped
        weighted = y.view(x.shape[0], top_k, -1) * weights.unsqueeze(-1)
        # In top-k order, one add at a time: a token's sum is the same whatever the batch.
        out = weighted[:, 0]
        for slot in range(1, top_k):
            out = out + weighted[:, slot]
        return out.to(x.dtype)
