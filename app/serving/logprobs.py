"""Token logprobs in OpenAI's two shapes: chat's (each token with its bytes and its top alternatives)
and completions' (parallel lists, with each token's offset in the text)."""

from __future__ import annotations

from collections.abc import Sequence

from app.serving.payloads import ChatTokenLogprob, ChoiceLogprobs, CompletionLogprobs, TopLogprob
from engine.detokenizer import TokenBytes
from engine.types import TokenLogprob


def chat_logprobs(token_bytes: TokenBytes, logprobs: Sequence[TokenLogprob]) -> ChoiceLogprobs:
    content = []
    for entry in logprobs:
        token, raw = _token(token_bytes, entry.token_id)
        top = [TopLogprob(token=t, logprob=lp, bytes=b) for t, b, lp in _top(token_bytes, entry)]
        content.append(ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=raw, top_logprobs=top))
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    token_bytes: TokenBytes, logprobs: Sequence[TokenLogprob], offset: int
) -> tuple[CompletionLogprobs, int]:
    """Completions-style logprobs for tokens whose text starts at `offset`, and the offset after them."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for entry in logprobs:
        token, _ = _token(token_bytes, entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({t: lp for t, _, lp in _top(token_bytes, entry)})
        result.text_offset.append(offset)
        offset += len(token)
    return result, offset


def _token(token_bytes: TokenBytes, token_id: int) -> tuple[str, list[int]]:
    raw = token_bytes.join([token_id])
    return raw.decode("utf-8", errors="replace"), list(raw)


def _top(token_bytes: TokenBytes, entry: TokenLogprob) -> list[tuple[str, list[int], float]]:
    return [(*_token(token_bytes, token_id), logprob) for token_id, logprob in entry.top]
