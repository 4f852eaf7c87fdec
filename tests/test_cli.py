"""The command line: every command listed, bad input is one clean line and a non-zero exit."""

from __future__ import annotations

import json

import pytest

from tests.tiny import one_clean_line
from uag.cli import COMMANDS, build_parser, main
from uag.kernels import native


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_generate_help_explains_flags(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--target",
        "--assistant",
        "--prompt-file",
        "--chat",
        "--max-new-tokens",
        "--policy",
        "--lookahead",
        "--threshold",
        "--compare-target-only",
        "--json",
        "--assistant-int8",
        "--kernels",
        "--sample",
        "--temperature",
        "--top-p",
        "--top-k",
        "--seed",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--target", "no-such-model", "--prompt", "x"], "unknown model reference"),
        (["generate", "--assistant", "/nowhere/m.gguf", "--prompt", "x"], "GGUF file not found"),
        (["generate", "--prompt-file", "/no/such/file.txt"], "prompt file not found"),
        (["generate", "--prompt", "a", "--prompt", "b"], "batch size 1"),
        (["generate", "--prompt", "x", "--device", "tpu"], "unknown device"),
        (["models", "prepare", "not-a-model"], "cannot prepare"),
        (
            ["generate", "--prompt", "x", "--sample", "--temperature", "0"],
            "temperature must be > 0",
        ),
        (["generate", "--prompt", "x", "--sample", "--temperature", "-1"], "temperature must be"),
        (["generate", "--prompt", "x", "--sample", "--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["generate", "--prompt", "x", "--sample", "--top-p", "0"], "top-p must be in (0, 1]"),
        (["generate", "--prompt", "x", "--temperature", "0.7"], "only apply with --sample"),
        (["generate", "--prompt", "x", "--sample", "--compare-target-only"], "token identity"),
        (["bench", "--prompts", "mixed", "--seed", "3"], "only apply with --sample"),
        (
            ["bench", "--prompts", "mixed", "--sample", "--policies", "static-2,oracle"],
            "leave it out with --sample",
        ),
        (["bench", "--prompts", "mixed", "--policies", "confidence-1.2.3"], "takes a number T"),
        (["bench", "--prompts", "mixed", "--policies", "static-2,static-2"], "listed twice"),
        (["bench", "--prompts", "mixed", "--policies", "entropy,entropy-1.5"], "listed twice"),
        (["bench", "--prompts", "mixed", "--policies", "static-0"], "whole number K >= 1"),
        (["bench", "--prompts", "mixed", "--policies", "greedy"], "unknown policy 'greedy'"),
        (["generate", "--prompt", "x", "--policy", "confidence-1.2.3"], "takes a number T"),
        (["generate", "--prompt", "x", "--policy", "confidence-2"], "probability in (0, 1]"),
        (["generate", "--prompt", "x", "--policy", "oracle"], "an arm of uag bench"),
        (
            ["generate", "--prompt", "x", "--policy", "static-4", "--lookahead", "2"],
            "lookahead is given twice",
        ),
        (
            ["generate", "--prompt", "x", "--policy", "static", "--threshold", "0.3"],
            "does not apply to the static policy",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, argv, message):
    assert main(argv) == 2
    assert message in one_clean_line(capsys)


def test_a_controller_brings_the_settings_it_was_trained_with():
    """`uag generate --controller exports/ctrl.onnx` alone runs the pair and assistant
    precision the controller was trained for (said on stderr where not the defaults); flags
    given still win."""
    from pathlib import Path

    from controllers.learned_plan import LearnedPlan
    from uag.cli import build_parser, settle_model_args

    shipped = LearnedPlan(Path("exports/ctrl.onnx"))
    assert shipped.info.assistant_int8 is True
    parser = build_parser()
    argv = ["generate", "--prompt", "x", "--controller", "exports/ctrl.onnx", "--device", "cpu"]
    args = parser.parse_args(argv)
    # What it was trained with is the default on CPU: adopted, nothing to say (a controller
    # trained otherwise is said: tests/test_fast_defaults.py).
    assert settle_model_args(args, shipped) is None
    assert (args.target, args.assistant, args.assistant_int8) == (
        shipped.info.target,
        shipped.info.assistant,
        True,
    )
    args = parser.parse_args(["generate", "--prompt", "x", "--no-assistant-int8"])
    assert settle_model_args(args, shipped) is None  # nothing adopted, nothing to say
    assert args.assistant_int8 is False
    args = parser.parse_args(["generate", "--prompt", "x", "--device", "cpu"])
    assert settle_model_args(args) is None  # no controller: the defaults
    assert args.assistant_int8 is True and args.target == "gemma-3-270m"


def test_seed_must_be_an_integer(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--sample", "--seed", "1.5"])
    assert exc.value.code == 2
    assert "--seed must be an integer" in one_clean_line(capsys)


@pytest.mark.slow  # 10 s; seeded sampling is reproducible in tests/test_sampling.py
def test_seeded_sampling_is_reproducible_from_the_cli(tiny_dirs, capsys):
    target_dir, assistant_dir = tiny_dirs
    argv = ["generate", "--target", str(target_dir), "--assistant", str(assistant_dir)]
    argv += ["--prompt", "def f(x):", "--max-new-tokens", "12", "--json", "--sample"]
    outs = []
    for seed in ("3", "3", "4"):
        assert main([*argv, "--seed", seed, "--temperature", "1.3", "--top-k", "50"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"])
    assert outs[0] == outs[1] != outs[2]


def test_unknown_kernels_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--kernels", "fast"])
    assert exc.value.code == 2
    assert "invalid choice: 'fast'" in one_clean_line(capsys)


def test_empty_prompt_file(tmp_path, capsys):
    empty = tmp_path / "p.txt"
    empty.write_text("  \n")
    assert main(["generate", "--prompt-file", str(empty)]) == 2
    assert "empty" in one_clean_line(capsys)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_non_positive_max_new_tokens(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--max-new-tokens", value])
    assert exc.value.code == 2
    assert "--max-new-tokens" in one_clean_line(capsys)


def test_models_list(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-270m" in out and "smollm2-135m" in out


@pytest.mark.parametrize(
    "first", ["controllers", "controllers.learned", "training.train", "uag.decoding.features"]
)
def test_packages_import_in_any_order(first):
    import subprocess
    import sys

    code = f"import {first}; import uag; import controllers; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1000:]


def test_bench_success_path_from_the_cli(tiny_dirs, tmp_path, capsys):
    target_dir, assistant_dir = tiny_dirs
    out = tmp_path / "bench"
    argv = ["bench", "--target", str(target_dir), "--assistant", str(assistant_dir)]
    argv += ["--prompts", "mixed", "--limit", "2", "--max-new-tokens", "6", "--repeats", "2"]
    argv += ["--draft-vocab", "100"]  # rounded up to 128, and said so in the report
    assert main([*argv, "--policies", "target-only,static-2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["draft_vocab"] == 100
    assert results["config"]["draft_vocab_used"] == 128
    rows = {r["name"]: r for r in results["policies"]}
    assert set(rows) == {"target-only", "static-2"}
    assert rows["static-2"]["identical"] is True
    low, high = rows["static-2"]["speedup_interval_95"]
    assert low <= rows["static-2"]["speedup_vs_target"] <= high
    assert "95 % interval" in (out / "results.md").read_text()
    assert "drafts from the first 128 ids" in (out / "results.md").read_text()
    assert "replay predicts: add the `oracle` arm" in (out / "results.md").read_text()


def test_models_prepare_success_path(capsys):
    assert main(["models", "prepare", "gemma-3-270m"]) == 0  # converted once per cache: quick
    out = capsys.readouterr().out
    assert "gemma-3-270m: converted at" in out
    if native.native_unavailable() is None:  # and built for what later starts memory-map
        assert "gemma-3-270m: prepared as target" in out
        assert main(["models"]) == 0
        listed = capsys.readouterr().out
        assert "converted, prepared as target" in listed


def test_a_wheel_install_finds_the_shipped_controller_and_prompts(tmp_path):
    """A non-editable install (the wheel, installed elsewhere, run from another directory) holds
    copies of ``exports/ctrl.onnx`` and ``data/prompts``: the default controller and
    ``--prompts mixed`` work without the checkout."""
    import subprocess
    import sys

    from tests.wheel import install_wheel_elsewhere

    site = install_wheel_elsewhere(tmp_path)
    probe = (
        "import uag, uag.cli, uag.harness.prompts\n"
        "from controllers.learned_plan import LearnedPlan\n"
        "print(uag.__file__)\n"
        "print(uag.cli.SHIPPED_CONTROLLER.is_symlink(), LearnedPlan(uag.cli.SHIPPED_CONTROLLER).info.target)\n"
        "print(uag.cli.SHIPPED_SAMPLING_CONTROLLER.is_symlink(), LearnedPlan(uag.cli.SHIPPED_SAMPLING_CONTROLLER).info.decoding)\n"
        "print(len(uag.harness.prompts.load_prompts('mixed:test')))\n"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    where, controller, sampling, count = ran.stdout.splitlines()
    assert where.startswith(str(site))  # the installed copy, not the checkout
    assert controller == "False gemma-3-270m"  # a real file in the wheel, the shipped contract
    assert sampling == "False sampling"  # and the sampling plan beside it
    assert int(count) == 31


@pytest.mark.slow  # ~1 min: five fresh interpreters from the wheel; the probe above stays in CI
def test_the_installed_wheel_holds_no_scripts_and_runs_every_command_elsewhere(tmp_path, tiny_dirs):
    """Issue 58: the wheel holds the library, the CLI, the kernels and what the commands read,
    not ``scripts/`` or ``tests/``; from it, outside the checkout, ``generate``, ``collect``,
    ``train-controller`` and ``bench`` each run to exit 0."""
    import os
    import subprocess
    import sys

    from tests.synthetic import write_run
    from tests.wheel import install_wheel_elsewhere

    site = install_wheel_elsewhere(tmp_path)
    assert (site / "uag").is_dir() and (site / "controllers").is_dir()
    assert not (site / "scripts").exists() and not (site / "tests").exists()
    env = {
        "PYTHONPATH": str(site),
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "UAG_CACHE": os.environ.get("UAG_CACHE", str(tmp_path / "cache")),
        "OMP_NUM_THREADS": "1",
    }
    models = ["--target", str(tiny_dirs[0]), "--assistant", str(tiny_dirs[1])]
    data = write_run(tmp_path / "run", prompts=4)
    commands = [
        ["generate", *models, "--prompt", "def f(x):", "--max-new-tokens", "4", "--json"],
        ["collect", *models, "--prompts", "mixed", "--limit", "1", "--max-new-tokens", "4",
         "--out", str(tmp_path / "collected")],
        ["train-controller", "--data", str(data), "--out", str(tmp_path / "c.onnx"),
         "--logdir", str(tmp_path / "tb"), "--max-epochs", "1"],
        ["bench", *models, "--prompts", "mixed", "--limit", "1", "--max-new-tokens", "4",
         "--policies", "target-only,default,static-2", "--out", str(tmp_path / "bench")],
    ]  # fmt: skip
    for argv in commands:
        ran = subprocess.run(
            [sys.executable, "-m", "uag", *argv], capture_output=True, text=True, cwd=tmp_path,
            env=env,
        )  # fmt: skip
        assert ran.returncode == 0, (argv[0], ran.stderr[-2000:])
    assert (tmp_path / "c.onnx").is_file() and (tmp_path / "bench" / "results.json").is_file()


def test_the_runtime_never_imports_lightning():
    """Generating, collecting, benchmarking (its oracle replays) and the ONNX controller need
    no Lightning: only ``uag train-controller`` loads it."""
    import subprocess
    import sys

    probe = (
        "import sys, uag.cli, uag.harness.bench, uag.harness.collect, controllers.learned, controllers.explore, "
        "training.data, training.replay\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip() == "[]"


SETTLED_LATER = {"target", "assistant", "assistant_int8"}
"""Model flags left None so a --controller's training settings can fill them (then defaults)."""
SAMPLING_FLAGS = {"sample", "temperature", "top_p", "top_k", "seed"}
"""Flags that become one ``sampling`` field (``cli.sampling_config``)."""


@pytest.mark.parametrize(
    ("command", "config", "required", "cli_only", "internal", "derived"),
    [
        (
            "collect",
            "uag.harness.collect:CollectConfig",
            ["--prompts", "p", "--out", "o"],
            SAMPLING_FLAGS,
            {"launched", "profile_repeats", "sampling"},
            {"shard"},  # "i/n" text, or the launcher's rank: parsed by the command
        ),
        (
            "bench",
            "uag.harness.bench:BenchConfig",
            ["--prompts", "p"],
            SAMPLING_FLAGS,
            {"progress", "sampling"},
            {"policies"},  # depends on --sample
        ),
        (
            "calibrate",
            "uag.harness.calibration:CalibrateConfig",
            [],
            set(),
            {"out", "text_column", "chat"},
            set(),
        ),
        (
            "train-controller",
            "training.config:TrainConfig",
            ["--data", "d"],
            set(),
            {"progress", "val_fraction"},
            set(),
        ),
    ],
)
def test_flags_are_the_config_fields_with_their_defaults(
    command, config, required, cli_only, internal, derived
):
    """Each job's flags map onto its config dataclass by name (``cli.config_from_args``): every
    flag is a field unless declared command-line only, every field a flag unless declared
    internal, and a flag's default is the field's (one place to change either)."""
    import importlib
    from dataclasses import fields

    from uag.cli import build_parser, default_of

    module, _, name = config.partition(":")
    cls = getattr(importlib.import_module(module), name)
    args = vars(build_parser().parse_args([command, *required]))
    args.pop("command")
    names = {f.name for f in fields(cls) if f.init}
    assert set(args) - names == cli_only
    assert names - set(args) == internal
    for flag in set(args) & names - {"prompts", "out", "data"} - SETTLED_LATER - derived:
        assert args[flag] == default_of(cls, flag), flag


def test_generate_puts_prompt_lookup_first_unless_a_policy_is_written(tiny_dirs, capsys):
    target_dir, assistant_dir = tiny_dirs
    argv = ["generate", "--target", str(target_dir), "--assistant", str(assistant_dir)]
    argv += ["--prompt", "ab ab ab ab ab ab", "--max-new-tokens", "16", "--json"]
    seen = {}
    for policy in (None, "static", "lookup"):
        extra = [] if policy is None else ["--policy", policy]
        assert main([*argv, *extra, "--compare-target-only"]) == 0
        seen[policy] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert seen[policy]["identical"] is True
    assert seen[None]["policy"] == "static-3+lookup"
    assert seen["static"]["policy"] == "static-3" and seen["static"]["copied_tokens"] == 0
    assert seen["lookup"]["policy"] == "lookup" and seen["lookup"]["drafted_tokens"] == 0
    assert seen["lookup"]["text"] == seen[None]["text"] == seen["static"]["text"]


def test_a_failure_inside_transformers_own_generate_is_one_clear_line(tokenizers, monkeypatch):
    """Transformers' assisted generation is a comparison arm, not uag's code: when it crashes
    (5.25.0's UAG generator did, mid-run) the bench stops with whose failure it is and how to go
    on, not an "internal error"."""
    from tests.tiny import cross_pair
    from uag.errors import UagError
    from uag.harness.bench import transformers_generate

    pair = cross_pair(tokenizers)

    def broken(*args, **kwargs):
        raise RuntimeError("cannot reshape tensor of 0 elements into shape [1, 0, -1, 64]\nmore")

    monkeypatch.setattr(pair.target.model, "generate", broken)
    with pytest.raises(UagError) as err:
        transformers_generate(pair, "def f(x):", 4, chat=False, assisted=True)
    message = str(err.value)
    assert "\n" not in message
    assert "own assisted generation failed" in message and "cannot reshape" in message
    assert "transformers<5.25" in message and "transformers arm" in message


def test_collect_plan_under_sample_collects_sampling_runs_per_temperature(
    tiny_dirs, tmp_path, capsys
):
    """``uag collect --plan --sample`` labels sampling rounds (not greedy ones), and ``--resume``
    at another temperature adds that temperature's runs beside the first's."""
    target_dir, assistant_dir = tiny_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "text": "def f(x):"}\n{"id": "b", "text": "the cat sat"}\n')
    out = tmp_path / "plan"
    argv = ["collect", "--plan", "--target", target_dir, "--assistant", assistant_dir]
    argv += ["--prompts", str(prompts), "--max-new-tokens", "8", "--out", str(out), "--sample"]
    assert main([*argv, "--temperature", "0.7"]) == 0
    assert main([*argv, "--temperature", "1.0", "--resume"]) == 0
    capsys.readouterr()
    meta = json.loads((out / "plan-meta.json").read_text())
    assert meta["decoding"] == "sampling"
    assert meta["temperatures"] == [0.7, 1.0]
    assert not any(a.startswith("draft") for a in meta["actions"])
    assert len(list(out.glob("plan-*.npz"))) == 4
