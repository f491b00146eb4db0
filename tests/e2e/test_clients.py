"""Clients no one here wrote, used as their users use them, against the default server."""

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI

from app.sse_reader import read_events
from tests.conftest import CACHE_DIR

pytestmark = pytest.mark.slow

PHRASINGS = [
    "Weather in Oslo?",
    "What's the weather like in Paris today?",
    "Is it raining in London?",
    "Tell me the forecast for Tokyo.",
    "How warm is it in Madrid right now?",
]


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return "sunny"


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


def test_langchain_bind_tools_required_gets_a_well_formed_call(server, model):
    # LangChain's schema says nothing of further keys: decoded as OpenAI's strict mode reads it, the
    # model cannot nest invented ones until the length limit cuts the call into invalid JSON. (At
    # temperature 1 the model may still run on inside a string value now and then: the seed keeps
    # this test about the server, and the cap keeps a failure quick.)
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="unused", model=model, seed=0, max_completion_tokens=400)
    bound = llm.bind_tools([get_weather], tool_choice="required")
    for phrasing in PHRASINGS:
        reply = bound.invoke(phrasing)
        assert reply.response_metadata["finish_reason"] == "tool_calls", (phrasing, reply)
        assert reply.invalid_tool_calls == [] and reply.tool_calls, (phrasing, reply)
        for call in reply.tool_calls:
            assert call["name"] == "get_weather" and set(call["args"]) == {"city"}, (phrasing, call)


def test_a_call_cut_by_the_length_limit_is_the_same_streamed_and_not(server, model):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [convert_to_openai_tool(get_weather)],
        "tool_choice": "required",
        "max_tokens": 18,
        "temperature": 0,
    }
    whole = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "length"
    (call,) = whole["message"]["tool_calls"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(call["function"]["arguments"])
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
        chunks = [event.json() for event in read_events(response) if event.data != "[DONE]"]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [d["function"].get("name") for d in deltas if "id" in d] == [call["function"]["name"]]
    assert "".join(d["function"].get("arguments", "") for d in deltas) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# The `openai` npm package, pinned; installed once into the cache (it needs the npm registry the first time).
OPENAI_NPM = "openai@6.30.1"


@pytest.fixture(scope="session")
def openai_npm_package() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the JavaScript client's test")
    prefix = CACHE_DIR / "npm" / OPENAI_NPM
    package = prefix / "node_modules" / "openai"
    if not (package / "index.mjs").exists():
        install = ["npm", "install", "--prefix", str(prefix), OPENAI_NPM, "--no-audit", "--no-fund"]
        result = subprocess.run(install, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            pytest.skip(f"could not install {OPENAI_NPM} (offline?): {result.stderr.strip()[-300:]}")
    return package


def test_the_openai_npm_package_streams_a_chat_and_a_tool_call(server, model, openai_npm_package):
    script = Path(__file__).parent / "js" / "stream_chat_and_tool.mjs"
    result = subprocess.run(
        ["node", str(script), server, model, str(openai_npm_package)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["text"].strip() and seen["call"]["name"] == "get_weather"
