"""Prompts → token ids: the model's chat template for messages, plain tokenization for text.

Tools reach the model through its template when the template knows them; otherwise
their definitions join the system prompt, earlier calls are written back as the model
writes them, and tool results come back in a user turn, all in the Hermes format
(app/serving/tools.py).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from app.errors import OpenAIError
from app.serving.messages import ChatMessage
from app.serving.tools import ToolUse, render_call, render_result

# Templates written before the "developer" role know it as "system".
_ROLE_ALIASES = {"developer": "system"}
# What a request's template variables may not name: apply_chat_template's own arguments, and the
# conversation the template reads as `messages`.
_RENDER_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self",
    "kwargs",
} | {"messages"}


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    tool_use: ToolUse | None = None,
    template_kwargs: dict[str, Any] | None = None,
    multimodal: bool = False,
) -> list[int]:
    """Render the conversation with the tokenizer's chat template, ending on the assistant's turn."""
    text = chat_prompt_text(tokenizer, messages, tool_use, template_kwargs=template_kwargs, multimodal=multimodal)
    return tokenizer.encode(text, add_special_tokens=False)


def chat_prompt_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    tool_use: ToolUse | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    multimodal: bool = False,
) -> str:
    """The conversation as the chat template renders it; `template_kwargs` are the request's own
    variables for the template (`chat_template_kwargs`). `multimodal`: every message's content goes to the
    template as a list of parts, an image part as `{"type": "image"}` where its placeholder goes, as a
    vision-language model's template reads them."""
    if not tokenizer.chat_template:
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", param="messages")
    if taken := sorted(set(template_kwargs or ()) & _RENDER_ARGUMENTS):
        raise OpenAIError(
            400, f"chat_template_kwargs may not set {', '.join(taken)}: Sluice sets it", param="chat_template_kwargs"
        )
    if template_knows_tools(tokenizer):
        conversation = [_native_message(m) for m in messages]
        tools = [_definition(f) for f in tool_use.functions] if tool_use else None
    else:
        conversation = [_text_message(m) for m in messages]
        tools = None
        if tool_use is not None:
            conversation = _with_system_prompt(conversation, tool_use.system_prompt())
    if multimodal:
        # A system prompt the tools added stands before the messages.
        aligned = [None] * (len(conversation) - len(messages)) + list(messages)
        conversation = [
            {**rendered, "content": _parts(rendered["content"], m)} for rendered, m in zip(conversation, aligned)
        ]
    try:
        return tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - a template raises whatever its author chose
        raise OpenAIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc


def template_knows_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and "tools" in template


def _definition(function) -> dict:
    body = {"name": function.name, "parameters": function.parameters}
    if function.description:
        body["description"] = function.description
    return {"type": "function", "function": body}


def _native_message(message: ChatMessage) -> dict:
    rendered = {"role": _ROLE_ALIASES.get(message.role, message.role), "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _text_message(message: ChatMessage) -> dict:
    if message.role == "tool":
        return {"role": "user", "content": render_result(message.text())}
    content = message.text()
    if message.tool_calls:
        calls = "\n".join(render_call(c.function.name, c.function.arguments) for c in message.tool_calls)
        content = f"{content}\n{calls}" if content else calls
    return {"role": _ROLE_ALIASES.get(message.role, message.role), "content": content}


def _parts(content: str, message: ChatMessage | None) -> list[dict]:
    """A rendered message's content as template parts: its text, its images where the message has them."""
    if message is None or not message.image_urls() or not isinstance(message.content, list):
        return [{"type": "text", "text": content}] if content else []
    # The message's own parts in order; what rendering added (tool calls written out) follows as text.
    parts = [{"type": "text", "text": p.text} if p.type == "text" else {"type": "image"} for p in message.content]
    extra = content[len(message.text()) :] if content.startswith(message.text()) else ""
    return [*parts, *([{"type": "text", "text": extra}] if extra else [])]


def _with_system_prompt(conversation: list[dict], prompt: str) -> list[dict]:
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]
        return [{"role": "system", "content": f"{first['content']}\n\n{prompt}"}, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]


def _arguments(arguments: str) -> object:
    """Templates expect arguments as a mapping; a text that is not JSON goes through as it is."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def text_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int]) -> list[int]:
    """Tokenize a raw prompt, or check a pre-tokenized one against the vocabulary."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    vocab_size = len(tokenizer)
    if any(not 0 <= t < vocab_size for t in prompt):
        raise OpenAIError(400, f"prompt token ids must lie in [0, {vocab_size})", param="prompt")
    return list(prompt)


def continuation_ids(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
    reply_ids: list[int],
    earlier: list[ChatMessage],
    new: list[ChatMessage],
    tool_use: ToolUse | None,
) -> list[int] | None:
    """The prompt of a conversation's next turn: the earlier turn's own token ids (its prompt and
    reply, as the engine computed them), then the new messages as the template renders them after
    the reply. None when that is not exactly the template's rendering of the whole conversation
    (the caller then renders it all): `earlier` are the messages through the earlier reply, whose
    text must be what `reply_ids` decode to, and which the template must render as that text
    followed by a closing part (ChatML's `<|im_end|>\n`), of which a final end-of-turn token in
    `reply_ids` is the start.
    """
    special = set(tokenizer.all_special_ids)
    ends_turn = bool(reply_ids) and reply_ids[-1] in special
    reply = tokenizer.decode(reply_ids[:-1] if ends_turn else reply_ids)
    if not reply or earlier[-1].role != "assistant" or earlier[-1].text() != reply:
        return None
    before = chat_prompt_text(tokenizer, earlier, tool_use, add_generation_prompt=False)
    after = chat_prompt_text(tokenizer, [*earlier, *new], tool_use)
    at = before.rfind(reply)
    if at < 0 or not after.startswith(before):
        return None
    closing = before[at + len(reply) :]
    if ends_turn:
        end = tokenizer.decode(reply_ids[-1:])
        if not closing.startswith(end):
            return None
        closing = closing[len(end) :]
    return prompt_ids + reply_ids + tokenizer.encode(closing + after[len(before) :], add_special_tokens=False)
