"""Every Triton kernel compiles to a CUDA binary for an H100 (sm_90), as its wrapper launches it, with
the ptxas that ships in Triton's wheel: no GPU needed. Triton's interpreter, which the other kernel
tests use without a GPU, runs Python and accepts code the compiler refuses (a loop-carried value
whose type changes, an op the backend lacks); this catches that on every machine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="the GPU's kernels are written in Triton")

ROOT = Path(__file__).resolve().parents[2]


def compile_every_kernel() -> list[str]:
    """Runs in a process where TRITON_INTERPRET is unset: each wrapper is called on CPU tensors with its
    kernel's launch recorded instead of run, and each recorded launch is compiled."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels.cpu.sampling import row_settings
    from engine.kernels.gpu import activation as gpu_activation
    from engine.kernels.gpu import invariant as gpu_invariant
    from engine.kernels.gpu import paged_decode, paged_prefill
    from engine.kernels.gpu import rotary as gpu_rotary
    from engine.kernels.gpu import sampling as gpu_sampling
    from engine.types import SamplingParams
    from tests.unit.helpers import make_request

    pointer = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64"}
    launches = []

    def record(module, name, call):
        kernel = getattr(module, name)

        class Launcher:
            def __getitem__(self, grid):
                return lambda *args, **constexprs: launches.append((kernel, args, constexprs))

        setattr(module, name, Launcher())
        try:
            call()
        finally:
            setattr(module, name, kernel)

    for dtype in (torch.bfloat16, torch.float32):
        caches = [torch.zeros(8 * 16, 2, 64, dtype=dtype) for _ in range(2)]
        tables = torch.zeros(3, 4, dtype=torch.long)
        q = torch.zeros(5, 8, 64, dtype=dtype)
        record(
            paged_decode,
            "_paged_decode",
            lambda: paged_decode.paged_decode_attention(q, *caches, tables, torch.ones(5, dtype=torch.long), 16, 0.1),
        )
        chunks, tiles = torch.zeros(1, 3, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)
        record(
            paged_prefill,
            "_paged_prefill",
            lambda: paged_prefill.paged_prefill_attention(q, *caches, q.clone(), tables, chunks, tiles, 16, 0.1),
        )
        # Image blocks that attend both ways (Gemma 3), under a sliding window.
        ends = torch.ones(5, dtype=torch.long)
        record(
            paged_prefill,
            "_paged_prefill",
            lambda: paged_prefill.paged_prefill_attention(
                q, *caches, q.clone(), tables, chunks, tiles, 16, 0.1, window=8, key_ends=ends
            ),
        )
        x, weight = torch.zeros(3, 128, dtype=dtype), torch.zeros(4100, 128, dtype=dtype)
        record(gpu_invariant, "_linear", lambda: gpu_invariant.invariant_linear(x, weight, torch.float32))
        norm = gpu_invariant.InvariantRMSNorm(torch.ones(128, dtype=dtype), 1e-5)
        record(gpu_invariant, "_rms_norm", lambda: norm(x))
        record(gpu_invariant, "_add_rms_norm", lambda: norm.add(x, x))
        stacked = torch.zeros(3, 2 * 1500, dtype=dtype)
        record(gpu_activation, "_silu_and_mul", lambda: gpu_activation.silu_and_mul(*stacked.split(1500, -1)))
        qkv = torch.zeros(5, 12 * 64, dtype=dtype).split((8 * 64, 2 * 64, 2 * 64), -1)
        q, k, v = (part.view(5, -1, 64) for part in qkv)
        cos = torch.zeros(5, 1, 32, dtype=dtype)
        slots = torch.zeros(5, dtype=torch.long)
        record(gpu_rotary, "_rotary_and_store", lambda: gpu_rotary.rotary_and_store(q, k, v, cos, cos, *caches, slots))
    logits = torch.zeros(4, 49152)
    for top_k in (0, 40):
        params = SamplingParams(4, temperature=0.7, top_k=top_k, top_p=0.9)
        settings, keys = row_settings(params) * 4, [make_request(1, params=params).rng_key for _ in range(4)]
        record(gpu_sampling, "_sample", lambda: gpu_sampling.sample_on_device(logits, settings, keys, [1] * 4, top_k))

    compiled = []
    for kernel, args, constexprs in launches:
        # Launch options, not the kernel's parameters.
        options = {
            name: constexprs.pop(name) for name in ("num_warps", "num_stages", "enable_fp_fusion") if name in constexprs
        }
        signature = {}
        for name, value in zip(kernel.arg_names, args):
            if isinstance(value, torch.Tensor):
                signature[name] = pointer[value.dtype]
            else:
                signature[name] = "fp32" if isinstance(value, float) else "i64"
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        compiled.append(f"{kernel.__name__} {len(binary.asm['cubin'])}")
    return compiled


def test_every_triton_kernel_compiles_for_an_h100():
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = "from tests.unit.test_gpu_kernels_compile import compile_every_kernel; print(*compile_every_kernel())"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    names = result.stdout.split()[::2]
    # _paged_prefill twice: causal, and with image blocks that attend both ways.
    kernels = ["_paged_decode", "_paged_prefill", "_paged_prefill", "_linear", "_rms_norm", "_add_rms_norm"]
    kernels.append("_silu_and_mul")
    assert names == [*kernels, "_rotary_and_store"] * 2 + ["_sample"] * 2
