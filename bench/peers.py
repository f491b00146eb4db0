"""The servers users would pick instead of Sluice, each installed into its own throw-away environment.

    python bench/peers.py transformers     # build the environment only
    python bench/serve.py --spawn sluice= --peer transformers

Environments live under `$SLUICE_PEERS_DIR` (default `~/.cache/sluice-peers`), never in the project's
`.venv`. `transformers` is `transformers serve --continuous-batching` in a venv of its own (torch pinned
to the CPU wheel, as the project does). `llama-server` is built with cmake from the llama.cpp sources
that the `llama-cpp-python` sdist vendors (about 8 minutes on two cores) and serves the default
model's own Q4_1 GGUF.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from app.server_process import wait_until_healthy

PEERS_DIR = Path(os.environ.get("SLUICE_PEERS_DIR", Path.home() / ".cache" / "sluice-peers"))
TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Model:
    """The default model as each kind of server takes it."""

    folder: Path
    gguf: Path


def _run(*command: str | Path, cwd: Path | None = None) -> None:
    print("+", " ".join(map(str, command)), flush=True)
    subprocess.run([str(c) for c in command], check=True, cwd=cwd)


def transformers_env() -> Path:
    """A venv holding `transformers serve` at the project's transformers version."""
    import transformers

    home = PEERS_DIR / "transformers"
    # The vision extra (Pillow): its image processors, for the vision-language bench (bench/vision.py).
    stamp = home / f".installed-{transformers.__version__}-vision"
    if not stamp.exists():
        _run(sys.executable, "-m", "venv", "--clear", home)
        pip = home / "bin" / "pip"
        _run(pip, "install", "--quiet", TORCH)
        _run(pip, "install", "--quiet", f"transformers[serving,vision]=={transformers.__version__}", "accelerate")
        stamp.touch()
    return home / "bin" / "transformers"


def llama_server() -> Path:
    """llama.cpp's server binary, built from the sources the `llama-cpp-python` sdist vendors."""
    home = PEERS_DIR / "llama.cpp"
    binary = home / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    home.mkdir(parents=True, exist_ok=True)
    downloads = home / "sdist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        # Only its source: with :all:, pip builds the sdist's build requirements (cmake among them) from source too.
        "--no-binary",
        "llama-cpp-python",
        "-d",
        downloads,
        "llama-cpp-python",
    )
    archive = next(downloads.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(home / "src", filter="data")
    source = next((home / "src").glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    _run(
        "cmake",
        "-S",
        source,
        "-B",
        home / "build",
        "-G",
        "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DGGML_NATIVE=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
    )
    _run("cmake", "--build", home / "build", "--target", "llama-server", "-j", str(os.cpu_count() or 2))
    return binary


def transformers_serve(transformers: list[str], folder: Path, dtype: str, port: int) -> list[str]:
    """The command line of `transformers serve --continuous-batching` on `folder`, `transformers` being
    the command that runs the `transformers` CLI."""
    return [
        *transformers,
        "serve",
        "--continuous-batching",
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        str(folder),
    ]


def command(peer: str, model: Model, port: int) -> list[str]:
    if peer == "transformers":
        # float32, as the reference figures were taken (bf16 is not its CPU default).
        return transformers_serve([str(transformers_env())], model.folder, "float32", port)
    if peer == "llama-server":
        # One slot per stream up to 64, each with the full 2048-token context the bench needs at most.
        return [
            str(llama_server()),
            "-m",
            str(model.gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            "64",
            "-c",
            str(64 * 2048),
            "-cb",
            "--log-disable",
        ]
    raise ValueError(f"unknown peer {peer!r}: transformers or llama-server")


def start(peer: str, model: Model, port: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(command(peer, model, port), env=dict(os.environ, HF_HUB_OFFLINE="1"))
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, base, peer)
    return proc, base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peer", choices=["transformers", "llama-server"])
    peer = parser.parse_args().peer
    print(transformers_env() if peer == "transformers" else llama_server())


if __name__ == "__main__":
    main()
