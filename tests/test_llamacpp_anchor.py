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
