"""Reasoning output: the parser a model's chat output is read with, chosen once at start-up from the
flag (--reasoning-parser) or the model's tokenizer, and the split it asks of each request.

A parser turns a prompt into the engine's `Reasoning` or `ChannelReasoning` (engine/types.py): where the
output thinks and where its answer begins. The engine cuts the output there (engine/reasoning.py), so stop
strings, the grammar of structured output and tool calls see only the answer. gpt-oss's harmony channels
are app/serving/harmony.py's parser.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from transformers import PreTrainedTokenizerBase

from app.serving.harmony import HarmonyChannels, is_harmony
from engine.types import ChannelReasoning, Reasoning

logger = logging.getLogger(__name__)

ReasoningParserName = Literal["auto", "none", "deepseek_r1", "harmony", "qwen3"]

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser(Protocol):
    name: str

    def for_prompt(self, prompt_ids: Sequence[int]) -> Reasoning | ChannelReasoning:
        """How the output that follows this prompt is split."""


@dataclass(frozen=True)
class ThinkTags:
    """`<think>…</think>` reasoning, as Qwen3, DeepSeek-R1 (and its distills) and SmolLM3 write it.
    The output thinks from its start when the prompt left a `<think>` open (templates that open it
    in the generation prompt, as R1 distills' do) or when it writes `<think>` first; `always_open`
    (deepseek_r1) has it think from its start regardless, as R1 does before answering."""

    name: str
    start_token_id: int
    end_token_id: int
    always_open: bool = False

    def for_prompt(self, prompt_ids: Sequence[int]) -> Reasoning:
        return Reasoning(self.start_token_id, self.end_token_id, self.always_open or self._left_open(prompt_ids))

    def _left_open(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt's last tag opens a reasoning (the tags end a prompt: read from its end)."""
        for token_id in reversed(prompt_ids):
            if token_id == self.start_token_id:
                return True
            if token_id == self.end_token_id:
                return False
        return False


def _think_tags(name: str, always_open: bool) -> Callable[[PreTrainedTokenizerBase], ReasoningParser]:
    def build(tokenizer: PreTrainedTokenizerBase) -> ReasoningParser:
        ids = _single_tokens(tokenizer, (THINK_START, THINK_END))
        if ids is None:
            raise ValueError(
                f"--reasoning-parser {name} needs {THINK_START} and {THINK_END} as tokens of their own in the "
                "model's vocabulary, and this model's tokenizer has no such tokens"
            )
        return ThinkTags(name, *ids, always_open=always_open)

    return build


PARSERS: dict[str, Callable[[PreTrainedTokenizerBase], ReasoningParser]] = {
    "deepseek_r1": _think_tags("deepseek_r1", always_open=True),
    "harmony": HarmonyChannels.of,
    "qwen3": _think_tags("qwen3", always_open=False),
}


def reasoning_parser(name: ReasoningParserName, tokenizer: PreTrainedTokenizerBase) -> ReasoningParser | None:
    """The parser --reasoning-parser names; `auto`: `harmony`'s for a harmony model (gpt-oss), else
    `qwen3`'s (the prompt decides where the output starts) when the chat template writes `</think>` and
    the vocabulary has both tags as tokens of their own, else none. A named parser the tokenizer cannot
    serve is a start-up error."""
    if name == "none":
        return None
    if name != "auto":
        return PARSERS[name](tokenizer)
    if is_harmony(tokenizer):
        logger.info("reasoning: the harmony format's analysis channel is split off (--reasoning-parser harmony)")
        return PARSERS["harmony"](tokenizer)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if THINK_END not in template or _single_tokens(tokenizer, (THINK_START, THINK_END)) is None:
        return None
    parser = PARSERS["qwen3"](tokenizer)
    logger.info(
        "reasoning: the chat template thinks in %s…%s; its output is split (--reasoning-parser qwen3)",
        THINK_START,
        THINK_END,
    )
    return parser


def _single_tokens(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> tuple[int, ...] | None:
    """The token ids of these texts where each is one token of the vocabulary, else None."""
    vocab = tokenizer.get_vocab()
    ids = tuple(vocab.get(text) for text in texts)
    return None if None in ids else ids
