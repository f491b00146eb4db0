"""Images on the wire, in process (the app over httpx's ASGI transport, a tiny engine behind it): every bad
image input is a 400 whose OpenAI error names the part, the engine is left with nothing, and a good image
is answered after it. A text-only model refuses images; remote URLs are fetched only from allowed hosts,
from a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from app.server import create_app
from app.settings import Settings
from app.state import serve_state
from engine.model.loader import load_model
from engine.tiny import tiny_engine, tiny_loaded
from engine.tiny_vision import tiny_vision_folder
from tests.conftest import CACHE_DIR


def picture(seed: int = 0, size: tuple[int, int] = (40, 30)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels over a few bytes of data that decode to nothing
    whole: refused by its header it is never decompressed (decoded, it would be truncated)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def chat_body(*parts: dict, text: str = "What is this?", **fields) -> dict:
    content = [{"type": "text", "text": text}, *parts]
    return {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}], **fields}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


class _Files(BaseHTTPRequestHandler):
    """/ok: a PNG; /big: 64 KiB; /slow: sleeps; /missing: 404; /away: a redirect to `localhost` (another host)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/missing":
            self.send_error(404)
            return
        if self.path == "/away":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/ok")
            self.end_headers()
            return
        body = b"\0" * 65536 if self.path == "/big" else encoded(picture(3), "PNG")
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


class InProcess:
    """An app over a running tiny engine, and a client for it."""

    def __init__(self, loaded, **flags) -> None:
        self.settings = Settings(_cli_parse_args=False, **flags)
        self.engine = tiny_engine(loaded, max_num_batched_tokens=16)
        self.engine.start()
        self.app = create_app(self.settings)
        self.app.state.sluice = serve_state(self.settings, loaded, self.engine)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://sluice", timeout=60)

    def close(self) -> None:
        self.engine.shutdown()


@pytest.fixture(scope="module")
def vision_server(default_tokenizer, tmp_path_factory, files) -> Iterator[InProcess]:
    folder = tiny_vision_folder("llava", default_tokenizer, tmp_path_factory.mktemp("llava"))
    loaded = load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=True)
    server = InProcess(
        loaded,
        limit_images_per_prompt=2,
        max_image_pixels=200_000,
        max_image_bytes=32 * 1024,
        allowed_media_domains=["127.0.0.1"],
        media_fetch_timeout=0.5,
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def text_server(default_tokenizer) -> Iterator[InProcess]:
    server = InProcess(tiny_loaded(default_tokenizer, "llama", vocab_size=len(default_tokenizer)))
    yield server
    server.close()


async def refused(server: InProcess, body: dict, param: str, words: str, path: str = "/v1/chat/completions") -> None:
    """The request gets a 400 naming `param`, whose message says `words`; the engine is left holding nothing."""
    async with server.client() as client:
        response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"], error["message"]
    assert server.engine.stats.num_running == server.engine.stats.num_waiting == 0


PARAM = "messages[1].content[1].image_url"

BAD_IMAGES = {
    "invalid base64": ("data:image/png;base64,iVBORw0K!!!not base64", "invalid base64"),
    "not base64-encoded": ("data:image/png,rawbytes", "must be base64"),
    "not an image media type": (data_url(b"hello", "text/plain"), "not an image type"),
    "bytes that are not an image": (data_url(b"just some text, no image at all"), "not an image"),
    "an unsupported format": (data_url(encoded(picture(), "BMP"), "image/bmp"), "unsupported image format BMP"),
    "a truncated PNG": (data_url(encoded(picture(), "PNG")[:200]), "corrupt or truncated"),
    "over the pixel limit": (data_url(encoded(Image.new("RGB", (600, 400), "red"), "PNG")), "600x400, over 200000"),
    "a decompression bomb": (data_url(bomb_png(100_000, 100_000)), "pixels"),
    "a bomb within Pillow's own limit": (data_url(bomb_png(5_000, 5_000)), "5000x5000, over 200000 pixels"),
    "over the size cap": (data_url(encoded(picture(size=(200, 200)), "PNG")), "over 32768 bytes"),
    "a file URL": ("file:///etc/passwd", "file URL is not accepted"),
    "an ftp URL": ("ftp://127.0.0.1/x.png", "ftp URL is not accepted"),
    "a host not allowed": ("http://example.com/cat.png", "not in --allowed-media-domains"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
async def test_a_bad_image_is_a_400_naming_its_part(vision_server, case):
    url, words = BAD_IMAGES[case]
    await refused(vision_server, chat_body(image_part(url)), PARAM, words)


async def test_remote_fetches_time_out_are_capped_and_stay_on_allowed_hosts(vision_server, files):
    await refused(vision_server, chat_body(image_part(f"{files}/slow")), PARAM, "took more than 0.5 s")
    await refused(vision_server, chat_body(image_part(f"{files}/big")), PARAM, "over 32768 bytes")
    await refused(vision_server, chat_body(image_part(f"{files}/away")), PARAM, "'localhost' is not in")
    await refused(vision_server, chat_body(image_part(f"{files}/missing")), PARAM, "returned HTTP 404")


async def test_more_images_than_the_limit_names_the_first_one_over(vision_server):
    good = image_part(data_url(encoded(picture(), "PNG")))
    await refused(vision_server, chat_body(good, good, good), "messages[1].content[3].image_url", "at most 2 images")


async def test_a_text_only_model_refuses_images(text_server):
    good = image_part(data_url(encoded(picture(), "PNG")))
    await refused(text_server, chat_body(good), PARAM, "takes text only")


async def test_the_responses_api_names_its_input_image(vision_server):
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": "data:image/png;base64,@@@"},
                ],
            }
        ]
    }
    await refused(vision_server, body, "input[0].content[1].image_url", "invalid base64", path="/v1/responses")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
async def test_every_accepted_format_is_answered_after_the_refusals(vision_server, fmt, files):
    """Each accepted format is read (GIF: its first frame); a different image, a different answer."""
    body = chat_body(
        image_part(data_url(encoded(picture(1), fmt), f"image/{fmt.lower()}")), max_tokens=12, temperature=0
    )
    other = chat_body(
        image_part(data_url(encoded(picture(2), fmt), f"image/{fmt.lower()}")), max_tokens=12, temperature=0
    )
    remote = chat_body(image_part(f"{files}/ok"), max_tokens=12, temperature=0)
    async with vision_server.client() as client:
        answers = [await client.post("/v1/chat/completions", json=b) for b in (body, other, body, remote)]
    assert [a.status_code for a in answers] == [200] * 4, answers[0].text
    texts = [a.json()["choices"][0]["message"]["content"] for a in answers]
    assert texts[0] == texts[2] != texts[1]
    assert all(a.json()["usage"]["prompt_tokens"] > 16 for a in answers)


async def test_the_openapi_document_allows_images_only_where_the_model_takes_them(text_server, vision_server):
    documents = []
    for server in (text_server, vision_server):
        async with server.client() as client:
            documents.append((await client.get("/openapi.json")).json()["components"]["schemas"])
    for document, offered in zip(documents, ([], ["ImageContentPart", "InputImage"])):
        parts = document["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"]["oneOf"]
        parts += document["MessageInput"]["properties"]["content"]["anyOf"][1]["items"]["oneOf"]
        refs = {part["$ref"].rsplit("/", 1)[1] for part in parts}
        assert refs == {"TextContentPart", "InputText", *offered}


async def test_the_openai_sdk_and_langchain_send_an_image_and_stream_the_answer(vision_server):
    """Clients no one here wrote, unchanged, over the in-process app: streamed answers equal the folded one."""
    import openai
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    url = data_url(encoded(picture(4), "JPEG"), "image/jpeg")
    question = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    model = vision_server.app.state.sluice.model_name
    async with vision_server.client() as http:
        client = openai.AsyncOpenAI(base_url="http://sluice/v1", api_key="unused", http_client=http)
        messages = [{"role": "user", "content": question}]
        folded = await client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        deltas = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        response = await client.responses.create(
            model=model,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": url},
                    ],
                }
            ],
            max_output_tokens=10,
            temperature=0,
        )
        llm = ChatOpenAI(
            base_url="http://sluice/v1",
            api_key="unused",
            model=model,
            max_tokens=10,
            temperature=0,
            http_async_client=http,
        )
        pieces = [piece.content async for piece in llm.astream([HumanMessage(content=question)])]
    answer = folded.choices[0].message.content
    assert answer and "".join(deltas) == answer == response.output_text == "".join(pieces)


async def test_health_and_metrics_count_the_encoder_cache(vision_server):
    """Two questions about one image: its tokens follow different text, so the prefix cache cannot hold them,
    and the second finds the image's embeddings in the encoder cache."""
    image = image_part(data_url(encoded(picture(9), "PNG")))
    bodies = [chat_body(image, text=text, max_tokens=2, temperature=0) for text in ("What is this?", "Describe it.")]
    async with vision_server.client() as client:
        before = (await client.get("/health")).json()
        for body in bodies:
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        await asyncio.sleep(0.2)  # the engine publishes its stats after each step
        after = (await client.get("/health")).json()
        metrics = (await client.get("/metrics")).text
    assert after["image_cache_queries"] - before["image_cache_queries"] == 2
    assert after["image_cache_hits"] - before["image_cache_hits"] == 1
    assert after["vision_seconds"] > before["vision_seconds"]
    assert "sluice:mm_cache_hits_total" in metrics and "sluice:vision_tower_seconds_total" in metrics


async def test_image_tokens_count_against_the_context(vision_server):
    """An image is as many prompt tokens as its image tokens: they leave that much less room for the answer."""
    image = image_part(data_url(encoded(picture(5), "PNG")))
    async with vision_server.client() as client:
        first = await client.post("/v1/chat/completions", json=chat_body(image, max_tokens=1, temperature=0))
        with_image = first.json()["usage"]["prompt_tokens"]
        without = (await client.post("/v1/chat/completions", json=chat_body(max_tokens=1))).json()["usage"]
        room = vision_server.engine.config.max_model_len
        over = await client.post("/v1/chat/completions", json=chat_body(image, max_tokens=room - with_image + 1))
    assert with_image == without["prompt_tokens"] + 16  # the tiny LLaVA's 16 patches, one token each
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("model_type", ["gemma3", "qwen2_5_vl"])
async def test_gemma3_and_qwen2_5_vl_take_an_image_through_the_chat_route(
    default_tokenizer, tmp_path_factory, model_type
):
    """Gemma 3's start-of-image placeholder becomes its tags around 16 image tokens; Qwen2.5-VL's processor (built
    here without torchvision) makes a 40 x 30 image 2 x 3 image tokens between its tags; the answer is the same
    again (the image from the encoder cache and the prefix cache)."""
    folder = tiny_vision_folder(model_type, default_tokenizer, tmp_path_factory.mktemp(model_type))
    server = InProcess(load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=True))
    image = image_part(data_url(encoded(picture(5), "PNG")))
    try:
        async with server.client() as client:
            answers = [
                (await client.post("/v1/chat/completions", json=chat_body(*parts, max_tokens=8, temperature=0))).json()
                for parts in ((image,), (), (image,))
            ]
    finally:
        server.close()
    with_image, without, again = answers
    added = with_image["usage"]["prompt_tokens"] - without["usage"]["prompt_tokens"]
    # Gemma 3's: 16 image tokens, its two tags and a blank line each side; Qwen2.5-VL's: 6, and its two tags.
    assert added == {"gemma3": 16 + 2 + 2, "qwen2_5_vl": 6 + 2}[model_type]
    assert again["choices"][0]["message"] == with_image["choices"][0]["message"]
    assert with_image["choices"][0]["message"] != without["choices"][0]["message"]
