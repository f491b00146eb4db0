"""Requests and their n choices: a request is made once, and its other n - 1 choices are forked off it
once its prompt is prefilled."""

from __future__ import annotations

from engine.channel import StreamChannel
from engine.detokenizer import IncrementalDetokenizer, StopMatcher, TokenBytes
from engine.images import ImageInput, image_blocks
from engine.kv_cache import BlockManager
from engine.model.runner import ModelRunner
from engine.request import Request
from engine.sampling.grammar import GrammarCompiler
from engine.sampling.masks import StepMasks
from engine.scheduler import Scheduler, StepPlan
from engine.types import SamplingParams


class Choices:
    """Makes requests and forks their choices; a forked choice shares its parent's full KV blocks."""

    def __init__(
        self,
        token_bytes: TokenBytes,
        grammars: GrammarCompiler,
        block_manager: BlockManager,
        runner: ModelRunner,
        scheduler: Scheduler,
    ) -> None:
        self.token_bytes = token_bytes
        self.grammars = grammars
        self.block_manager = block_manager
        self.runner = runner
        self.scheduler = scheduler

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        channel: StreamChannel,
        index: int,
        images: tuple[ImageInput, ...] = (),
    ) -> Request:
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            channel=channel,
            images=images,
            image_blocks=image_blocks(images) if images and self.runner.whole_images else (),
            rope_positions=self.runner.rope_positions(len(prompt_token_ids), images) if images else None,
            detokenizer=IncrementalDetokenizer(self.token_bytes),
            stop_matcher=StopMatcher(params.stop),
            index=index,
            # Choices forked later copy the first choice's state instead.
            constraint=(
                self.grammars.constraint(params.grammar, params.reasoning) if params.grammar and index == 0 else None
            ),
        )

    def fork(
        self, plan: StepPlan, sampling_requests: list[Request], masks: StepMasks | None
    ) -> tuple[list[Request], list[int]]:
        """Fork the other n-1 choices off each request whose prompt just finished prefilling.

        They share its full KV blocks, get copies of its last partial one and sample
        their first token from its logits row. A choice that finds no free block
        waits and prefills the prompt itself. Returns every sampling request with the
        first logits row it reads.
        """
        row_starts, row = [], 0
        for request in sampling_requests:
            row_starts.append(row)
            row += 1 + len(plan.proposals.get(request, ()))
        num_new = dict(plan.scheduled)
        for parent, parent_row in list(zip(sampling_requests, row_starts)):
            if not parent.num_pending_forks:
                continue
            parent.num_pending_forks = 0
            for index in range(1, parent.params.n):
                child = self.new_request(
                    parent.request_id, parent.prompt_token_ids, parent.params, parent.channel, index, parent.images
                )
                child.arrival_time, child.first_scheduled_time = parent.arrival_time, parent.first_scheduled_time
                if parent.constraint is not None:
                    # Every choice keeps its own grammar state, starting where the parent's is now.
                    child.constraint = parent.constraint.copy()
                    if masks is not None:
                        masks.share(child, parent)
                copies = self.block_manager.fork(parent, child, parent.num_tokens)
                if copies is not None:
                    self.runner.copy_blocks(copies)
                    child.num_computed_tokens = parent.num_computed_tokens
                    plan.scheduled.append((child, num_new[parent]))
                    sampling_requests.append(child)
                    row_starts.append(parent_row)
                self.scheduler.add_fork(parent, child)
        return sampling_requests, row_starts
