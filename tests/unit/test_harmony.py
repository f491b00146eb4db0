"""The harmony format (gpt-oss): its output's text into content and tool calls under any chunking
(app/serving/harmony.py), the grammar that holds an output to it, the engine's split of the analysis
channel on a tiny gpt-oss writing a forced harmony output, and a tiny gpt-oss served in process through
/v1/chat/completions: its calls as OpenAI's tool_calls (streamed as deltas), nothing of the format in
content."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from app.serving.harmony import HarmonyChannels, HarmonyParser, grammar, is_harmony
from app.serving.output_format import HARMONY, HERMES, output_format
from app.serving.reasoning import reasoning_parser
from app.serving.streaming import DONE, CompletionRenderer
from app.serving.tools import ArgumentsDelta, CallStarted, Content, Function, ToolUse
from app.sse_reader import parse_events
from engine.channel import StreamChannel
from engine.config import SpeculativeConfig
from engine.detokenizer import IncrementalDetokenizer, StopMatcher, TokenBytes
from engine.kv_cache import BlockManager
from engine.output import OutputProcessor
from engine.request import Request
from engine.sampling.grammar import GrammarCompiler
from engine.scheduler import Scheduler
from engine.tiny import tiny_engine, tiny_hf_model, tiny_loaded
from engine.types import GrammarSpec, SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect, collect_handed_over, harmony_tokenizer

CALL = (
    "<|start|>assistant<|channel|>commentary<|message|>Checking the <b>weather</b>.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris","note":"a<|e|>nd"}'
)
WEATHER = Function("get_weather", None, {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}})


def parse(pieces_of_text):
    parser = HarmonyParser()
    pieces = [p for text in pieces_of_text for p in parser.feed(text)] + parser.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    started = [(p.index, p.name) for p in pieces if isinstance(p, CallStarted)]
    arguments = {}
    for p in pieces:
        if isinstance(p, ArgumentsDelta):
            arguments[p.index] = arguments.get(p.index, "") + p.text
    return content, started, arguments, parser


def test_a_preamble_is_content_and_a_message_to_a_function_its_call():
    content, started, arguments, parser = parse([CALL])
    assert content == "Checking the <b>weather</b>."
    assert started == [(0, "get_weather")]
    assert json.loads(arguments[0]) == {"city": "Paris", "note": "a<|e|>nd"}
    assert [(name, args) for _, name, args in parser.calls()] == [("get_weather", arguments[0])]


def test_any_chunking_gives_the_same_result():
    whole = parse([CALL])[:3]
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(CALL)), rng.randint(1, 30)))
        parts = [CALL[a:b] for a, b in zip([0, *cuts], [*cuts, len(CALL)])]
        assert parse(parts)[:3] == whole


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("<|channel|>final<|message|>It is sunny.", "It is sunny.", []),
        # The recipient before the channel, as gpt-oss's template writes earlier calls.
        ('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"x":1}', "", [("f", '{"x":1}')]),
        # A later analysis message is not content.
        (
            "<|channel|>final<|message|>A<|end|><|start|>assistant<|channel|>analysis<|message|>hmm<|end|>"
            "<|start|>assistant<|channel|>final<|message|>B",
            "AB",
            [],
        ),
        # Text that is no harmony message at all, and a header that never ends: content.
        ("Hello, world", "Hello, world", []),
        ("<|channel|>fin", "<|channel|>fin", []),
    ],
)
def test_channels_and_recipients(text, content, calls):
    parsed, _, _, parser = parse([text])
    assert parsed == content
    assert [(name, args) for _, name, args in parser.calls()] == calls


def test_the_grammar_holds_calls_and_answers_to_the_format():
    required = grammar(ToolUse((WEATHER, Function("other", None, {"type": "object"})), "get_weather"), None).source
    assert "commentary to=functions.get_weather " in required and "functions.other" not in required
    assert '"final"' not in required
    answer = GrammarSpec.json_schema({"type": "object"})
    either = grammar(ToolUse((WEATHER,), "auto"), answer).source
    assert "functions.get_weather" in either and '"final"' in either
    assert '"final"' in grammar(None, answer).source
    # Tool choice auto, no schema: the model's own format, parsed as it comes.
    assert grammar(ToolUse((WEATHER,), "auto"), None) is None and grammar(None, None) is None


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return harmony_tokenizer(default_tokenizer)


def test_a_harmony_tokenizer_gets_harmony_s_parsers_and_shows_its_syntax(tokenizer, default_tokenizer):
    assert is_harmony(tokenizer) and not is_harmony(default_tokenizer)
    assert output_format("auto", tokenizer) is HARMONY and output_format("auto", default_tokenizer) is HERMES
    assert output_format("hermes", tokenizer) is HERMES
    with pytest.raises(ValueError, match="harmony"):
        output_format("harmony", default_tokenizer)
    assert isinstance(reasoning_parser("auto", tokenizer), HarmonyChannels)
    assert reasoning_parser("none", tokenizer) is None
    loaded = tiny_loaded(tokenizer, vocab_size=len(tokenizer))
    shown = loaded.token_bytes.join(
        tokenizer.encode("<|channel|>final<|message|>Hi<|return|>", add_special_tokens=False)
    )
    assert shown == b"<|channel|>final<|message|>Hi"


def test_the_grammar_compiles_and_takes_a_call_after_analysis_or_without(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|return|>")])
    spec = grammar(ToolUse((WEATHER,), "required"), None)
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>'
    for text in (call, f"<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant{call}"):
        matcher = compiler.constraint(spec).matcher
        assert matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)), text
        assert matcher.is_stopped()
    refused = compiler.constraint(spec).matcher
    assert not refused.consume_tokens(tokenizer.encode("<|channel|>final<|message|>Hi", add_special_tokens=False))


async def test_the_engine_splits_the_analysis_off_and_the_answer_keeps_its_header(tokenizer):
    # A grammar of literals makes the random model write a whole harmony output; the analysis channel's
    # text then comes as reasoning, and the answer as its messages, the header held across steps.
    loaded = tiny_loaded(tokenizer, "gpt_oss", vocab_size=len(tokenizer), kernels_cache=CACHE_DIR)
    forced = GrammarSpec(
        "grammar",
        'start: <|channel|> "analysis" <|message|> "Two plus two." <|end|> <|start|> "assistant" <|channel|> "final"'
        ' <|message|> "Four."',
    )
    reasoning = HarmonyChannels.of(tokenizer).for_prompt([])
    engine = tiny_engine(loaded)
    engine.start()
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, grammar=forced, reasoning=reasoning)
        chunks = await collect(engine, tokenizer.encode("<|start|>assistant", add_special_tokens=False), params)
    finally:
        engine.shutdown()
    assert "".join(c.reasoning for c in chunks) == "Two plus two."
    text = "".join(c.text for c in chunks)
    assert text == "<|start|>assistant<|channel|>final<|message|>Four."
    assert parse([text])[0] == "Four."
    assert chunks[-1].timings.reasoning_tokens == len(tokenizer.encode("Two plus two.", add_special_tokens=False))


@pytest.mark.parametrize("bursts", [None, "jump-forward", "speculation"], ids=["token-by-token", "jump", "spec"])
async def test_a_later_analysis_message_is_reasoning_too(tokenizer, bursts):
    """Analysis, a preamble, analysis again, the final message: decoded a token a step, forced in one burst
    (the grammar's jump-forward, the preamble's end inside it) or in bursts a speculation's proposals make
    (n-grams of a prompt that holds the same output), both analyses are reasoning, in order, and the answer
    keeps both of its messages (the second analysis's header and end are neither)."""
    loaded = tiny_loaded(tokenizer, "gpt_oss", vocab_size=len(tokenizer), kernels_cache=CACHE_DIR)
    forced = GrammarSpec(
        "grammar",
        'start: <|channel|> "analysis" <|message|> "Two plus two." <|end|> <|start|> "assistant" <|channel|>'
        ' "commentary" <|message|> "Let me check." <|end|> <|start|> "assistant" <|channel|> "analysis"'
        ' <|message|> "Still four." <|end|> <|start|> "assistant" <|channel|> "final" <|message|> "Four."',
    )
    reasoning = HarmonyChannels.of(tokenizer).for_prompt([])
    speculative = SpeculativeConfig("ngram", num_tokens=8) if bursts == "speculation" else None
    engine = tiny_engine(loaded, jump_forward=bursts == "jump-forward", speculative=speculative)
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
    later = "<|start|>assistant<|channel|>analysis<|message|>Still four.<|end|>"
    final = "<|start|>assistant<|channel|>final<|message|>Four."
    written = "<|channel|>analysis<|message|>Two plus two.<|end|>" + preamble + later + final
    prompt = tokenizer.encode((written if speculative else "") + "<|start|>assistant", add_special_tokens=False)
    engine.start()
    try:
        params = SamplingParams(max_tokens=60, temperature=0.0, grammar=forced, reasoning=reasoning, stop=("Five",))
        chunks, handed_over = await collect_handed_over(engine, prompt, params)
    finally:
        engine.shutdown()
    steps = [len(c.token_ids) for c in handed_over]
    assert max(steps) > 1 if bursts else all(n == 1 for n in steps)
    text = "".join(c.text for c in chunks)
    assert parse([text])[0] == "Let me check.Four."
    assert "".join(c.reasoning for c in chunks) == "Two plus two.Still four."
    assert text == preamble + final
    # The later reasoning comes after the preamble's text, as the model wrote it.
    first_later = next(i for i, c in enumerate(chunks) if "Still" in c.reasoning)
    assert "check" in "".join(c.text for c in chunks[:first_later])
    thought = len(tokenizer.encode("Two plus two.Still four.", add_special_tokens=False))
    assert chunks[-1].timings.reasoning_tokens == thought


# Analysis, a preamble, analysis again, then the answer: a final message or a call (each with its end of sequence).
THOUGHT = "<|channel|>analysis<|message|>Two plus two is four, café.<|end|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
LATER = "<|start|>assistant<|channel|>analysis<|message|>Still four — naïve.<|end|>"
ANSWERS = {
    "final": "<|start|>assistant<|channel|>final<|message|>It is <b>four</b>.<|return|>",
    "call": "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris"}<|call|>',
}


@pytest.fixture(scope="module")
def gpt_oss_token_bytes(tokenizer) -> TokenBytes:
    """The tiny gpt-oss's token bytes, its syntax tokens shown."""
    return tiny_loaded(tokenizer, "gpt_oss", vocab_size=len(tokenizer), kernels_cache=CACHE_DIR).token_bytes


async def _chat_of_bursts(tokenizer, token_bytes: TokenBytes, token_ids: list[int], size: int, stop, stream: bool):
    """The chat response (its SSE payloads, or the fold) to an output of `token_ids` whose steps keep `size`
    tokens each (as speculation's or jump-forward's bursts), through the scheduler, the output processor and
    the renderer; the reader reads between steps or lags behind, as it happens."""
    eos = frozenset(tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    scheduler = Scheduler(BlockManager(64, 16), 1, 1024, 1024, eos)
    output = OutputProcessor(scheduler)
    reasoning = HarmonyChannels.of(tokenizer).for_prompt([])
    params = SamplingParams(max_tokens=len(token_ids), temperature=0.0, stop=stop, reasoning=reasoning)
    prompt = tokenizer.encode("<|start|>assistant", add_special_tokens=False)
    channel = StreamChannel(asyncio.get_running_loop())
    renderer = CompletionRenderer(
        "chat",
        "gpt-oss",
        len(prompt),
        1,
        False,
        True,
        channel,
        token_bytes,
        parser=HarmonyParser,
        splits_reasoning=True,
    )
    request = Request("r", prompt, params, channel, IncrementalDetokenizer(token_bytes), StopMatcher(stop))
    scheduler.add(request)
    reader = asyncio.create_task(_payloads(renderer) if stream else renderer.fold())
    for step in range(0, len(token_ids), size):
        plan = scheduler.schedule()
        for kept, kept_ids in scheduler.postprocess(plan, {request: token_ids[step : step + size]}):
            output.emit(kept, kept_ids, [])
        output.flush()
        if request.is_finished:
            break
        await asyncio.sleep(0)
    return await reader


async def _payloads(renderer: CompletionRenderer) -> list[dict]:
    return [json.loads(payload) for payload in [p async for p in renderer.events()] if payload != DONE]


def _in_order(payloads: list[dict]) -> list[tuple[str, str]]:
    """The stream's deltas as (what, text) in order, a run of one kind as one: reasoning, content, a call's
    name, its arguments. A call's id is left out (each response draws its own)."""
    runs: list[tuple[str, str]] = []
    for payload in payloads:
        for choice in payload["choices"]:
            delta = choice["delta"]
            call = (delta.get("tool_calls") or [{}])[0].get("function", {})
            for kind, text in [
                ("reasoning", delta.get("reasoning_content")),
                ("content", delta.get("content")),
                ("name", call.get("name")),
                ("arguments", call.get("arguments")),
                ("finish", choice.get("finish_reason")),
            ]:
                if not text:
                    continue
                if runs and runs[-1][0] == kind:
                    runs[-1] = (kind, runs[-1][1] + text)
                else:
                    runs.append((kind, text))
    return runs + [("usage", json.dumps(p["usage"])) for p in payloads if p.get("usage")]


@pytest.mark.parametrize("stop", [(), ("four",)], ids=["no-stop", "stop"])
@pytest.mark.parametrize("answer", ANSWERS)
async def test_bursts_of_any_size_give_what_a_token_a_step_gives(tokenizer, gpt_oss_token_bytes, answer, stop):
    """The same output kept a token a step, in bursts of 2, 3 and 7, and whole (the preamble's end inside a
    burst, a later analysis after it): the same content, reasoning, calls and usage, and the stream's deltas
    of each kind in the same order. A stop string that the reasoning holds never cuts it; the final message's
    cuts it."""
    token_ids = tokenizer.encode(THOUGHT + PREAMBLE + LATER + ANSWERS[answer], add_special_tokens=False)
    streamed, folded = {}, {}
    for size in (1, 2, 3, 7, len(token_ids)):
        streamed[size] = _in_order(
            await _chat_of_bursts(tokenizer, gpt_oss_token_bytes, token_ids, size, stop, stream=True)
        )
        response = await _chat_of_bursts(tokenizer, gpt_oss_token_bytes, token_ids, size, stop, stream=False)
        call_ids = {"message": {"tool_calls": {"__all__": {"id"}}}}
        folded[size] = [choice.model_dump(exclude=call_ids) for choice in response.choices]
        folded[size].append(response.usage.model_dump())
    assert all(streamed[size] == streamed[1] for size in streamed), streamed
    assert all(folded[size] == folded[1] for size in folded), folded
    [choice, usage] = folded[1]
    message = choice["message"]
    assert message["reasoning_content"] == "Two plus two is four, café.Still four — naïve."
    thought = tokenizer.encode("Two plus two is four, café.Still four — naïve.", add_special_tokens=False)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(thought)
    if answer == "call":
        assert message["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
        [call] = message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    else:
        assert message["content"] == ("Let me check.It is <b>" if stop else "Let me check.It is <b>four</b>.")
        assert choice["finish_reason"] == "stop"
    # The later reasoning comes between the preamble and the answer, as the model wrote them.
    kinds = [kind for kind, _ in streamed[1]]
    assert kinds[:3] == ["reasoning", "content", "reasoning"]


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory, tokenizer):
    """A tiny random gpt-oss over the harmony tokenizer, its ends of sequence <|return|> and <|call|>."""
    model = tiny_hf_model("gpt_oss", vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    folder = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
async def client(gpt_oss_folder):
    """/v1 of a server of the tiny gpt-oss, in this process."""
    from app.server import create_app
    from app.settings import Settings

    settings = Settings(
        model=str(gpt_oss_folder), cache_dir=CACHE_DIR, max_model_len=512, kv_cache_gib=0.02, device="cpu"
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sluice/v1", timeout=120) as client:
            yield client


def _weather_request(tokenizer, **extra) -> dict:
    # Where the grammar lets the model choose, these biases make it think (analysis) and stop thinking at once.
    analysis, end = tokenizer.convert_tokens_to_ids(["analysis", "<|end|>"])
    return {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": WEATHER.name, "parameters": WEATHER.parameters}}],
        "tool_choice": "required",
        "max_tokens": 40,
        "temperature": 0,
        "logit_bias": {str(analysis): 30, str(end): 60},
        **extra,
    }


@pytest.mark.slow
async def test_gpt_oss_s_calls_come_as_tool_calls_and_its_final_channel_as_content(client, tokenizer):
    folded = (await client.post("/chat/completions", json=_weather_request(tokenizer))).json()
    choice = folded["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert not message.get("content") and "<|" not in json.dumps(message)
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")

    async with client.stream("POST", "/chat/completions", json=_weather_request(tokenizer, stream=True)) as response:
        events = parse_events([line async for line in response.aiter_lines()])
    assert events[-1].data == "[DONE]"
    deltas = [e.json()["choices"][0]["delta"] for e in events[:-1] if e.json()["choices"]]
    streamed = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas if d.get("tool_calls"))
    assert streamed == call["function"]["arguments"]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if d.get("tool_calls", [{}])[0].get("id")] == [
        "get_weather"
    ]
    assert not "".join(d.get("content") or "" for d in deltas)

    # The Responses API: the call as a function_call item, no message made of the format's headers. (It
    # reads no logit_bias, which it ignores: this model writes the call without an analysis first.)
    body = _weather_request(tokenizer)
    tool = {"type": "function", "name": WEATHER.name, "parameters": WEATHER.parameters}
    response = {"input": body["messages"], "tools": [tool], "tool_choice": "required", "temperature": 0}
    response.update(max_output_tokens=40, logit_bias=body["logit_bias"])
    output = (await client.post("/responses", json=response)).json()["output"]
    assert [item["type"] for item in output if item["type"] != "reasoning"] == ["function_call"]
    assert output[-1]["name"] == "get_weather" and output[-1]["arguments"] == call["function"]["arguments"]

    # A JSON schema: the answer's final message, its body the content.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = _weather_request(
        tokenizer, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    )
    del body["tools"], body["tool_choice"]
    message = (await client.post("/chat/completions", json=body)).json()["choices"][0]["message"]
    assert isinstance(json.loads(message["content"])["ok"], bool)
    del body["response_format"]
    refused = await client.post("/chat/completions", json={**body, "guided_regex": "a+"})
    assert refused.status_code == 400 and "harmony" in refused.json()["error"]["message"]
