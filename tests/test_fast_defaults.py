"""The fast path by default (issue 43 item 7): the int8 assistant wherever it can run, and the
shipped controller's fastest arm as ``uag generate``'s policy where it was trained for the run.

No GPU is needed: CUDA is faked at ``torch.cuda.is_available``, which is all the resolution
reads (``uag.runtime.models.resolve_device``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from controllers.learned_plan import LearnedPlan
from controllers.plans import RulePlan
from tests.tiny import one_clean_line
from uag import api, cli, recipes
from uag.errors import UagError
from uag.runtime.models import DEFAULT_ASSISTANT, DEFAULT_TARGET


@pytest.fixture
def fake_cuda(monkeypatch):
    """``--device auto`` resolves to CUDA, as on a GPU machine (no GPU is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_int8_assistant_resolves_on_for_cpu_float32_only():
    assert api.resolve_assistant_int8(None, device="cpu") is True
    assert api.resolve_assistant_int8(None, device="cpu", dtype="float32") is True
    for dtype in ("bfloat16", "float16"):  # the int8 kernels take a float32 assistant
        assert api.resolve_assistant_int8(None, device="cpu", dtype=dtype) is False
    assert api.resolve_assistant_int8(False, device="cpu") is False  # an opt-out stays one
    assert api.resolve_assistant_int8(True, device="cpu") is True


def test_int8_assistant_stays_off_on_cuda(fake_cuda):
    assert api.resolve_assistant_int8(None, device="auto") is False
    assert api.resolve_assistant_int8(None, device="cuda", dtype="float32") is False


def _settled(argv: list[str], controller: LearnedPlan | None = None) -> argparse.Namespace:
    args = cli.build_parser().parse_args(argv)
    cli.settle_model_args(args, controller)
    return args


PAIR_COMMANDS = [
    ["generate", "--prompt", "x"],
    ["bench", "--prompts", "mixed"],
    ["collect", "--prompts", "mixed", "--out", "o"],
    ["calibrate"],
]


@pytest.mark.parametrize("argv", PAIR_COMMANDS, ids=lambda a: a[0])
def test_every_pair_command_defaults_to_the_int8_assistant_on_cpu(argv):
    assert cli.build_parser().parse_args(argv).assistant_int8 is None  # left for settling
    assert _settled([*argv, "--device", "cpu"]).assistant_int8 is True
    assert _settled([*argv, "--device", "cpu", "--no-assistant-int8"]).assistant_int8 is False
    assert _settled([*argv, "--device", "cpu", "--assistant-int8"]).assistant_int8 is True
    assert _settled([*argv, "--device", "cpu", "--dtype", "bfloat16"]).assistant_int8 is False


@pytest.mark.parametrize("argv", PAIR_COMMANDS, ids=lambda a: a[0])
def test_every_pair_command_keeps_the_float_assistant_on_cuda(argv, fake_cuda):
    assert _settled(argv).assistant_int8 is False


def test_collect_and_generate_settle_on_the_same_assistant(fake_cuda, monkeypatch):
    """A controller collects its features and latencies with the assistant generate will run it
    with: the same default on each device, and a controller trained with the int8 assistant
    gets the float one where int8 cannot run (it then warns; the output is unaffected)."""
    shipped = LearnedPlan(recipes.SHIPPED_CONTROLLER)
    assert shipped.info.assistant_int8 is True
    for argv in (["generate", "--prompt", "x"], ["collect", "--prompts", "m", "--out", "o"]):
        assert _settled(argv, shipped).assistant_int8 is False  # CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["generate", "--prompt", "x"], ["collect", "--prompts", "m", "--out", "o"]):
        assert _settled(argv).assistant_int8 is True
        assert _settled(argv, shipped).assistant_int8 is True


def test_a_controller_trained_on_the_float_assistant_brings_it(monkeypatch):
    shipped = LearnedPlan(recipes.SHIPPED_CONTROLLER)
    monkeypatch.setattr(shipped, "info", replace(shipped.info, assistant_int8=False))
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu"])
    note = cli.settle_model_args(args, shipped)
    assert args.assistant_int8 is False
    assert note is not None and "--no-assistant-int8" in note


def _pair(**changes) -> SimpleNamespace:
    """What ``uag.recipes`` reads of a loaded pair: the default one on uag's CPU kernels."""
    fields = dict(
        target=SimpleNamespace(ref=DEFAULT_TARGET, device=torch.device("cpu")),
        assistant=SimpleNamespace(ref=DEFAULT_ASSISTANT),
        assistant_int8=True,
        kernels="native",
        draft_vocab=None,
    )
    return SimpleNamespace(**{**fields, **changes})


def test_the_shipped_plan_runs_where_it_was_trained():
    assert recipes.shipped_fits(_pair())
    assert recipes.shipped_fits(_pair(), sampling=True)
    # The shipped plan was trained for exactly that run: nothing to warn about.
    info = LearnedPlan(recipes.SHIPPED_CONTROLLER).info
    assert (info.target, info.assistant, info.assistant_int8, info.decoding) == (
        DEFAULT_TARGET,
        DEFAULT_ASSISTANT,
        True,
        "greedy",
    )
    assert str(info.latency_profile["device"]).startswith("cpu")
    assert LearnedPlan(recipes.SHIPPED_SAMPLING_CONTROLLER).info.decoding == "sampling"


@pytest.mark.parametrize(
    "change",
    [
        {"assistant_int8": False},
        {"kernels": "onednn"},  # bfloat16, CUDA: not uag's CPU kernels
        {"target": SimpleNamespace(ref="some/other-model", device=torch.device("cpu"))},
        {"assistant": SimpleNamespace(ref="gemma-3-270m")},
    ],
    ids=lambda c: next(iter(c)),
)
def test_elsewhere_the_default_is_static_with_calibrated_lookup(change):
    pair = _pair(**change)
    assert not recipes.shipped_fits(pair)
    recipe = recipes.default_plan(pair)
    assert isinstance(recipe.plan, RulePlan) and recipe.plan.name == "static-3+lookup"
    assert "shipped plan was trained for" in recipe.why


def test_a_missing_shipped_plan_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    monkeypatch.setattr(recipes, "SHIPPED_SAMPLING_CONTROLLER", tmp_path / "gone.onnx")
    with pytest.raises(UagError, match="shipped controller .* is missing"):
        recipes.default_plan(_pair(), sampling=True)


def test_the_shipped_controller_is_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert recipes.shipped_controller() == recipes.SHIPPED_CONTROLLER
    assert recipes.SHIPPED_CONTROLLER.is_absolute() and recipes.SHIPPED_CONTROLLER.is_file()


@pytest.mark.parametrize(
    "extra", [["--policy", "learned"], ["--policy", "learned+lookup"]], ids=str
)
def test_a_missing_shipped_controller_is_one_clean_line(extra, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(recipes, "SHIPPED_CONTROLLER", tmp_path / "gone" / "ctrl.onnx")
    assert cli.main(["generate", "--prompt", "x", "--device", "cpu", *extra]) == 2
    assert "shipped controller" in one_clean_line(capsys)


def test_the_library_and_the_cli_run_the_same_plan(tiny_dirs):
    """``uag.generate(pair, prompt)`` and ``uag generate`` without --policy resolve the same
    plan object: both take ``Pair.default_plan``."""
    pair = api.load_pair(*tiny_dirs)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu"])
    request = cli._plan_request(args)
    cli.settle_model_args(args)
    from_cli = request.resolve(pair, args, sampling=False)
    assert from_cli is pair.default_plan().plan
    assert api.generate(pair, "ab ab ab", max_new_tokens=4).policy == from_cli.name
    assert request.resolve(pair, args, sampling=True) is pair.default_plan(sampling=True).plan


def test_the_default_arm_and_policy_default_are_the_products_plan(tiny_dirs, tmp_path, capsys):
    """``uag bench --policies default`` times the plan ``uag generate`` runs without a policy
    (its name in the report is ``default``), and ``--policy default`` names it explicitly."""
    from uag.harness.bench import BenchConfig, build_arms

    pair = api.load_pair(*tiny_dirs)
    cfg = BenchConfig(prompts="mixed", out=tmp_path, target=tiny_dirs[0], assistant=tiny_dirs[1])
    policies: dict = {}
    arms = build_arms(["target-only", "default"], pair, cfg, policies=policies)
    assert list(arms) == ["target-only", "default"]
    product = recipes.default_plan(pair).plan
    assert policies["default"]().name == product.name
    assert arms["default"]("ab ab ab", 4, None).ids == arms["target-only"]("ab ab ab", 4, None).ids
    argv = ["generate", "--target", str(tiny_dirs[0]), "--assistant", str(tiny_dirs[1])]
    assert cli.main([*argv, "--prompt", "x", "--policy", "default", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert shown["policy"] == product.name and shown["plan_why"].startswith(product.name)
    assert cli.main([*argv, "--prompt", "x", "--policy", "default", "--lookahead", "2"]) == 2


def test_help_says_int8_is_the_default_on_cpu_and_off_on_cuda(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--no-assistant-int8" in out
    assert "off on CUDA" in out
    assert "the product's plan, as uag.generate runs it" in out


def test_generate_with_other_models_keeps_static_lookup(tiny_dirs, capsys):
    """A pair the shipped controller was not trained for falls back, and (CPU) drafts with the
    int8 assistant; the output is the target's."""
    target_dir, assistant_dir = tiny_dirs
    argv = ["generate", "--target", target_dir, "--assistant", assistant_dir, "--device", "cpu"]
    argv += ["--prompt", "ab ab ab ab", "--max-new-tokens", "8", "--json"]
    assert cli.main([*argv, "--compare-target-only"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["policy"] == "static-3+lookup" and out["identical"] is True
