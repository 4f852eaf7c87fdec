"""Bad input, exhaustively: every command, and each of its path-, number- and enum-typed flags
given a missing, wrong-type or out-of-range value, plus prompt text that cannot be generated
from, ends in one clean line on stderr and exit code 2: never "internal error", never a
traceback.

The table runs in-process (``uag.cli.main``); the commands that load models get the tiny
checkpoints of ``tiny_dirs``, and almost every case fails before any model loads.
"""

from __future__ import annotations

import shutil

import pytest

from uag.cli import COMMANDS, main

TINY = ["--target", "{target}", "--assistant", "{assistant}"]
BASE = {
    "generate": ["generate", *TINY, "--prompt", "x"],
    "collect": ["collect", *TINY, "--prompts", "mixed", "--limit", "1", "--out", "{out}/c"],
    "bench": ["bench", *TINY, "--prompts", "mixed", "--limit", "1", "--out", "{out}/b"],
    "calibrate": ["calibrate", *TINY, "--prompts", "mixed", "--limit", "1"],
    "train-controller": [
        "train-controller",
        "--data",
        "{dir}",
        "--out",
        "{out}/c.onnx",
        "--logdir",
        "{out}/tb",
    ],
    "models": ["models"],
    "serve": ["serve", *TINY, "--port", "0"],
}
"""Each command with what it needs to run; a case appends flags (argparse keeps the last)."""

MODEL_FLAGS = [
    (["--target"], "expected one argument"),
    (["--target", "{missing}.gguf"], "GGUF file not found"),
    (["--target", "{fake_gguf}"], "is not a GGUF file"),
    (["--target", "no-such-model"], "unknown model reference"),
    (["--target", "{text}"], "unknown model reference"),
    (["--target", "{dir}"], "not a model checkpoint directory"),
    (["--target", "{broken_checkpoint}"], "cannot load model"),
    (["--assistant", "{missing}.gguf"], "GGUF file not found"),
    (["--assistant", "{fake_gguf}"], "is not a GGUF file"),
    (["--device"], "expected one argument"),
    (["--device", "tpu"], "unknown device"),
    (["--device", "cuda:x"], "unknown device"),
    (["--device", "7"], "unknown device"),
    (["--dtype", "float64"], "unknown dtype"),
    (["--dtype", ""], "unknown dtype"),
    (["--kernels", "fast"], "invalid choice: 'fast'"),
    (["--draft-vocab", "many"], "invalid int value"),
    (["--draft-vocab", "-5"], "--draft-vocab must be 0"),
    (["--draft-vocab"], "expected one argument"),
]
"""The model flags every model command shares (``cli._add_model_args``)."""

SAMPLING_FLAGS = [
    (["--temperature", "0.7"], "only apply with --sample"),
    (["--sample", "--temperature", "0"], "temperature must be > 0"),
    (["--sample", "--temperature", "-1"], "temperature must be > 0"),
    (["--sample", "--temperature", "nan"], "must be a finite number"),
    (["--sample", "--temperature", "inf"], "must be a finite number"),
    (["--sample", "--temperature", "warm"], "must be a number"),
    (["--sample", "--top-p", "0"], "top-p must be in (0, 1]"),
    (["--sample", "--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--sample", "--top-p", "nan"], "must be a finite number"),
    (["--sample", "--top-k", "-2"], "--top-k must be at least 0"),
    (["--sample", "--top-k", "1.5"], "--top-k must be an integer"),
    (["--sample", "--seed", "1.5"], "--seed must be an integer"),
    (["--sample", "--seed", "-1"], "--seed must be at least 0"),
    (["--sample", "--seed", str(2**64)], "--seed must be at most"),
    (["--sample", "--seed"], "expected one argument"),
]
"""``--sample`` and its settings (generate, bench, collect)."""

PROMPT_SET_FLAGS = [
    (["--prompts", "{missing}.jsonl"], "prompt file not found"),
    (["--prompts", "{text}"], "unsupported prompt file type"),
    (["--prompts", "{dir}"], "unsupported prompt file type"),
    (["--prompts"], "expected one argument"),
    (["--limit", "0"], "--limit"),
    (["--limit", "some"], "--limit"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--max-new-tokens", "many"], "--max-new-tokens"),
]
"""The prompt-set flags (collect, bench; calibrate has all but --text-column)."""

CASES: list[tuple[str, list[str], str]] = [
    *(
        (cmd, flags, msg)
        for cmd in ("generate", "collect", "bench", "calibrate")
        for flags, msg in MODEL_FLAGS
    ),
    *(
        (cmd, flags, msg)
        for cmd in ("generate", "collect", "bench")
        for flags, msg in SAMPLING_FLAGS
    ),
    *(
        (cmd, flags, msg)
        for cmd in ("collect", "bench", "calibrate")
        for flags, msg in PROMPT_SET_FLAGS
    ),
    # generate
    ("generate", ["--prompt-file", "{missing}"], "prompt file not found"),
    ("generate", ["--prompt-file", "{dir}"], "prompt file not found"),
    ("generate", ["--prompt-file", "{latin1}"], "is not UTF-8 text (byte 0xe9 at offset 3)"),
    ("generate", ["--prompt-file", "{blank}"], "prompt file is empty"),
    ("generate", ["--prompt-file"], "expected one argument"),
    ("generate", ["--prompt", "y"], "batch size 1"),
    ("generate", ["--max-new-tokens", "0"], "--max-new-tokens"),
    ("generate", ["--max-new-tokens", "ten"], "--max-new-tokens"),
    ("generate", ["--max-new-tokens", "100000000"], "the target's context of 4096 tokens"),
    ("generate", ["--policy", "greedy"], "unknown policy 'greedy'"),
    ("generate", ["--policy", "static-0"], "whole number K >= 1"),
    ("generate", ["--policy", "confidence-2"], "probability in (0, 1]"),
    ("generate", ["--policy", "learned:{text}"], "a controller is a .onnx file"),
    ("generate", ["--controller", "{missing}.onnx"], "controller not found"),
    ("generate", ["--controller", "{dir}"], "controller not found"),
    ("generate", ["--controller", "{fake_onnx}"], "not a valid ONNX model"),
    ("generate", ["--lookahead", "0"], "--lookahead"),
    ("generate", ["--lookahead", "two"], "--lookahead"),
    ("generate", ["--policy", "confidence", "--threshold", "abc"], "--threshold must be a number"),
    ("generate", ["--policy", "confidence", "--threshold", "nan"], "must be a finite number"),
    ("generate", ["--policy", "confidence", "--threshold", "-1"], "probability in (0, 1]"),
    ("generate", ["--policy", "entropy", "--threshold", "0"], "nats > 0"),
    ("generate", ["--policy", "entropy", "--threshold", "inf"], "must be a finite number"),
    ("generate", ["--sample", "--compare-target-only"], "token identity"),
    # collect
    ("collect", ["--prompts", "{jsonl}", "--text-column", "prompt"], "has no column 'prompt'"),
    ("collect", ["--max-lookahead", "0"], "--max-lookahead must be at least 1"),
    ("collect", ["--max-lookahead", "six"], "--max-lookahead must be an integer"),
    ("collect", ["--out", "{text}"], "is a file, not a directory"),
    ("collect", ["--out", "{text}/c"], "cannot be created"),
    ("collect", ["--logdir", "{text}"], "is a file, not a directory"),
    ("collect", ["--shard", "a/b"], "--shard must look like i/n"),
    ("collect", ["--shard", "3/2"], "--shard must be i/n"),
    ("collect", ["--shard", "0/0"], "--shard must be i/n"),
    ("collect", ["--controller", "{missing}.onnx"], "controller not found"),
    ("collect", ["--explore", "0.3"], "goes with --controller"),
    ("collect", ["--explore", "2"], "--explore must be a probability"),
    ("collect", ["--explore", "nan"], "must be a finite number"),
    ("collect", ["--resume", "--overwrite"], "not allowed with"),
    ("collect", ["--prompts", "report"], "never runs on the held-out report set"),
    ("collect", ["--prompts", "mixed+report:test", "--plan"], "never runs on the held-out report"),
    # bench
    ("bench", ["--prompts", "{jsonl}", "--text-column", "prompt"], "has no column 'prompt'"),
    ("bench", ["--repeats", "0"], "--repeats"),
    ("bench", ["--repeats", "twice"], "--repeats"),
    ("bench", ["--out", "{text}"], "is a file, not a directory"),
    ("bench", ["--policies", "greedy"], "unknown policy 'greedy'"),
    ("bench", ["--policies", ","], "--policies is empty"),
    ("bench", ["--policies", "learned", "--controller", "{missing}.onnx"], "controller not found"),
    ("bench", ["--sample", "--policies", "static-2,oracle"], "leave it out with --sample"),
    # train-controller
    ("train-controller", ["--data", "{missing}"], "is not a directory"),
    ("train-controller", ["--data", "{text}"], "is not a directory"),
    ("train-controller", ["--data", "{dir}"], "holds no meta.json"),
    ("train-controller", ["--data"], "expected at least one argument"),
    ("train-controller", ["--out", "{dir}"], "is a directory, not a file"),
    ("train-controller", ["--logdir", "{text}"], "is a file, not a directory"),
    ("train-controller", ["--max-epochs", "0"], "--max-epochs"),
    ("train-controller", ["--max-epochs", "many"], "--max-epochs"),
    ("train-controller", ["--hidden", "0,3"], "widths must be positive"),
    ("train-controller", ["--hidden", "a,b"], "expected widths like 32,32"),
    ("train-controller", ["--seed", "-1"], "--seed must be at least 0"),
    ("train-controller", ["--seed", "x"], "--seed must be an integer"),
    ("train-controller", ["--report-fraction", "1.5"], "--report-fraction must be in [0, 1)"),
    ("train-controller", ["--report-fraction", "nan"], "must be a finite number"),
    ("train-controller", ["--batch-size", "0"], "--batch-size"),
    ("train-controller", ["--lr", "0"], "--lr must be a positive number"),
    ("train-controller", ["--lr=-1e-3"], "--lr must be a positive number"),
    ("train-controller", ["--lr", "inf"], "must be a finite number"),
    ("train-controller", ["--num-nodes", "0"], "--num-nodes"),
    ("train-controller", ["--decision", "vote"], "invalid choice: 'vote'"),
    ("train-controller", ["--accelerator", "quantum"], "Lightning refuses --accelerator quantum"),
    ("train-controller", ["--devices", "many"], "Lightning refuses"),
    ("train-controller", ["--strategy", "nope"], "Lightning refuses"),
    # serve: flags, then the models (after the port is taken, before any request)
    ("serve", ["--port", "70000"], "--port must be at most 65535"),
    ("serve", ["--port", "http"], "--port must be an integer"),
    ("serve", ["--queue", "0"], "--queue"),
    ("serve", ["--max-tokens", "-3"], "--max-tokens"),
    ("serve", ["--policy", "sometimes"], "unknown policy"),
    ("serve", ["--target", "{missing}.gguf"], "GGUF file not found"),
    ("serve", ["--assistant", "no-such-model"], "unknown model reference"),
    # models
    ("models", ["prepare", "{missing}.gguf"], "GGUF file not found"),
    ("models", ["prepare", "{fake_gguf}"], "is not a GGUF file"),
    ("models", ["prepare", "{dir}"], "cannot prepare"),
    ("models", ["prepare", "not-a-model"], "cannot prepare"),
    ("models", ["prepare"], "the following arguments are required: names"),
    ("models", ["prepare", "gemma-3-270m", "--as", "boss"], "invalid choice: 'boss'"),
    ("models", ["bogus"], "invalid choice: 'bogus'"),
]

PROMPTS: list[tuple[list[str], str]] = [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", " \n\t "], "prompt is only whitespace"),
    (["--chat", "--prompt", "   "], "prompt is only whitespace"),
    (["--prompt", "\ud800"], "lone surrogate"),
    (["--prompt", "caf\udce9 au lait"], "lone surrogate"),  # b"caf\xe9" from a shell
    (["--prompt", "a " * 5000], "the target's context of 4096 tokens"),
    (["--chat", "--prompt", "hi", "--target", "{empty_chat}"], "empty after the target's chat"),
    (["--chat", "--prompt", "hi", "--target", "{broken_chat}"], "chat template fails"),
]
"""Prompt text that cannot be generated from (``uag generate``)."""


@pytest.fixture(scope="module")
def places(tmp_path_factory, tiny_dirs):
    """What the ``{name}`` fields of a case stand for: files and directories of each kind."""
    root = tmp_path_factory.mktemp("bad-input")
    target, assistant = tiny_dirs
    (root / "notes.txt").write_text("hello\n")
    (root / "empty-dir").mkdir()
    (root / "fake.gguf").write_text("not a model\n")
    (root / "fake.onnx").write_text("not a controller\n")
    (root / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    (root / "blank.txt").write_text("  \n")
    (root / "prompts.jsonl").write_text('{"text": "def f(x):"}\n')
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    templates = {"empty_chat": "{{ '' }}", "broken_chat": "{% if %}"}
    for name, template in templates.items():
        shutil.copytree(target, root / name)
        (root / name / "chat_template.jinja").write_text(template)
    return {
        "target": target,
        "assistant": assistant,
        "missing": str(root / "missing"),
        "text": str(root / "notes.txt"),
        "dir": str(root / "empty-dir"),
        "fake_gguf": str(root / "fake.gguf"),
        "fake_onnx": str(root / "fake.onnx"),
        "latin1": str(root / "latin1.txt"),
        "blank": str(root / "blank.txt"),
        "jsonl": str(root / "prompts.jsonl"),
        "broken_checkpoint": str(root / "broken"),
        **{name: str(root / name) for name in templates},
    }


def _fails_cleanly(argv: list[str], capsys) -> str:
    """Run ``uag argv`` in-process; assert exit 2 and one clean stderr line; return that line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, (code, captured.err[-2000:])
    assert len(lines) == 1, captured.err[-2000:]
    assert "Traceback" not in captured.err and "internal error" not in captured.err, lines[0]
    return lines[0]


def test_the_table_covers_every_command():
    assert {cmd for cmd, _, _ in CASES} == set(COMMANDS)


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    CASES,
    ids=[f"{cmd} {' '.join(flags)}" for cmd, flags, _ in CASES],
)
def test_bad_flag_values(places, tmp_path, capsys, command, flags, message):
    base = BASE[command][:-2] if "--prompt-file" in flags else BASE[command]  # one or the other
    argv = [part.format(**places, out=tmp_path) for part in [*base, *flags]]
    assert message in _fails_cleanly(argv, capsys)


@pytest.mark.parametrize(("flags", "message"), PROMPTS, ids=[m for _, m in PROMPTS])
def test_bad_prompt_text(places, capsys, flags, message):
    argv = [part.format(**places) for part in [*BASE["generate"][:-2], *flags]]
    assert message in _fails_cleanly(argv, capsys)


def test_control_characters_are_text_not_bad_input(places, capsys):
    """A prompt may hold any control character (code holds tabs, logs hold escapes): it
    generates, as Transformers would, with nothing on stderr."""
    prompt = "\x00\x01\x07 col1\tcol2\r\n\x1b[31mred\x1b[0m \x7f\x9f end"
    argv = [part.format(**places) for part in [*BASE["generate"][:-2], "--prompt", prompt]]
    assert main([*argv, "--max-new-tokens", "3", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert '"new_tokens"' in captured.out
