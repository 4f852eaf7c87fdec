"""A ``llama-server`` process as a measured arm: the anchor users compare uag against.

Why a server and not the Python binding: ``llama-server`` is what llama.cpp's users run, and its
speculation (``--spec-type ngram-simple``, ``draft-simple -md``) exists only there. One process
per configuration (the speculation type is fixed at start-up), bound to 127.0.0.1 on a free
port, ``-np 1`` (one slot), the given thread count for both prompt and generation.

Each request is ``POST /completion`` with the exact prompt ids uag's target encodes,
``cache_prompt: false`` (every request evaluates its prompt, as uag's arms do), greedy
(``top_k`` 1, temperature 0) and ``return_tokens``; it is timed from sending to the last byte
of the reply (prompt evaluation included; local HTTP adds well under a millisecond). Never a
dependency: the binary is the user's (``--llama-server PATH``), built from llama.cpp's source.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from uag.errors import UagError

START_SECONDS = 180.0
"""How long a server may take to load its model before the run gives up."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` (``binary``) serving ``gguf`` with ``extra`` arguments."""

    def __init__(self, binary: Path, *, gguf: Path, threads: int, extra: list[str]) -> None:
        if not binary.is_file():
            raise UagError(f"--llama-server {binary}: no such file")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "4096", *extra,
        ]  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        except OSError as err:
            raise UagError(f"--llama-server {binary}: {err.strerror}") from None
        self._wait_ready(" ".join(extra) or "no speculation")

    def _wait_ready(self, what: str) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                assert self.proc.stderr is not None
                last = (self.proc.stderr.read().strip().splitlines() or ["no output"])[-1]
                raise UagError(f"llama-server ({what}) exited at start: {last}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.close()
        raise UagError(f"llama-server ({what}) not ready after {START_SECONDS:.0f} s")

    def run(
        self, ids: list[int], *, max_new_tokens: int, stop: list[int]
    ) -> tuple[list[int], float]:
        """Greedy ids after ``ids`` (cut before the first ``stop`` id) and the request's seconds."""
        body: dict[str, Any] = {
            "prompt": ids,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            self.url + "/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=600) as reply:
                answer = json.loads(reply.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise UagError(f"llama-server request failed: {err}") from None
        seconds = time.perf_counter() - start
        out = [int(t) for t in answer.get("tokens", [])]
        stops = set(stop)
        for i, token in enumerate(out):
            if token in stops:
                return out[:i], seconds
        return out, seconds

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
