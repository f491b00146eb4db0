"""Back-pressure, keep-alive, resumable streams and explicit cancel against a real server."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from app.sse_reader import Event, parse_events, read_events

pytestmark = pytest.mark.slow


def completion(prompt="Once upon a time", max_tokens=60, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}


def texts(events: list[Event]) -> str:
    return "".join(c["text"] for e in events if e.data.startswith("{") for c in e.json().get("choices", []))


def health(base) -> dict:
    return httpx.get(f"{base}/health", timeout=5).json()


def wait_until(predicate, timeout=90.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(interval)


def whole_text(base, **body) -> str:
    body = {**completion(**body), "stream": False}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


async def test_a_stalled_reader_is_paused_and_others_keep_their_pace(flow_server):
    # The client's receive window is the one it advertised at connect (~64 KiB: httpx sets SO_RCVBUF only
    # after connecting), so the stream must outgrow it for certain: top-5 logprobs make each token's
    # event ~450 bytes, and 300 tokens are ~135 KB, where the pause comes after ~50 KB.
    expected = whole_text(flow_server, max_tokens=300, ignore_eos=True)
    body = completion(max_tokens=300, ignore_eos=True, logprobs=5)
    small_window = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    async with httpx.AsyncClient(transport=small_window, timeout=180) as slow:
        async with slow.stream("POST", f"{flow_server}/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            received = [await anext(lines)]
            # Stop reading: the socket fills, then the stream's unread bound, then the engine pauses it.
            await asyncio.to_thread(wait_until, lambda: health(flow_server)["num_paused"] == 1)
            used = health(flow_server)["kv_blocks_used"]
            start = time.monotonic()
            async with httpx.AsyncClient(timeout=60) as fast:
                other = await fast.post(
                    f"{flow_server}/v1/completions", json={**body, "max_tokens": 20, "stream": False}
                )
            other_seconds = time.monotonic() - start
            after = health(flow_server)
            received += [line async for line in lines]
    assert other.json()["usage"]["completion_tokens"] == 20 and other_seconds < 20
    assert after["num_paused"] == 1 and after["kv_blocks_used"] == used, "the stalled stream kept generating"
    events = parse_events(received)
    assert events[-1].data == "[DONE]"
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)]
    assert texts(events) == expected
    wait_until(lambda: health(flow_server)["kv_blocks_used"] == 0)


def dechunk(raw: bytes) -> tuple[bytes, list[bytes]]:
    """A chunked HTTP response's head and its body's chunks, framing checked strictly; the body must end
    with the zero-length chunk."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    chunks = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            return head, chunks
        assert rest[size : size + 2] == b"\r\n", "a chunk's length does not match its body"
        chunks.append(rest[:size])
        rest = rest[size + 2 :]


def test_a_stalled_reader_of_plain_text_is_paused_and_gets_every_event_in_order(flow_server):
    # Plain text deltas go from the engine's callback straight to the socket while it takes them
    # (PlainStream): once the client stops reading they must fall back to `send` and its wait, so the
    # stream's unread bound pauses the request as it does for any other stream. A raw socket, its
    # receive buffer set before connecting, stalls within kilobytes.
    expected = whole_text(flow_server, max_tokens=300, ignore_eos=True)
    body = json.dumps(completion(max_tokens=300, ignore_eos=True)).encode()
    url = httpx.URL(flow_server)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(120)
        sock.connect((url.host, url.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: sluice\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(body), body)
        )
        raw = sock.recv(1024)
        wait_until(lambda: health(flow_server)["num_paused"] == 1)
        used = health(flow_server)["kv_blocks_used"]
        time.sleep(1.0)
        assert health(flow_server)["kv_blocks_used"] == used, "the stalled stream kept generating"
        while part := sock.recv(65536):
            raw += part
    head, chunks = dechunk(raw)
    assert head.startswith(b"HTTP/1.1 200")
    events = parse_events(b"".join(chunks).decode().split("\n"))
    assert events[-1].data == "[DONE]"
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)]
    assert texts(events) == expected
    wait_until(lambda: health(flow_server)["kv_blocks_used"] == 0)


def test_keepalive_comments_flow_while_the_prompt_prefills(flow_server):
    # About 900 prompt tokens take seconds to prefill in float32 on CPU; pings come every 0.3 s.
    body = completion(prompt="The quick brown fox jumps over the lazy dog. " * 90, max_tokens=2)
    comments_before_text, seen_text = 0, False
    with httpx.stream("POST", f"{flow_server}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith(":") and not seen_text:
                comments_before_text += 1
            seen_text |= line.startswith("data: {")
    assert comments_before_text >= 2


def read_until(response: httpx.Response, last_id: int) -> list[str]:
    """Lines up to and including event `last_id`, then stop reading (the caller drops the connection)."""
    lines = []
    for line in response.iter_lines():
        lines.append(line)
        if line == "" and f"id: {last_id}" in lines[-4:]:
            return lines
    raise AssertionError(f"the stream ended before event {last_id}")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_a_resumed_stream_has_no_gap_and_no_duplicate(flow_server, sampling):
    body = {**completion(max_tokens=50), **sampling, "resumable": True}
    expected = whole_text(flow_server, **{**body, "resumable": False})
    with httpx.stream("POST", f"{flow_server}/v1/completions", json=body, timeout=60) as response:
        first = parse_events(read_until(response, 8))
    completion_id = first[0].json()["id"]
    time.sleep(1.0)  # generation goes on while nobody listens
    with httpx.stream(
        "GET", f"{flow_server}/v1/streams/{completion_id}", headers={"Last-Event-ID": "8"}, timeout=60
    ) as response:
        assert response.status_code == 200
        rest = read_events(response)
    ids = [int(e.id) for e in first + rest]
    assert ids == list(range(1, len(ids) + 1))
    assert rest[-1].data == "[DONE]"
    assert texts(first + rest) == expected


def test_a_finished_stream_is_kept_for_the_window_after_its_last_reader(flow_server):
    """Events written are not events received: a client whose connection broke after the server
    wrote [DONE] comes back for the tail and gets it, as often as it asks, until the window passes."""
    body = completion(max_tokens=20, resumable=True)
    with httpx.stream("POST", f"{flow_server}/v1/completions", json=body, timeout=60) as response:
        everything = read_events(response)
    assert everything[-1].data == "[DONE]"
    url = f"{flow_server}/v1/streams/{everything[0].json()['id']}"
    for _ in range(2):
        with httpx.stream("GET", url, headers={"Last-Event-ID": "3"}, timeout=60) as response:
            assert response.status_code == 200
            assert read_events(response) == everything[3:]
    # --resume-window-seconds 3, counted from when its last reader left (every GET is a reader).
    time.sleep(4)
    assert httpx.get(url, headers={"Last-Event-ID": "3"}).status_code == 404


def test_delete_forgets_a_finished_stream_kept_for_resuming(flow_server):
    body = completion(max_tokens=5, resumable=True)
    with httpx.stream("POST", f"{flow_server}/v1/completions", json=body, timeout=60) as response:
        completion_id = read_events(response)[0].json()["id"]
    url = f"{flow_server}/v1/streams/{completion_id}"
    assert httpx.get(url, headers={"Last-Event-ID": "1"}).status_code == 200
    assert httpx.delete(url).status_code == 200
    response = httpx.get(url, headers={"Last-Event-ID": "1"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "stream_not_found"
    assert httpx.delete(url).status_code == 404


def test_nobody_back_within_the_window_cancels_and_frees(flow_server):
    body = completion(max_tokens=2000, ignore_eos=True, resumable=True)
    with httpx.stream("POST", f"{flow_server}/v1/completions", json=body, timeout=60) as response:
        completion_id = parse_events(read_until(response, 3))[0].json()["id"]
    assert health(flow_server)["num_running"] == 1
    wait_until(lambda: health(flow_server)["num_running"] == 0, timeout=15)
    assert health(flow_server)["kv_blocks_used"] == 0
    response = httpx.get(f"{flow_server}/v1/streams/{completion_id}", headers={"Last-Event-ID": "3"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "stream_not_found"


def test_bad_last_event_id_is_a_400(flow_server):
    body = completion(max_tokens=2000, ignore_eos=True, resumable=True)
    with httpx.stream("POST", f"{flow_server}/v1/completions", json=body, timeout=60) as response:
        completion_id = parse_events(read_until(response, 2))[0].json()["id"]
    try:
        for bad in ("x", "-1", "100000"):
            got = httpx.get(f"{flow_server}/v1/streams/{completion_id}", headers={"Last-Event-ID": bad})
            assert got.status_code == 400 and got.json()["error"]["param"] == "Last-Event-ID"
    finally:
        assert httpx.delete(f"{flow_server}/v1/streams/{completion_id}").status_code == 200
    wait_until(lambda: health(flow_server)["kv_blocks_used"] == 0, timeout=15)


@pytest.mark.parametrize("resumable", [False, True])
def test_delete_cancels_a_stream_from_another_client(flow_server, resumable):
    body = completion(max_tokens=2000, ignore_eos=True, resumable=resumable)
    with httpx.stream("POST", f"{flow_server}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        # Up to the first event's end: a keep-alive comment may come before it on a slow first token.
        head = [next(lines)]
        while not (head[-1] == "" and any(line.startswith("data:") for line in head)):
            head.append(next(lines))
        completion_id = parse_events(head)[0].json()["id"]
        deleted = httpx.delete(f"{flow_server}/v1/streams/{completion_id}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        events = parse_events([*head, *lines])
    assert events[-1].data == "[DONE]"
    assert events[-2].json()["error"]["code"] == "cancelled"
    wait_until(lambda: health(flow_server)["kv_blocks_used"] == 0, timeout=15)
    if resumable:
        # Finished now, and kept for resuming: a second DELETE forgets it.
        assert httpx.delete(f"{flow_server}/v1/streams/{completion_id}").status_code == 200
    assert httpx.delete(f"{flow_server}/v1/streams/{completion_id}").status_code == 404
