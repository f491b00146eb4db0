"""A GGUF model's linear layers (the default model's, or a GGUF file --model names) in the blocks they ship
as, for the batch-invariant CPU kernels.

Converting the GGUF dequantizes each block to float32 (GGUF's own dequantizer, then transformers' row
order); the kernels widen the same blocks in registers to the same float32 values, so keeping the blocks
changes no output while each step reads 4.5 bits per weight (Q4_K), 5 (Q4_1), 5.1 (Q2_K), 5.5 (Q5_0, Q5_K), 6
(Q5_1), 6.6 (Q6_K) or 8.5 (Q8_0) instead of 32. Other types (Q4_0, Q3_K, the TQ and IQ types, MXFP4, NVFP4)
are rewritten as blocks of one of those forms, or of Q8_F32 (9 bits) or Q8_F32_16 (10), that hold the same
weights (engine/model/gguf_transcode.py's TRANSCODED).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.kernels.cpu.invariant import WeightForm
from engine.model.gguf_index import GGUFIndex
from engine.model.gguf_transcode import TRANSCODED, transcode

_FORMS = {
    GGMLQuantizationType.Q8_0: WeightForm.Q8_0,
    GGMLQuantizationType.Q4_1: WeightForm.Q4_1,
    GGMLQuantizationType.Q5_0: WeightForm.Q5_0,
    GGMLQuantizationType.Q5_1: WeightForm.Q5_1,
    GGMLQuantizationType.Q4_K: WeightForm.Q4_K,
    GGMLQuantizationType.Q5_K: WeightForm.Q5_K,
    GGMLQuantizationType.Q6_K: WeightForm.Q6_K,
    GGMLQuantizationType.Q2_K: WeightForm.Q2_K,
}
# A decoder layer's projection, by its Llama module name, to its GGUF tensor's.
_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def shipped_blocks(
    gguf: GGUFIndex, hf_model: torch.nn.Module
) -> dict[torch.nn.Linear, tuple[WeightForm, torch.Tensor]]:
    """Each linear layer of `hf_model` (converted from the GGUF file `gguf` indexes) whose GGUF tensor is in a
    form the kernels read, as (form, blocks [N, K / block weights * block bytes]) in the layer's row order (a
    GGUF row is whole blocks: llama.cpp writes a k-quant model's tensors whose K is no multiple of 256 in another
    type); layers named otherwise than Llama's (Phi-3's fused ones) are left out. The caller keeps blocks only
    where they widen to the converted weights exactly."""
    tensors = gguf.tensors
    # llama.cpp interleaves q's and k's rows per rotary head for Llama's architecture (Mistral's too) alone.
    interleaved = gguf.architecture == "llama"
    config = hf_model.config
    names = {}
    for index, layer in enumerate(hf_model.model.layers):
        for module_name, tensor_name in _LAYER_TENSORS.items():
            module = _submodule(layer, module_name)
            if isinstance(module, torch.nn.Linear):
                names[module] = f"blk.{index}.{tensor_name}.weight"
    names[hf_model.lm_head] = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    found = {}
    for module, name in names.items():
        tensor = tensors.get(name)
        if tensor is None or (tensor.type not in _FORMS and tensor.type not in TRANSCODED):
            continue
        rows = np.asarray(gguf.data(tensor))
        form, rows = transcode(tensor.type, rows) if tensor.type in TRANSCODED else (_FORMS[tensor.type], rows)
        if interleaved and name.endswith("attn_q.weight"):
            rows = _reverse_permute(rows, config.num_attention_heads)
        elif interleaved and name.endswith("attn_k.weight"):
            rows = _reverse_permute(rows, config.num_key_value_heads)
        found[module] = (form, torch.from_numpy(rows.copy()))
    return found


def _submodule(layer: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _reverse_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of each rotary head's rows, as transformers does on conversion
    (LlamaTensorProcessor), on rows of any form: blocks run along K, so whole rows move."""
    half_head = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half_head, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)
