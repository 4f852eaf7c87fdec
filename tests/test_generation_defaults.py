"""``--sample`` takes the target's own ``generation_config`` (temperature, top-k, top-p) unless a
flag overrides it, the same way in ``generate``, ``bench`` and ``collect``, and says what it used."""

from __future__ import annotations

import json
import shutil

import pytest

from uag.cli import build_parser, main, sampling_config
from uag.runtime.models import generation_defaults


def _with_generation_config(directory, tmp_path, **settings):
    """A copy of a checkpoint directory whose ``generation_config.json`` also holds ``settings``."""
    copy = tmp_path / "declared"
    shutil.copytree(directory, copy)
    path = copy / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **settings}))
    return copy


def test_declared_settings_are_read_without_loading(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9})
    )
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.7, "top_k": 5, "top_p": 0.9}
    # Transformers' "off" values and values sampling refuses are not declarations.
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_k": 0, "top_p": 1.0})
    )
    assert generation_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_defaults(str(tmp_path)) == {}
    # Gemma's GGUF lost them; its entry keeps google/gemma-3-270m's.
    assert generation_defaults("gemma-3-270m") == {"top_k": 64, "top_p": 0.95}
    # A reference that cannot load is the load's to report, not this.
    assert generation_defaults(str(tmp_path / "missing.gguf")) == {}
    assert generation_defaults(str(tmp_path / "nowhere")) == {}


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "x"],
        ["bench", "--prompts", "mixed"],
        ["collect", "--prompts", "mixed", "--out", "o"],
    ],
)
def test_flags_override_the_declared_settings_in_every_command(tmp_path, command):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.7, "top_k": 5, "top_p": 0.9})
    )
    parse = build_parser().parse_args
    base = [*command, "--target", str(tmp_path), "--sample"]
    taken = sampling_config(parse(base))
    assert taken is not None
    c = taken.config
    assert (c.temperature, c.top_k, c.top_p) == (0.7, 5, 0.9)
    assert set(taken.source.values()) == {f"{tmp_path}'s generation_config"}
    mixed = sampling_config(parse([*base, "--top-k", "7", "--temperature", "1.2"]))
    assert mixed is not None
    c = mixed.config
    assert (c.temperature, c.top_k, c.top_p) == (1.2, 7, 0.9)
    assert mixed.source["top_k"] == mixed.source["temperature"] == "given"
    line = mixed.describe()
    assert "temperature 1.2, top-k 7 (given)" in line
    assert f"top-p 0.9 ({tmp_path}'s generation_config)" in line
    off = sampling_config(parse([*base, "--top-k", "0", "--top-p", "1"]))  # "off", as in the file
    assert off is not None
    assert (off.config.top_k, off.config.top_p) == (None, 1.0)
    assert "top-k off, top-p off (given)" in off.describe()


def test_nothing_declared_means_the_built_in_defaults(tmp_path):
    args = build_parser().parse_args(["generate", "--prompt", "x", "--target", str(tmp_path)])
    assert sampling_config(args) is None  # greedy: nothing to resolve
    args.sample = True
    taken = sampling_config(args)
    assert taken is not None
    c = taken.config
    assert (c.temperature, c.top_k, c.top_p, c.seed) == (1.0, None, 1.0, None)
    assert set(taken.source.values()) == {"built-in default"}
    assert "top-k off, top-p off" in taken.describe()


def test_generate_samples_with_the_declared_settings_and_says_so(tiny_dirs, tmp_path, capsys):
    target_dir, assistant_dir = tiny_dirs
    declared = _with_generation_config(target_dir, tmp_path, top_k=3, top_p=0.5)
    argv = ["generate", "--target", str(declared), "--assistant", assistant_dir]
    argv += ["--prompt", "def f(x):", "--max-new-tokens", "6", "--sample", "--seed", "5"]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["sampling"] == {
        "temperature": 1.0,
        "top_k": 3,
        "top_p": 0.5,
        "seed": 5,
        "source": {
            "temperature": "built-in default",
            "top_k": f"{declared}'s generation_config",
            "top_p": f"{declared}'s generation_config",
        },
    }
    assert main([*argv, "--top-p", "1"]) == 0  # the stats line says it too
    stats = capsys.readouterr().out.strip().splitlines()[-1]
    assert "sampling: temperature 1 (built-in default); top-k 3" in stats
    assert "top-p off (given); seed 5" in stats
