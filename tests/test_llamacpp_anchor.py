"""``uag.harness.llamacpp``: its rate ratios and its refusal without llama-cpp-python (the
comparison itself needs llama-cpp-python, which uag does not depend on)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.tiny import one_clean_line
from uag.harness import llamacpp


def test_rate_ratio_and_its_interval():
    fast = llamacpp.ArmTotals(tokens=[100, 50, 80], seconds=[1.0, 0.5, 0.8])
    slow = llamacpp.ArmTotals(tokens=[100, 50, 80], seconds=[2.0, 1.0, 1.6])
    assert fast.rate() / slow.rate() == pytest.approx(2.0)
    low, high = llamacpp.rate_interval(fast, slow)
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)  # every prompt agrees
    mixed = llamacpp.ArmTotals(tokens=[100, 50, 80], seconds=[1.0, 1.0, 0.4])
    low, high = llamacpp.rate_interval(mixed, slow)
    assert low < mixed.rate() / slow.rate() < high


@pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is not None, reason="this interpreter has llama_cpp"
)
def test_an_interpreter_without_llama_cpp_is_one_clean_line(capsys):
    code = llamacpp.main(["--llama-python", sys.executable, "--limit", "1"])
    err = one_clean_line(capsys)
    assert code == 2 and err.startswith("llamacpp: the llama.cpp worker exited:"), err
    assert "llama_cpp" in err


def test_a_missing_interpreter_is_one_clean_line(capsys, tmp_path):
    code = llamacpp.main(["--llama-python", str(tmp_path / "no-python"), "--limit", "1"])
    err = one_clean_line(capsys)
    assert code == 2 and "--llama-python" in err, err


FAKE_SERVER = '''#!{python}
"""Speaks llama-server's /health and /completion: the reply's tokens are the prompt's reversed."""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
if "--fail" in args:
    sys.exit("error: unknown argument: --fail")
port = int(args[args.index("--port") + 1])
assert args[args.index("--host") + 1] == "127.0.0.1" and "--threads" not in args


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["cache_prompt"] is False and body["top_k"] == 1 and body["return_tokens"]
        self._send({{"tokens": body["prompt"][::-1][: body["n_predict"]]}})


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def _fake_server(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(FAKE_SERVER.format(python=sys.executable))
    path.chmod(0o755)
    return path


def test_a_llama_server_answers_greedy_ids_cut_before_a_stop_id(tmp_path):
    """The client sends the prompt ids uncached and greedy, and cuts the reply before the
    first stop id (llama-server may return the end-of-generation token itself)."""
    from uag.harness.llama_server import LlamaServer

    server = LlamaServer(_fake_server(tmp_path), gguf=tmp_path / "m.gguf", threads=2, extra=[])
    try:
        ids, seconds = server.run([1, 2, 9, 3, 4], max_new_tokens=4, stop=[9])
        assert ids == [4, 3] and seconds > 0
        ids, _ = server.run([5, 6, 7], max_new_tokens=2, stop=[9])
        assert ids == [7, 6]
    finally:
        server.close()
    assert server.proc.poll() is not None


def test_a_llama_server_that_fails_at_start_is_one_clean_line(tmp_path, capsys):
    fake = _fake_server(tmp_path)
    code = llamacpp.main(["--llama-server", str(fake), "--llama-draft=--fail", "--limit", "1"])
    err = one_clean_line(capsys)
    assert code == 2 and "exited at start" in err, err
    code = llamacpp.main(["--llama-server", str(tmp_path / "none"), "--limit", "1"])
    err = one_clean_line(capsys)
    assert code == 2 and "no such file" in err, err
