"""A vision tower and its projector on the batch-invariant linear kernels, so that an image's embeddings have
the same bits whichever images share its tower call (ImageEmbedder encodes a step's new images together).

Images meet in a tower call only where their rows are multiplied by the same weights: every linear layer, and the
patch embedding (a convolution whose stride is its kernel, which is a linear layer over each patch's pixels).
torch's CPU GEMMs and convolutions, and cuBLAS, pick their blocking by the row count, so those run here on
Sluice's kernels, whose output element is one fixed chain over k. What else a tower does is per row (norms,
activations, pooling) or per image (attention: CLIP's and SigLIP's batch by image, Qwen-VL's splits its rows by
image), so it keeps its bits however many images are stacked."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable

import torch

from engine.kernels.cpu.invariant import PackedLinear, narrowest
from engine.model.families.vision import VisionFamily

# A linear layer's weight [N, K] and bias [N] (or None) → its forward on a batch-invariant kernel, x [..., K] →
# [..., N].
LinearKernel = Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]


def cpu_linear_kernel(library: ctypes.CDLL) -> LinearKernel:
    """The CPU kernel (float32 in and out), each weight packed in the narrowest dtype that holds its values."""

    def kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        packed = PackedLinear.pack(library, narrowest(weight))
        return packed if bias is None else dataclasses.replace(packed, bias=bias.detach().float())

    return kernel


def gpu_linear_kernel() -> LinearKernel:
    """The GPU's Triton kernel, in the weight's dtype."""
    from engine.kernels.gpu.invariant import InvariantLinear

    def kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        return InvariantLinear(weight.detach(), None if bias is None else bias.detach(), weight.dtype)

    return kernel


class KernelLinear(torch.nn.Module):
    """An nn.Linear run on a kernel. `weight` is empty, kept for Hugging Face's modules that read its dtype
    and device."""

    def __init__(self, linear: torch.nn.Linear, kernel: LinearKernel) -> None:
        super().__init__()
        self.run = kernel(linear.weight, linear.bias)
        self.weight = torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


class PatchLinear(torch.nn.Module):
    """A convolution whose stride is its kernel (no padding, no dilation, one group) as a linear layer over each
    patch's pixels, flattened in the weight's (channel, *kernel) order; like the convolution it drops the pixels
    past the last whole patch. `weight` as KernelLinear's."""

    def __init__(self, conv: torch.nn.Conv2d | torch.nn.Conv3d, kernel: LinearKernel) -> None:
        super().__init__()
        self.kernel_size: tuple[int, ...] = tuple(conv.kernel_size)
        self.run = kernel(conv.weight.reshape(conv.out_channels, -1), conv.bias)
        self.weight = torch.empty(0, dtype=conv.weight.dtype, device=conv.weight.device)

    @staticmethod
    def applies(module: torch.nn.Module) -> bool:
        return (
            isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d))
            and tuple(module.stride) == tuple(module.kernel_size)
            and (module.padding == "valid" or all(p == 0 for p in module.padding))
            and all(d == 1 for d in module.dilation)
            and module.groups == 1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, C, *spatial] → patches [B, *counts, C * prod(kernel)] → [B, N, *counts].
        batch, channels, *spatial = x.shape
        counts = [size // k for size, k in zip(spatial, self.kernel_size)]
        x = x[(..., *(slice(0, n * k) for n, k in zip(counts, self.kernel_size)))]
        split = [d for n, k in zip(counts, self.kernel_size) for d in (n, k)]
        x = x.reshape(batch, channels, *split)
        dims = len(counts)
        x = x.permute(0, *(2 + 2 * i for i in range(dims)), 1, *(3 + 2 * i for i in range(dims)))
        out = self.run(x.reshape(batch, *counts, -1))
        return out.permute(0, dims + 1, *range(1, dims + 1))


def use_invariant_tower(vision: VisionFamily, kernel: LinearKernel) -> int:
    """Every linear layer and patch convolution of the vision tower and projector (the model's modules but its
    language model's) on `kernel`, the originals dropped, and whatever else the family multiplies images' rows by
    (VisionFamily.use_linear_kernel), and the family marked invariant_tower. Returns how many layers."""
    vision.invariant_tower = True
    language = set(vision.language().model.modules())
    count = 0
    for parent in list(vision.hf_model.model.modules()):
        # torch's MultiheadAttention reads its projections' weights itself (SigLIP's pooling head, whose output
        # no family's embeddings take).
        if parent in language or isinstance(parent, torch.nn.MultiheadAttention):
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, KernelLinear(child, kernel))
            elif PatchLinear.applies(child):
                setattr(parent, name, PatchLinear(child, kernel))
            else:
                continue
            count += 1
    return count + vision.use_linear_kernel(kernel)
