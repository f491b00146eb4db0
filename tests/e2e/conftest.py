"""Real Sluice server processes on 127.0.0.1, one per configuration the tests need.

Each is started by the first test that asks for it and stopped after a test when no test after it in
collection order asks for it, so a test process holds few servers at a time (one on the default model is
about 0.6 GB at rest). `make test` runs two processes (`-n 2 --dist loadfile`): each runs whole files, the
largest first, which is not collection order, so a server may be stopped while a file still to run needs
it. The fixtures are therefore per module, each asking `_SHARED` for its server, which starts it again if
it was stopped. Tests share them: every test starts once its servers have nothing running
(`_shared_servers_idle` waits for that) and checks what its requests change, not totals.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from app import server_process
from tests.conftest import CACHE_DIR

# The server as `make serve` runs it, plus the fault-injection hook.
DEFAULT_FLAGS = ("--enable-fault-injection",)
# The door's keys: one given as a flag, one read from its key file.
KEY, FILE_KEY = "sk-sluice-test", "sk-from-file"


def start_server(*flags: str, stderr: IO[bytes] | None = None) -> tuple[subprocess.Popen, str]:
    """A server process of its own with these flags, once /health answers 200 (its stderr to `stderr`
    if given). On the CPU on every machine: what these tests check (outputs that do not depend on the
    batch above all) is the CPU kernels' promise; the GPU path has its own tests (tests/unit) and
    benchmark (bench/gpu.py)."""
    return server_process.start(
        ["--device", "cpu", *flags], env={"SLUICE_CACHE_DIR": str(CACHE_DIR)}, stderr=stderr, timeout=180
    )


def serve(*flags: str) -> Iterator[str]:
    """For a fixture of a module that needs a configuration no other module does: its own server."""
    proc, base = start_server(*flags)
    yield base
    server_process.stop(proc)


class SharedServers:
    """The session's shared servers by fixture name: started on first use, stopped by
    `pytest_runtest_teardown` once no later test in collection order uses that fixture."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.bases: dict[str, str] = {}

    def get(self, name: str, *flags: str) -> str:
        if name not in self.procs:
            self.procs[name], self.bases[name] = start_server(*flags)
        return self.bases[name]

    def stop_unused(self, remaining: list[pytest.Item]) -> None:
        for name in [name for name in self.procs if not any(name in item.fixturenames for item in remaining)]:
            server_process.stop(self.procs.pop(name))

    def wait_until_idle(self, names: list[str], timeout: float = 240) -> None:
        """Until the named running servers have no request running, waiting or paused: what a test
        that ended early (a client gone, a fault) left still winding down."""
        for name in names:
            deadline = time.monotonic() + timeout
            while True:
                health = httpx.get(f"{self.bases[name]}/health", timeout=5).json()
                if health["num_running"] == health["num_waiting"] == health["num_paused"] == 0:
                    break
                assert time.monotonic() < deadline, f"{name} did not become idle: {health}"
                time.sleep(0.05)


_SHARED = SharedServers()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    items = item.session.items
    _SHARED.stop_unused(items[items.index(item) + 1 :] if nextitem is not None else [])


def pytest_sessionfinish() -> None:
    _SHARED.stop_unused([])


@pytest.fixture(autouse=True)
def _shared_servers_idle(request: pytest.FixtureRequest) -> None:
    _SHARED.wait_until_idle([name for name in _SHARED.procs if name in request.fixturenames])


@pytest.fixture(scope="module")
def server(default_model_path) -> str:
    """The default configuration, shared by every test that needs nothing else."""
    return _SHARED.get("server", *DEFAULT_FLAGS)


@pytest.fixture(scope="module")
def flow_server(default_model_path) -> str:
    """Tight flow-control settings, so back-pressure, keep-alive and resume expiry happen within seconds."""
    flags = ("--max-unread-tokens", "16", "--write-buffer-kib", "4", "--keepalive-seconds", "0.3")
    return _SHARED.get("flow_server", *flags, "--resume-window-seconds", "3")


@pytest.fixture(scope="module")
def ngram_server(default_model_path) -> str:
    """Default numerics, n-gram speculation, and a small unread-token bound so slow readers pause."""
    return _SHARED.get("ngram_server", "--speculative", "ngram", "--max-unread-tokens", "8")


@pytest.fixture(scope="session")
def door_folder(tmp_path_factory) -> Path:
    """The door's key file and audit log, the same for every start of it."""
    folder = tmp_path_factory.mktemp("door")
    (folder / "keys").write_text(f"# operators\n\n{FILE_KEY}\n")
    return folder


@pytest.fixture(scope="module")
def door(door_folder, default_model_path) -> tuple[str, int, Path]:
    """Every front-door setting on: keys (flag and file), protected metrics, a queue bound, a body
    limit, a max_tokens cap and an audit log. Its base URL, process id and audit log."""
    audit = door_folder / "audit.jsonl"
    base = _SHARED.get(
        "door",
        "--api-key", KEY,
        "--api-key-file", str(door_folder / "keys"),
        "--protect-metrics",
        "--max-queue", "2",
        "--max-num-seqs", "2",
        "--max-request-bytes", "4096",
        "--max-tokens-limit", "64",
        "--audit-log", str(audit),
        "--timeout-keep-alive", "3",
    )  # fmt: skip
    return base, _SHARED.procs["door"].pid, audit


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, default_tokenizer) -> Path:
    """A tiny random Llama with the default model's tokenizer: for tests of what the API accepts and
    answers (validation, fuzzing), whose text does not matter and whose requests must be quick."""
    from engine.tiny import tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_hf_model(vocab_size=len(default_tokenizer)).save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_path) -> str:
    """The tiny model behind a real server, generation kept short (8 tokens of output); its whole
    context (1,024 tokens), so that what a fuzzer sends fits."""
    flags = ("--model", str(tiny_model_path), "--max-model-len", "1024", "--max-tokens-limit", "8")
    return _SHARED.get("tiny_server", *flags, "--kv-cache-gib", "0.05")


@pytest.fixture(scope="session")
def vision_model_path(tmp_path_factory, default_tokenizer) -> Path:
    """A tiny random LLaVA (engine/tiny_vision.py)."""
    from engine.tiny_vision import tiny_vision_folder

    return tiny_vision_folder("llava", default_tokenizer, tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def vision_server(vision_model_path) -> str:
    """The tiny LLaVA behind a real server: what takes images end to end."""
    return _SHARED.get("vision_server", "--model", str(vision_model_path), "--kv-cache-gib", "0.05")


# The conversation the thinking model is made to end its reasoning in (see thinking_model_path).
THINKING_MESSAGES = [{"role": "user", "content": "Is 17 a prime number?"}]


@pytest.fixture(scope="session")
def thinking_model_path(tmp_path_factory, default_tokenizer) -> Path:
    """A tiny random Qwen3 whose tokenizer has `<think>` and `</think>` and a chat template that opens the
    reasoning in the generation prompt (tests/unit/helpers.py THINKING_TEMPLATE). Random weights never
    choose to stop thinking, so `</think>`'s output row is made twice the row of the token the model
    writes 5th for THINKING_MESSAGES: it then writes `</think>` there (or where that token's score is
    the best before), and thinks before it and answers after it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.unit.helpers import thinking_tokenizer

    tokenizer = thinking_tokenizer(default_tokenizer)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    prompt = tokenizer.apply_chat_template(THINKING_MESSAGES, add_generation_prompt=True, return_tensors="pt")
    prompt = prompt["input_ids"] if not isinstance(prompt, torch.Tensor) else prompt
    written = model.generate(prompt, max_new_tokens=5, do_sample=False)[0, prompt.shape[1] :]
    with torch.no_grad():
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("</think>")] = 2 * model.lm_head.weight[written[4]]
    folder = tmp_path_factory.mktemp("thinking-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def thinking_server(thinking_model_path) -> str:
    """The tiny thinking model behind a real server; its reasoning parser is found from its template."""
    flags = ("--model", str(thinking_model_path), "--max-model-len", "256", "--kv-cache-gib", "0.05")
    return _SHARED.get("thinking_server", *flags)


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


def blocks_held(health: dict) -> int:
    """KV blocks that requests hold: those in use less those pinned for stored responses, whose pins expire on
    their own clock (a Responses test run before on the same server may leave some that expire mid-test)."""
    return health["kv_blocks_used"] - health["kv_blocks_pinned"]


@pytest.fixture
def health(server):
    def read() -> dict:
        return httpx.get(f"{server}/health", timeout=5).json()

    return read
