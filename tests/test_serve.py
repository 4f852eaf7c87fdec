"""``uag serve`` on the embedded default pair, called as users call it: the ``openai`` client
(and raw HTTP where the client would hide what is sent). Traffic goes to 127.0.0.1 only; every
request loop is bounded in count and time.

Two live servers: the main one (with an API key, default queue) and a small one (queue of 1)
that the queue-full and SIGTERM tests may stop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

pytestmark = pytest.mark.real

KEY = "test-key-0123"
MODEL = "gemma-3-270m"
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Liste des courses : pommes, poires,",
    "import numpy as np\n\nx = np.arange(10)\n",
    "日本の首都は",
    "SELECT name, age FROM users WHERE",
    "1, 2, 3, 5, 8, 13,",
    'print("hello',
]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def _start(tmp: Path, *extra: str) -> Iterator[Server]:
    log = tmp / "serve.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uag", "serve", "--port", "0", *extra],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 240
    url = None
    while url is None:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "uag serve did not start in 240 s"
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text(errors="replace"))
        url = found.group(1) if found else None
        time.sleep(0.2)
    server = Server(proc, url, log)
    try:
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("serve"), "--api-key", KEY)


@pytest.fixture(scope="module")
def expected(real_pair) -> dict[tuple[str, bool], object]:
    """What ``uag.generate`` (the library call ``uag generate`` makes) gives for each prompt,
    raw and as a one-message chat, 24 tokens, greedy."""
    import uag

    return {
        (p, chat): uag.generate(real_pair, p, max_new_tokens=24, chat=chat)
        for p in PROMPTS[:2]
        for chat in (False, True)
    }


def _ask(client: openai.OpenAI, prompt: str, *, chat: bool, **kwargs):
    """One greedy request of 24 tokens: to the chat endpoint as one user message, or as a
    completion."""
    if chat:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs
        )
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


GREEDY = {"max_tokens": 24, "temperature": 0}


def test_greedy_completion_and_chat_equal_uag_generate(server: Server, expected) -> None:
    client = server.client()
    for (prompt, chat), want in expected.items():
        got = _ask(client, prompt, chat=chat, **GREEDY)
        text = got.choices[0].message.content if chat else got.choices[0].text
        assert text == want.text, (prompt, chat)
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == want.prompt_tokens
        assert got.choices[0].finish_reason == (
            "length" if want.stop_reason == "max_new_tokens" else "stop"
        )


def test_streams_carry_the_same_text_and_end_with_done(server: Server, expected) -> None:
    client = server.client()
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    for (prompt, chat), want in expected.items():
        chunks = list(_ask(client, prompt, chat=chat, **GREEDY, **usage))
        choices = [c.choices[0] for c in chunks if c.choices]
        pieces = [(c.delta.content or "") if chat else c.text for c in choices]
        if chat:
            assert choices[0].delta.role == "assistant"
        assert "".join(pieces) == want.text, (prompt, chat)
        finishes = [c.finish_reason for c in choices]
        assert finishes[-1] in ("length", "stop") and not any(finishes[:-1])
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    # the raw stream: server-sent events, the last one [DONE]
    raw = httpx.post(
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True},
        timeout=120,
    )
    events = [line for line in raw.text.splitlines() if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_a_stop_string_cuts_the_text_before_it(server: Server, expected) -> None:
    want = expected[PROMPTS[0], False].text
    stop = next(c for c in ("\n", ":", " ") if c in want)
    got = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop]
    )
    assert got.choices[0].text == want[: want.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want[: want.index(stop)]


def test_sampling_follows_the_seed(server: Server) -> None:
    client = server.client()
    runs = [
        client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.8, seed=7
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert runs[0] == runs[1]  # the seed fixes every draw
    defaults = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, seed=7)
    assert defaults.usage.completion_tokens >= 1


def test_concurrent_clients_get_their_own_complete_answers(server: Server) -> None:
    """8 clients x 4 requests at once with the default queue: none lost, none mixed."""
    client = server.client()
    want = {
        p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    }
    got: dict[tuple[int, int], tuple[str, str]] = {}
    errors: list[BaseException] = []

    def one_client(c: int) -> None:
        mine = server.client()
        for r in range(4):
            prompt = PROMPTS[(c + r) % len(PROMPTS)]
            try:
                out = mine.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=bool(r % 2)
                )
                text = "".join(ch.choices[0].text for ch in out) if r % 2 else out.choices[0].text
                got[c, r] = (prompt, text)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

    threads = [threading.Thread(target=one_client, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(got) == 32
    assert all(text == want[prompt] for prompt, text in got.values())


def test_a_client_that_leaves_mid_stream_leaves_the_server_serving(server: Server) -> None:
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 900, "stream": True},
        timeout=120,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk read: leave
    after = server.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0
    )
    assert after.usage.completion_tokens == 4
    metrics = httpx.get(
        server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ).text
    assert re.search(r'uag_requests_total\{endpoint="completions",outcome="ok"\} \d+', metrics)
    assert "uag_completion_tokens_total" in metrics and "uag_queue_depth" in metrics


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n=2"),
        ({"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "unrecognized request argument"),
        ({"model": MODEL, "prompt": "   "}, 400, "whitespace"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "limit"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ],
    ids=[
        "bad-json",
        "unknown-model",
        "empty-messages",
        "n2",
        "unknown-field",
        "blank",
        "budget",
        "temp",
    ],
)
def test_bad_requests_get_openai_shaped_errors(server: Server, body, status, says) -> None:
    route = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else "/v1/completions"
    )
    r = httpx.post(
        server.url + route,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        content=body if isinstance(body, bytes) else json.dumps(body).encode(),
        timeout=60,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_keys_sizes_and_context_are_checked(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"  # no key
    assert [m.id for m in server.client().models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x", max_tokens=1)
    big = httpx.post(
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": "x" * (2 << 20)},
        timeout=60,
    )
    assert big.status_code == 413 and "body" in big.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client().completions.create(
            model=MODEL, prompt="word " * 40000, max_tokens=1, temperature=0
        )
    assert "Traceback" not in server.stderr()


def test_a_full_queue_answers_429_and_sigterm_stops_within_10_s(tmp_path: Path) -> None:
    """Queue of 1: one request generating, one waiting, the third refused. Then SIGTERM in the
    middle of the stream: exit 0 within 10 s, no traceback."""
    small = _start(tmp_path, "--queue", "1")
    srv = next(small)
    try:
        long = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 900, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=long, timeout=120) as first:
            lines = first.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it is generating
            waiting = threading.Thread(
                target=lambda: httpx.post(srv.url + "/v1/completions", json=long, timeout=120)
            )
            waiting.start()
            deadline = time.monotonic() + 60
            while httpx.get(srv.url + "/health", timeout=30).json()["queue"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            third = httpx.post(
                srv.url + "/v1/completions", json={**long, "stream": False}, timeout=60
            )
            assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
            started = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            assert srv.proc.wait(timeout=10) == 0
            assert time.monotonic() - started < 10
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]", rest[-3:]  # the stream halted, and says so
            assert '"finish_reason": "stop"' in rest[-2]
            waiting.join(timeout=30)
        assert "Traceback" not in srv.stderr(), srv.stderr()
    finally:
        small.close()


def test_a_taken_port_fails_in_one_line_before_the_models_load() -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "uag", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ},
        )
    assert out.returncode == 2, out.stderr  # bad input, as every uag command exits on it
    assert out.stderr.strip().splitlines() == [
        f"uag: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
