"""What the engine is built with (EngineConfig) and what it publishes after every step (EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SpeculativeConfig:
    method: Literal["ngram", "draft"]
    num_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    # Above this many running requests the engine stops speculating: verification costs
    # compute a large batch does not have to spare.
    max_batch_size: int = 4


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    # A request whose reader is this many tokens behind is paused until it catches up.
    max_unread_tokens: int = 256
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    # Constrained requests append the tokens their grammar forces without sampling them.
    jump_forward: bool = True
    # Stored conversations: how long a finished turn's KV stays pinned after its last use, and
    # the most of the pool pins may hold (the oldest pin goes first past it).
    pinned_kv_seconds: float = 300.0
    max_pinned_kv_fraction: float = 0.25
    # Free blocks holding cached prefixes kept before a new block reuses one rather than one never handed out
    # (engine/kv_cache.py); None: as many as the pool has.
    max_idle_cached_blocks: int | None = None
    # On a GPU, run decode steps eagerly instead of replaying CUDA graphs captured at start-up (still
    # padded to the graphs' batch buckets, so they compute what the graphs would).
    enforce_eager: bool = False
    # Overlapped steps (engine/step/overlapped.py); None: where the forward runs apart from the engine
    # thread (a GPU), not where it is the thread's own work (a CPU).
    overlap_steps: bool | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step; readers never touch live state."""

    alive: bool
    num_running: int
    num_waiting: int
    num_paused: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_steps: int
    num_preemptions: int
    num_draft_tokens: int
    num_accepted_tokens: int
    kv_blocks_cached: int
    # Blocks held for stored conversations (counted in kv_blocks_used too).
    kv_blocks_pinned: int
    # Prompt tokens looked up in the prefix cache, and how many it held.
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    # A vision-language model's images: looked up in the encoder cache, found there, and the vision tower's
    # seconds on the engine thread (the images it encoded). Zero for a text model.
    num_image_queries: int = 0
    num_image_hits: int = 0
    vision_seconds: float = 0.0
