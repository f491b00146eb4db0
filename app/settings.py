"""Settings: one frozen object, from flags (--max-num-seqs) or environment (SLUICE_MAX_NUM_SEQS)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "sluice"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SLUICE_",
        frozen=True,
        use_attribute_docstrings=True,
        cli_kebab_case=True,
        cli_prog_name="sluice",
        cli_implicit_flags=True,
        protected_namespaces=(),
    )

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 for every interface)."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to listen on."""
    model: str | None = None
    """Local Hugging Face model folder to serve, or a GGUF file (converted once into the cache, through
    transformers' GGUF reader); unset serves the embedded SmolLM2-135M-Instruct."""
    served_model_name: str | None = None
    """Name clients use in the `model` field; defaults to the model folder's name."""
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    """Where GGUF models' one-time conversion to safetensors and index of their tensors (the default model's, a
    GGUF `--model`'s) and the built kernels are kept."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when present, else CPU."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bfloat16 on CUDA; float32 on a CPU (with --no-batch-invariant, bfloat16 on CPUs with native bf16)."""
    quantize: Literal["none", "q8_0", "q4_1"] = "none"
    """Quantize the weights at load into GGUF's blocks of 32, read by the batch-invariant CPU kernels: q8_0 (8
    bits, about a quarter of float32's bytes) or q4_1 (4 bits, an eighth; the output head as q8_0, as llama.cpp
    keeps it). Outputs stay deterministic and batch-invariant, but are no longer bit-equal to the unquantized
    model's (docs/performance.md has the accuracy). Needs the batch-invariant kernels on a CPU in float32; layers
    whose input width is not a multiple of 32 stay as they are."""
    batch_invariant: bool = True
    """A request's tokens depend on the request alone (prompt, parameters, seed), not on what shares its batch, the
    prefix cache, chunking or speculation: float32 linear layers and attention on Sluice's own kernels (Linux on x86
    CPUs with AVX2 or on AArch64, built on first start with the system C++ compiler); on a CUDA GPU, linear layers
    and RMSNorm on its Triton kernels, in any dtype. --no-batch-invariant uses torch's kernels."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Most requests decoding together in one step; more wait in the queue. Default: 64 on a CPU, 256 on a GPU."""
    max_num_batched_tokens: int | None = Field(None, ge=16)
    """Token budget of one step; longer prompts are prefilled in chunks of at most this. Default: 256 on a
    CPU, 2048 on a GPU; for a model whose images a step computes whole (Gemma 3), at least an image's tokens plus
    one per stream, and never less than an image's."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt + completion in tokens; defaults to the model's context length."""
    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV-cache block."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The KV cache's element type, as vLLM's flag. auto: the model's (--dtype). On the batch-invariant CPU kernels,
    bfloat16 or float16 halve a float32 model's cache (twice the tokens in --kv-cache-gib): each key and value is
    rounded once as it is stored and widened exactly as it is read, so outputs stay deterministic and
    batch-invariant, but are not bit-equal to a float32 cache's. Elsewhere (torch's kernels, a GPU) a type other
    than the model's is refused at start."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """Memory for the paged KV cache, in GiB. Default: 2 on a CPU; on a GPU, what --gpu-memory-utilization
    leaves once the weights are loaded and a step's activations are set aside."""
    kv_cache_idle_gib: float | None = Field(None, ge=0)
    """Of the KV cache, the most that finished requests' cached prefixes keep idle before a new block reuses the
    least recently used of them instead of a block never used (past it the cache still serves every prefix it
    holds). A CPU's cache is memory that becomes resident as blocks are first used, so its resident part is what
    running requests hold at their most plus this. Default: 0.25 on a CPU; on a GPU, whose cache is allocated
    at start, the whole cache."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """On a GPU, the fraction of its memory Sluice may fill in all (weights, activations, CUDA graphs, KV cache;
    memory other processes hold counts against it), as vLLM's flag; it sizes the KV cache when --kv-cache-gib
    is not given."""
    enforce_eager: bool = False
    """On a GPU, run every step eagerly; by default decode steps replay CUDA graphs captured at start-up, one per
    batch size (1, 2, 4, 8, then every 16 up to --max-num-seqs), as vLLM's flag. Eager decode steps are padded to
    the same batch sizes, so the outputs are the same either way."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes seen before (system prompts, resent conversation history);
    --no-enable-prefix-caching turns it off."""
    speculative: Literal["off", "ngram", "draft"] = "off"
    """Speculative decoding: `ngram` proposes continuations found in the request's own prompt and output;
    `draft` decodes ahead with --draft-model."""
    draft_model: str | None = None
    """With --speculative draft: a local HF folder sharing the model's tokenizer, or `self:L` for the
    model's own first L layers and head."""
    num_speculative_tokens: int = Field(6, ge=1, le=16)
    """Tokens proposed per request per step."""
    ngram_min: int = Field(2, ge=1, le=8)
    """Shortest suffix the n-gram proposer looks up."""
    ngram_max: int = Field(3, ge=1, le=8)
    """Longest suffix the n-gram proposer looks up (tried first)."""
    speculative_max_batch_size: int = Field(4, ge=1)
    """Speculate only while at most this many requests run; above it verification costs more than it saves."""
    jump_forward: bool = True
    """Structured output: where the grammar allows exactly one continuation (a JSON key, punctuation),
    append its tokens at once instead of sampling them one by one; --no-jump-forward turns it off."""
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "harmony", "qwen3"] = "auto"
    """How a thinking model's chat output is split into `reasoning_content` and `content`, as vLLM's flag:
    `qwen3` reads `<think>…</think>` (the output thinks from its start when the prompt leaves `<think>` open
    or when it writes `<think>` first); `deepseek_r1` has the output think from its start until `</think>`
    regardless; `harmony` takes gpt-oss's leading `analysis` messages; `auto` is `harmony` for a harmony
    model (its tokens in the vocabulary, a chat template writing `<|channel|>`), else `qwen3` when the
    chat template writes `</think>` and both tags are tokens of the vocabulary, else `none` (all output is
    content)."""
    tool_call_parser: Literal["auto", "hermes", "harmony"] = "auto"
    """The format a chat output's tool calls are read from (and decoded under, when a grammar holds the
    output to it), as vLLM's flag: `hermes`, `<tool_call>` blocks of JSON (Qwen, Hermes; the prompt teaches
    it to models whose template knows no tools); `harmony`, gpt-oss's messages (calls to
    `functions.NAME`, the `final` channel as content); `auto` is `harmony` for a harmony model, else
    `hermes`."""
    stream_interval: int = Field(1, ge=1, le=1024)
    """Tokens per streamed chunk unless a request sets its own; the last chunk always flushes."""
    keepalive_seconds: float = Field(15.0, gt=0)
    """Interval of the SSE comment that keeps proxies from closing a quiet stream."""
    max_unread_tokens: int = Field(256, ge=1)
    """A stream whose reader is this many tokens behind is paused (KV kept) until it catches up."""
    write_buffer_kib: int = Field(16, ge=4, le=4096)
    """Per-connection socket and transport write buffer: how much a stalled client can leave unread
    before its stream backs up to the engine."""
    resume_window_seconds: float = Field(30.0, gt=0)
    """How long a resumable stream waits for its client to come back before it is cancelled; a finished
    one is kept as long after its last reader leaves."""
    timeout_keep_alive: float = Field(75.0, gt=0)
    """Seconds an idle keep-alive connection stays open. Longer than the idle timeouts of clients' pools
    and of proxies (httpx's, so the OpenAI SDK's, is 5 s; a load balancer's often 60 s): the side that
    closes first must be the client, or a request sent as the server closes meets a dead connection."""
    response_retention: float = Field(3600.0, gt=0)
    """Seconds a stored response (`store: true` on /v1/responses) is kept: retrievable, resumable and
    continuable with `previous_response_id`; after it those get 404."""
    response_kv_ttl: float = Field(300.0, ge=0)
    """Seconds a stored response's KV blocks stay pinned in the prefix cache after its last use, so a
    follow-up computes only its new input; after it the next turn recomputes what was evicted."""
    max_pinned_kv_fraction: float = Field(0.25, ge=0, le=0.9)
    """Most of the KV pool pinned for stored responses; past it the oldest conversation loses its pin
    first (running requests' blocks are never taken)."""
    shutdown_timeout: float = Field(25.0, ge=0)
    """On SIGTERM or SIGINT, how long running requests may take to finish before they are ended with
    an error event; new requests get 503 meanwhile. Keep it below Kubernetes'
    terminationGracePeriodSeconds."""
    api_key: list[str] = Field(default_factory=list)
    """An API key clients must send as `Authorization: Bearer KEY` on every /v1 route (repeatable).
    No key set: the server is open."""
    api_key_file: Path | None = None
    """A file of API keys, one per line (blank lines and lines starting with # ignored)."""
    protect_metrics: bool = False
    """Require an API key on /metrics too (/health and /health/live always stay open)."""
    max_queue: int | None = Field(None, ge=0)
    """Most requests waiting to be scheduled; beyond it new requests get 429 with Retry-After. Unset:
    unbounded."""
    max_request_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    """Largest request body accepted; larger ones get 413."""
    max_tokens_limit: int | None = Field(None, ge=1)
    """Caps every request's max_tokens (and its default); a request asking for more gets 400."""
    limit_images_per_prompt: int = Field(8, ge=0)
    """Most images one request may carry (a vision-language model's); more get 400."""
    max_image_pixels: int = Field(16_777_216, ge=1)
    """Largest image accepted, in pixels (width x height, read from its header before anything is decoded, so a
    decompression bomb is refused unopened); larger ones get 400."""
    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1)
    """Largest image accepted, in bytes once its data URL is decoded or its URL fetched; larger ones get 400. A
    data URL also counts against --max-request-bytes."""
    allowed_media_domains: list[str] = Field(default_factory=list)
    """Hosts whose http(s) image URLs the server fetches (repeatable; exact host names). None by default: only
    data: URLs are read, since a server that fetches any URL it is sent can be made to reach what only it can
    reach (SSRF). Redirects are followed only to these hosts; file: and other schemes are always refused."""
    media_fetch_timeout: float = Field(10.0, gt=0)
    """Seconds an image fetch from an allowed host may take in all; slower ones get 400."""
    audit_log: Path | None = None
    """Append one JSON line per finished request to this file (`-` for stderr): who asked for what,
    tokens, finish reason, latency. Off when unset."""
    audit_log_content: bool = False
    """Also record prompts and outputs in the audit log."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the server and the engine."""
    enable_fault_injection: bool = False
    """Mount POST /debug/fault, which makes the next engine step raise (tests only)."""
