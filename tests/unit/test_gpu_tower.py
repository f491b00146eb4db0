"""The vision tower on the GPU's batch-invariant Triton linear kernel (engine/model/invariant_tower.py): the
embeddings of images encoded together are each one's alone, bit for bit, and torch's to rounding. Without CUDA
the kernel runs in Triton's interpreter on the CPU; without Triton the file skips."""

import pytest
import torch

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET: the kernels run in Triton's interpreter.
pytest.importorskip("triton", reason="the GPU's batch-invariant kernels are written in Triton")
pytestmark = pytest.mark.interpreter

from engine.model.invariant_tower import gpu_linear_kernel, use_invariant_tower  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.tiny_vision import tiny_vision_folder  # noqa: E402
from tests.conftest import CACHE_DIR  # noqa: E402
from tests.unit.test_tower_batching import IMAGES, prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# LLaVA's CLIP tower: 17 rows an image, so three stay within one kind of the kernel's tiles (up to 64 rows), as
# Triton's interpreter needs (it multiplies a tile with numpy, whose sums depend on the tile's shape).
def test_images_encoded_together_on_the_triton_kernel_are_each_alone(default_tokenizer, tmp_path):
    folder = tiny_vision_folder("llava", default_tokenizer, tmp_path)
    loaded = load_model(str(folder), CACHE_DIR, DEVICE, "float32", batch_invariant=False)
    vision = loaded.model.vision
    images = [image for _, (image,) in prompts(loaded, IMAGES)]
    reference = [vision.encode(image.inputs) for image in images]
    assert use_invariant_tower(vision, gpu_linear_kernel()) > 0
    alone = [vision.encode(image.inputs) for image in images]
    together = vision.encode_batch([image.inputs for image in images], [image.num_rows for image in images])
    for one, batched, torch_one in zip(alone, together, reference):
        assert torch.equal(one, batched)
        torch.testing.assert_close(one, torch_one, rtol=1e-4, atol=1e-4)
