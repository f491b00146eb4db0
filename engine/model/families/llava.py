"""LLaVA: a CLIP (or SigLIP) vision tower and a projector over a decoder (Llama, Mistral, Qwen2...); each
image a run of image tokens, as many as the tower's patches (its CLS row dropped by the default strategy)."""

from __future__ import annotations

from engine.model.families.vision import VisionFamily


class Llava(VisionFamily):
    model_types = ("llava",)
