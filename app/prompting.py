"""Prompts → token ids: the model's chat template for messages, plain tokenization for text."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from app.errors import OpenAIError
from app.protocol import ChatMessage

# Templates written before the "developer" role know it as "system".
_ROLE_ALIASES = {"developer": "system"}


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage]) -> list[int]:
    """Render the conversation with the tokenizer's chat template, ending on the assistant's turn."""
    if not tokenizer.chat_template:
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
    conversation = [{"role": _ROLE_ALIASES.get(m.role, m.role), "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template raises whatever its author chose
        raise OpenAIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def text_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int]) -> list[int]:
    """Tokenize a raw prompt, or check a pre-tokenized one against the vocabulary."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    vocab_size = len(tokenizer)
    if any(not 0 <= t < vocab_size for t in prompt):
        raise OpenAIError(400, f"prompt token ids must lie in [0, {vocab_size})", param="prompt")
    return list(prompt)
