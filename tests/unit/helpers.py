"""Builders shared by unit tests: requests, Hugging Face's greedy reference, and running tiny engines
(their models: engine/tiny.py)."""

from __future__ import annotations

import asyncio
import copy
import time

import torch

from engine.channel import StreamChannel
from engine.detokenizer import IncrementalDetokenizer, StopMatcher, TokenBytes
from engine.engine import Engine
from engine.request import Request
from engine.tiny import TINY_VOCAB
from engine.types import Chunk, SamplingParams

# One of each way of sampling: greedy, temperature alone, and each truncation (keyword arguments of SamplingParams).
SAMPLING_KINDS = [
    dict(temperature=0.0),
    dict(temperature=0.8),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.2, top_k=20),
    dict(temperature=0.7, min_p=0.1, top_p=0.95),
]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's own greedy decoding of `prompt`: the reference the paged forward must reproduce."""
    return [token for token, _ in hf_greedy_logprobs(hf_model, prompt, max_new_tokens)]


def hf_greedy_logprobs(hf_model, prompt: list[int], max_new_tokens: int) -> list[tuple[int, float]]:
    """hf_greedy's tokens, each with its logprob under the model's own logits."""
    out = hf_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in zip(out.logits, tokens)]
    return list(zip(tokens, logprobs))


def make_request(
    prompt_len: int, max_tokens: int = 8, params: SamplingParams | None = None, first_token: int = 1
) -> Request:
    """A request for scheduler tests: no model, no loop is ever touched. Its prompt counts up
    from `first_token`, so requests of one `first_token` share their prefixes."""
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(
        request_id="r",
        prompt_token_ids=list(range(first_token, first_token + prompt_len)),
        params=params,
        channel=StreamChannel(asyncio.new_event_loop(), num_choices=params.n),
        detokenizer=IncrementalDetokenizer(TokenBytes([b""] * TINY_VOCAB)),
        stop_matcher=StopMatcher(params.stop),
    )


async def collect(engine: Engine, prompt: list[int], params: SamplingParams) -> list[Chunk]:
    return (await collect_handed_over(engine, prompt, params))[0]


class RecordingChannel(StreamChannel):
    """A channel that also keeps each chunk as the engine handed it over: a reader that falls behind
    (a loaded machine) gets merged chunks, so how the engine cut its output shows only here."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_choices: int = 1) -> None:
        super().__init__(loop, num_choices)
        self.handed_over: list[Chunk] = []

    def deliver(self, chunk: Chunk) -> None:
        self.handed_over.append(chunk)
        super().deliver(chunk)


async def collect_handed_over(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[list[Chunk], list[Chunk]]:
    """collect's chunks as read, and the same output as the engine handed it over."""
    channel = RecordingChannel(asyncio.get_running_loop(), num_choices=params.n)
    engine.submit("t", prompt, params, channel)
    read = [chunk async for chunk in channel]
    return read, channel.handed_over


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def tokens_of(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# A Qwen3-style chat template (ChatML) whose generation prompt opens the reasoning, as DeepSeek-R1
# distills' templates do, unless `enable_thinking` is false, which closes it empty as Qwen3's does.
# Earlier replies lose their reasoning, as in both.
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else -%}{{ '<think>\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def thinking_tokenizer(tokenizer):
    """A copy of `tokenizer` with `<think>` and `</think>` as tokens of their own (not special, so
    their text shows in a raw completion, as in Qwen3's vocabulary) and THINKING_TEMPLATE."""
    thinking = copy.deepcopy(tokenizer)
    thinking.add_tokens(["<think>", "</think>"])
    thinking.chat_template = THINKING_TEMPLATE
    return thinking


# A chat template in the harmony format, after gpt-oss's (shorter): a system message, the tools as a
# developer message's TypeScript namespace, earlier calls sent to `functions.NAME` on the commentary
# channel, their results from `functions.NAME`, answers on the final channel, and a generation prompt
# that opens the assistant's message for the model to write its channel.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>Reasoning: medium\\n\\n# Valid channels: analysis, commentary, final.<|end|>' -}}"
    "{%- if tools -%}"
    "{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n' -}}"
    "{%- for tool in tools -%}"
    "{{- 'type ' + tool.function.name + ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\\n' -}}"
    "{%- endfor -%}"
    "{{- '} // namespace functions<|end|>' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last='') -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}{%- set ns.last = call.function.name -%}"
    "{{- '<|start|>assistant to=functions.' + call.function.name + '<|channel|>commentary json<|message|>' -}}"
    "{{- (call.function.arguments | tojson) + '<|call|>' -}}"
    "{%- endfor -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start|>functions.' + ns.last + ' to=assistant<|channel|>commentary<|message|>' -}}"
    "{{- message.content + '<|end|>' -}}"
    "{%- else -%}"
    "{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def harmony_tokenizer(tokenizer):
    """A copy of `tokenizer` with the harmony format's tokens (special, as in gpt-oss's vocabulary),
    `<|return|>` as its end of sequence, and HARMONY_TEMPLATE."""
    harmony = copy.deepcopy(tokenizer)
    harmony.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    harmony.eos_token = "<|return|>"
    harmony.chat_template = HARMONY_TEMPLATE
    return harmony
