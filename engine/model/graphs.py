"""Decode steps replayed as CUDA graphs.

Eager, a decode step on a GPU is mostly Python and kernel launches: the GPU waits on each of the
forward's hundreds of small kernels in turn. A graph captured once per batch size at start-up
replays them all in one launch. Batch sizes are bucketed (1, 2, 4, 8, then steps of 16 up to
--max-num-seqs); a step of n decodes is padded to its bucket with rows that write and read a scratch
cache block of their own, outside the pool, so they touch no request's K/V.

Every input lives in a static device buffer the graphs read: a step fills the first rows in place
(one copy for the token ids, positions, slots and context lengths, one for the block tables, both
queued from pinned staging memory without waiting for the GPU) and replays. With overlapped steps
(engine/future_tokens.py) token ids may be placeholders for tokens still on the device: the graph's
first kernels replace them from the buffer they were published to. Decode attention runs on the
Triton paged kernel, whose grid and shapes are fixed per bucket. Steps with a prompt chunk or a
verification, and steps larger than the largest bucket, run eagerly.

With --enforce-eager nothing is captured (`run_eagerly`): a decode step still goes through the static
buffers padded to its bucket, and runs the same kernels at the same shapes as the graph would, so it
computes the graph's logits bit for bit, only without the saving of one launch for all.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable

import torch

from engine.future_tokens import resolved
from engine.kv_cache import KVCache, flat_block_tables
from engine.model.attention.triton_paged import GpuAttention, PagedDecode, TritonMetadata
from engine.model.causal_lm import HeadOutput, PagedCausalLM

logger = logging.getLogger(__name__)

# What capturing a forward gives back: a call that runs it again and returns its output.
Replay = Callable[[], HeadOutput]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16 up to max_num_seqs, and max_num_seqs."""
    small = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    return [*small, *range(16, max_num_seqs, 16), max_num_seqs]


def run_eagerly(forward: Callable[[], HeadOutput]) -> Replay:
    """The capture of --enforce-eager: none; each replay runs the bucket's forward."""
    return forward


class CudaGraphCapture:
    """Captures forwards as CUDA graphs sharing one memory pool: the largest bucket is captured first,
    so the smaller ones fit in what it reserved."""

    def __init__(self) -> None:
        self._pool: tuple[int, int] | None = None

    def __call__(self, forward: Callable[[], HeadOutput]) -> Replay:
        # One eager run first: it compiles the Triton kernels and settles cuBLAS's workspaces, which
        # must not happen inside a capture.
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        if self._pool is None:
            self._pool = graph.pool()

        def replay() -> HeadOutput:
            graph.replay()
            return output

        return replay


class DecodeGraphs:
    """A replay per batch bucket over static input buffers; padding rows stay in the scratch block."""

    def __init__(
        self,
        model: PagedCausalLM,
        kv_cache: KVCache,
        attention: GpuAttention,
        block_size: int,
        scratch_block: int,
        max_num_seqs: int,
        max_model_len: int,
        capture: Callable[[Callable[[], HeadOutput]], Replay] | None = None,
        placeholders: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        # The device buffer of engine/future_tokens.py that placeholder token ids name, if steps overlap.
        self.placeholders = placeholders
        self.kv_cache = kv_cache
        self.attention = attention
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        device = model.device
        # A padding row: token 0 at position 0, written to and read from the scratch block's first slot.
        self._padding = (0, 0, scratch_block * block_size, 1)
        # Rows: token ids, positions, cache slots, context lengths; padding until a step fills them.
        self.inputs = torch.tensor(self._padding, device=device).unsqueeze(1).repeat(1, self.max_batch)
        self.block_tables = torch.full(
            (self.max_batch, -(-max_model_len // block_size)), scratch_block, dtype=torch.long, device=device
        )
        self.logits_indices = torch.arange(self.max_batch, device=device)
        # Pinned host memory for the copies up, two in turn (a step's copy is queued, not waited for):
        # one is reused only after the event recorded behind its copies has passed, which it has unless
        # two replays came without the host reading anything of the first (so it costs no wait).
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        if device.type == "cuda":
            size = self.inputs.numel() + self.block_tables.numel()
            self._staging = [(torch.empty(size, dtype=torch.long, pin_memory=True), torch.cuda.Event()) for _ in "ab"]
        captures = capture is None
        capture = capture or CudaGraphCapture()
        started, free_before = time.perf_counter(), self._free_memory()
        self._replays: dict[int, Replay] = {}
        for bucket in reversed(self.buckets):
            self._replays[bucket] = capture(lambda bucket=bucket: self._forward(bucket))
        if captures:
            logger.info(
                "CUDA graphs: %d batch sizes up to %d captured in %.1f s, %.0f MiB of GPU memory",
                len(self.buckets),
                self.max_batch,
                time.perf_counter() - started,
                (free_before - self._free_memory()) / 2**20,
            )

    def replay(self, token_ids: array, positions: array, slots: array, tables: list[list[int]]) -> HeadOutput:
        """The logits [n, V] of n decodes (n <= max_batch): the i-th reads its context through tables[i]."""
        num_decodes = len(token_ids)
        bucket = next(size for size in self.buckets if size >= num_decodes)
        pad = bucket - num_decodes
        host = array("q")
        for column, padding in zip((token_ids, positions, slots, [p + 1 for p in positions]), self._padding):
            host.extend(column)
            host.extend([padding] * pad)
        width = max(-(-(p + 1) // self.block_size) for p in positions)
        host.extend(flat_block_tables([*tables, *[[]] * pad], width, pad=self.scratch_block))
        rows = torch.frombuffer(host, dtype=torch.long)
        if self._staging:
            staging, copied = self._staging[0]
            self._staging.reverse()
            copied.synchronize()
            rows = staging[: len(host)].copy_(rows)
        inputs, tables_part = rows[: 4 * bucket].view(4, bucket), rows[4 * bucket :].view(bucket, width)
        self.inputs[:, :bucket].copy_(inputs, non_blocking=True)
        self.block_tables[:bucket, :width].copy_(tables_part, non_blocking=True)
        if self._staging:
            copied.record()
        return HeadOutput(self.launch(bucket).logits[:num_decodes])

    def launch(self, bucket: int) -> HeadOutput:
        """The captured step of `bucket` rows over the static buffers as they stand."""
        return self._replays[bucket]()

    def _forward(self, bucket: int) -> HeadOutput:
        token_ids, positions, slots, context_lens = (row[:bucket] for row in self.inputs)
        if self.placeholders is not None:
            token_ids = resolved(token_ids, self.placeholders)
        decode = PagedDecode(
            kernel=self.attention.decode,
            block_tables=self.block_tables[:bucket],
            context_lens=context_lens,
            block_size=self.block_size,
        )
        meta = TritonMetadata(slot_mapping=slots, num_decode_tokens=bucket, decode=decode, prefill=None)
        return self.model.forward(token_ids, positions, meta, self.kv_cache, self.logits_indices[:bucket])

    def _free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.model.device)[0] if self.model.device.type == "cuda" else 0
