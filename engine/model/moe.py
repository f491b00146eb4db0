"""The mixture-of-experts block of the families that have one (Mixtral, Qwen3-MoE): a router picks each
token's top-k experts by softmax probability (renormalized over those k where the family does), and the
token's output is the sum of those experts' gated MLPs weighted by their probabilities.

Hugging Face (transformers 5) holds a layer's experts as two 3D parameters, `gate_up_proj` [E, 2I, H]
and `down_proj` [E, H, I], and the router's weight [E, H] as a parameter of its own, not as linear
layers. Three ways to run them, chosen per layer by what LayerOps holds for its experts:
- the CPU's batch-invariant kernels (engine/kernels/experts.py: routing, a grouped GEMM by expert, the
  weighted sum, each a token's own numbers);
- a kernel per expert (`ExpertLinears`: the GPU's batch-invariant Triton linear layer), over tokens grouped
  by expert, with torch's routing (softmax and top-k over a row: each row on its own) and the weighted sum
  in top-k order;
- torch's kernels, a loop over the experts hit as Hugging Face's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.layers import LayerOps, Replacement


def is_experts(module: torch.nn.Module) -> bool:
    """Whether `module` holds a layer's experts as Hugging Face's 3D parameters."""
    gate_up = getattr(module, "gate_up_proj", None)
    return isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3


def sparse_blocks(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The mixture-of-experts blocks of `model`: a router `gate` (weight [E, H]) and `experts`."""
    for module in model.modules():
        if is_experts(getattr(module, "experts", None)) and hasattr(module, "gate"):
            yield module


def sparse_moe(ops: LayerOps, block: torch.nn.Module, x: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """The block's output for x [T, H]: on its kernels where LayerOps has them, else torch's."""
    experts = block.experts
    kernel = ops.experts.get(block)
    if kernel is not None:
        return kernel(x, top_k, renormalize, experts.act_fn)
    logits = F.linear(x, block.gate.weight)
    weights, chosen = _route(logits, top_k, renormalize)
    out = torch.zeros_like(x)
    # As Hugging Face's loop: each expert hit, over the token slots routed to it.
    for expert in torch.unique(chosen).tolist():
        tokens, slots = torch.where(chosen == expert)
        gate, up = F.linear(x[tokens], experts.gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
        out.index_add_(0, tokens, (y * weights[tokens, slots, None]).to(x.dtype))
    return out


def _route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts [T, k] and their float32 weights [T, k]: softmax, top-k, renormalized."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


@dataclass(frozen=True)
class ExpertLinears:
    """A layer's router and each expert's gate-up and down projections as kernels of their own (the GPU's
    batch-invariant Triton linear layer), run over the tokens grouped by expert: a token's result is its
    own whatever shares its step, as the kernels' rows are."""

    router: Replacement
    gate_up: Sequence[Replacement]
    down: Sequence[Replacement]

    def __call__(
        self, x: torch.Tensor, top_k: int, renormalize: bool, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        weights, chosen = _route(self.router(x), top_k, renormalize)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.gate_up)).tolist()
        rows = x.index_select(0, order // top_k)
        grouped = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                part = self.gate_up[expert](rows[start : start + count])
                gate, up = part.chunk(2, dim=-1)
                grouped[start : start + count] = self.down[expert](act(gate) * up)
                start += count
        y = torch.empty_like(grouped)
        y[order] = grouped
        weighted = y.view(x.shape[0], top_k, -1) * weights.unsqueeze(-1)
        # In top-k order, one add at a time: a token's sum is the same whatever the batch.
        out = weighted[:, 0]
        for slot in range(1, top_k):
            out = out + weighted[:, slot]
        return out.to(x.dtype)
