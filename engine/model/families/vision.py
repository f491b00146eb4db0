"""VisionFamily: what a vision-language model does with images, beside its decoder (a DecoderFamily run over
its language model): the processor's outputs split per image, an image's embeddings from its vision tower
and projector, and the prompt positions they fill. A family's file says only what differs from the defaults
here, which are LLaVA's (one contiguous run of image tokens per image, every tower input stacked by image)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import AutoProcessor, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from engine.images import ImageInput
from engine.model.families.base import DecoderFamily
from engine.rope_positions import RopePositions

if TYPE_CHECKING:
    from engine.model.invariant_tower import LinearKernel


@dataclass(frozen=True)
class LanguagePart:
    """A vision-language model's decoder as a DecoderFamily reads a text model: its config and inner model."""

    config: PretrainedConfig
    model: torch.nn.Module


class VisionFamily:
    """Built from the Hugging Face model (whose modules hold the tower's weights)."""

    # The config.model_type values this family serves.
    model_types: ClassVar[tuple[str, ...]] = ()
    # The processor's outputs that are not the tower's inputs.
    text_outputs: ClassVar[frozenset[str]] = frozenset(
        {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "text_replacement_offsets"}
    )
    # Whether an image's tokens attend to each other both ways (a block of non-causal attention in the
    # causal prompt: Gemma 3), rather than causally as text does.
    bidirectional_images: ClassVar[bool] = False
    # Whether tokens are rotated by their place in their image's grid rather than their index (M-RoPE:
    # rope_positions gives a prompt's).
    rope_by_grid: ClassVar[bool] = False
    # The family of the decoder where no text model shares it (else its text_config's model_type's).
    decoder: ClassVar[type[DecoderFamily] | None] = None
    # The dimension along which images' tower inputs stack: several images' inputs concatenated along it (their
    # other dimensions equal) are those images' in one tower call, their embeddings' rows in the same order.
    image_dim: ClassVar[int] = 0

    @classmethod
    def load_processor(cls, path: Path, tokenizer: PreTrainedTokenizerBase) -> Any:
        """The model's processor, from its folder (`tokenizer`: the folder's, already loaded)."""
        return AutoProcessor.from_pretrained(path)

    def __init__(self, hf_model: PreTrainedModel) -> None:
        self.hf_model = hf_model
        self.image_token_id: int = hf_model.config.image_token_id
        # Whether the tower runs on the batch-invariant kernels (use_invariant_tower sets it): only then may
        # images share a tower call, since torch's kernels give an image other bits beside others.
        self.invariant_tower = False

    @property
    def longest_image_block(self) -> int:
        """Where images attend both ways, the most tokens one of their blocks can have: a step's budget must
        hold it, since a block is computed in one step. 0 otherwise."""
        return 0

    def language(self) -> LanguagePart:
        return LanguagePart(self.hf_model.config.text_config, self.hf_model.model.language_model)

    def split(self, outputs: Mapping[str, torch.Tensor], num_rows: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """The tower's inputs for each image alone, from the processor's outputs for all of them (`num_rows`:
        each image's number of image tokens)."""
        inputs = {name: value for name, value in outputs.items() if name not in self.text_outputs}
        return [{name: value[i : i + 1] for name, value in inputs.items()} for i in range(len(num_rows))]

    def batch_key(self, inputs: Mapping[str, torch.Tensor]) -> tuple:
        """Images whose keys are equal stack into one tower call (where invariant_tower): their inputs' names,
        dtypes and shapes but for image_dim."""
        dim = self.image_dim
        return tuple((name, value.dtype, value.shape[:dim] + value.shape[dim + 1 :]) for name, value in inputs.items())

    def encode_batch(self, inputs: Sequence[Mapping[str, torch.Tensor]], num_rows: Sequence[int]) -> list[torch.Tensor]:
        """Images of one batch_key in one tower call: each one's embeddings (`num_rows[i]` rows), bit for bit
        encode's of it alone where the tower runs on the batch-invariant kernels (engine/model/invariant_tower.py)."""
        if len(inputs) == 1:
            embeddings = self.encode(inputs[0])
        else:
            stacked = {name: torch.cat([image[name] for image in inputs], self.image_dim) for name in inputs[0]}
            embeddings = self.encode(stacked)
        if embeddings.shape[0] != sum(num_rows):
            raise ValueError(f"images have {embeddings.shape[0]} embeddings for {sum(num_rows)} tokens")
        if len(inputs) == 1:
            return [embeddings]
        # Copies, so that the encoder cache's dropping an image frees its rows.
        return [part.clone() for part in embeddings.split(list(num_rows))]

    @torch.inference_mode()
    def encode(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The embeddings [rows, hidden] of the images in `inputs` (one image's, or several stacked along
        image_dim), in the order their tokens come in the prompt."""
        device = self.hf_model.device
        features: Any = self.hf_model.model.get_image_features(
            **{name: value.to(device) for name, value in inputs.items()}
        ).pooler_output
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        return features.reshape(-1, features.shape[-1]).to(self.hf_model.dtype)

    def use_linear_kernel(self, kernel: LinearKernel) -> int:
        """Where the tower or projector multiplies images' rows by a weight outside an nn.Linear (which
        use_invariant_tower moves itself): that product on `kernel`. Returns how many such products."""
        return 0

    def prompt(self, processor: Any, text: str, images: Sequence[Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids as the processor expands its image placeholders, and its images."""
        outputs = processor(text=[text], images=list(images), return_tensors="pt", return_text_replacement_offsets=True)
        # What each image's placeholder became: as many image tokens as the image has embeddings.
        replaced = [o["replacement"] for o in outputs["text_replacement_offsets"][0] if o["type"] == "image"]
        image_token = self.image_token(processor)
        return self.images_of(outputs, [replacement.count(image_token) for replacement in replaced])

    def images_of(self, outputs: Mapping[str, Any], counts: Sequence[int]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids and its images from the processor's `outputs`, `counts[i]` image tokens to image i."""
        ids: list[int] = outputs["input_ids"][0].tolist()
        runs = _runs(ids, self.image_token_id)
        if sum(counts) != sum(length for _, length in runs):
            raise ValueError(
                f"the processor wrote {sum(length for _, length in runs)} image tokens, {sum(counts)} expected"
            )
        per_image = self.split(outputs, counts)
        return ids, tuple(ImageInput.of(own, inputs) for own, inputs in zip(_deal(runs, list(counts)), per_image))

    def rope_positions(self, num_tokens: int, images: Sequence[ImageInput]) -> RopePositions:
        """Where rope_by_grid: the rotary positions of a prompt of `num_tokens` with these images."""
        raise NotImplementedError

    def image_token(self, processor: Any) -> str:
        """The image token as the processor writes it into the prompt's text (as many as the image has rows)."""
        return processor.image_token


def _runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(ids):
        if token != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


def _deal(runs: list[tuple[int, int]], counts: list[int]) -> list[tuple[tuple[int, int], ...]]:
    """The runs split among images in order, `counts[i]` positions to image i (a run may be split)."""
    dealt: list[tuple[tuple[int, int], ...]] = []
    pending = list(runs)
    for count in counts:
        own: list[tuple[int, int]] = []
        while count:
            start, length = pending.pop(0)
            take = min(length, count)
            own.append((start, take))
            if take < length:
                pending.insert(0, (start + take, length - take))
            count -= take
        dealt.append(tuple(own))
    return dealt
