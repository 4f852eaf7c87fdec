"""llama.cpp as a measured anchor: uag and llama.cpp on the same GGUF, prompts, CPU and threads.

    python -m uag.harness.llamacpp --llama-python /path/to/venv/bin/python \\
        [--prompts humaneval:test+mixed:test] [--limit 6] [--max-new-tokens 128] [--repeats 2]
    python -m uag.harness.llamacpp --llama-server /path/to/llama-server \\
        --target qwen2.5-coder-1.5b --assistant smollm2-135m [--llama-draft 0.5B.gguf] ...

With ``--llama-server`` (``llama_server.py``) the arms are uag's target alone, uag's default
plan (what ``uag generate`` runs for the pair), and llama-server with no speculation, with
``--spec-type ngram-simple`` and, given ``--llama-draft``, with ``--spec-type draft-simple -md``
(same-vocabulary draft, ``--spec-draft-n-max 3``); the target's GGUF is the one uag loads.

Why: "fast" needs an outside reference. llama.cpp is the usual one for a GGUF on a CPU, and its
``LlamaPromptLookupDecoding`` is the same training-free prompt lookup uag's ``lookup`` arm runs.

Arms: uag's target alone, uag's ``lookup``, llama.cpp's target alone and llama.cpp's prompt
lookup (``llama-cpp-python``, greedy, ``num_pred_tokens`` 10). llama.cpp runs in its own
process (``llamacpp_worker.py``, under ``--llama-python``: an interpreter with
``llama-cpp-python``, which uag does not depend on: it builds from source for many minutes;
``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`` in a separate environment), fed
the exact token ids uag's target encodes, with the same thread count. Every arm runs each prompt
once untimed first; then per repeat and prompt the four arms run in a rotated order, each timed
from the call to its last token (prompt evaluation included). Rates are total tokens over total
seconds; each ratio has a 95 % interval from resampling prompts (paired). llama.cpp's tokens are
compared with uag's target-alone tokens: both decode greedily from the same weights, but
llama.cpp de-quantises and sums in another order, so near-ties may go either way (reported,
not required).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from controllers.spec import parse_policy
from uag import api
from uag.errors import UagError
from uag.harness.bench import rotated
from uag.harness.llama_server import LlamaServer
from uag.harness.prompts import as_text, load_prompts
from uag.recipes import cpu_isa, lookup_lengths, machine_id
from uag.runtime.models import DEFAULT_TARGET, EMBEDDED, embedded_gguf_path

ARMS = ("uag target-only", "uag lookup", "llama.cpp target-only", "llama.cpp lookup")
SERVER_SPECS = {
    "llama.cpp target-only": [],
    "llama.cpp ngram-simple": ["--spec-type", "ngram-simple"],
}
"""llama-server arms and their start-up arguments (plus draft-simple with ``--llama-draft``)."""
WORKER = Path(__file__).with_name("llamacpp_worker.py")


@dataclass
class ArmTotals:
    """One arm's tokens and seconds per prompt, summed over repeats."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def rate(self) -> float:
        return sum(self.tokens) / sum(self.seconds)


class LlamaWorker:
    """The llama.cpp process: one JSON request per line (``llamacpp_worker.py``)."""

    def __init__(self, python: str, *, gguf: Path, threads: int) -> None:
        try:
            self.proc = subprocess.Popen(
                [python, str(WORKER), "--gguf", str(gguf), "--threads", str(threads)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as err:
            raise UagError(f"--llama-python {python}: {err.strerror}") from None
        ready = self._read()
        if not ready.get("ready"):
            raise UagError(f"llama.cpp worker under {python} did not start")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            last = (self.proc.stderr.read().strip().splitlines() or ["no output"])[-1]
            raise UagError(f"the llama.cpp worker exited: {last}")
        return dict(json.loads(line))

    def run(
        self, ids: list[int], *, arm: str, max_new_tokens: int, stop: list[int]
    ) -> tuple[list[int], float]:
        assert self.proc.stdin is not None
        request = {"ids": ids, "arm": arm, "max_new_tokens": max_new_tokens, "stop": stop}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return list(reply["ids"]), float(reply["seconds"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def rate_interval(
    num: ArmTotals, den: ArmTotals, *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95 % interval of ``num.rate() / den.rate()`` when prompts are resampled (paired)."""
    nt, ns = np.asarray(num.tokens, float), np.asarray(num.seconds, float)
    dt, ds = np.asarray(den.tokens, float), np.asarray(den.seconds, float)
    pick = np.random.default_rng(seed).integers(0, len(nt), size=(resamples, len(nt)))
    ratios = (nt[pick].sum(1) / ns[pick].sum(1)) / (dt[pick].sum(1) / ds[pick].sum(1))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def _servers(args: argparse.Namespace, gguf: Path, threads: int) -> dict[str, LlamaServer]:
    """One llama-server per llama.cpp arm, each started before any timing (fails fast)."""
    specs = dict(SERVER_SPECS)
    if args.llama_draft is not None:
        specs["llama.cpp draft-simple"] = [
            "--spec-type", "draft-simple", "-md", str(args.llama_draft), "--spec-draft-n-max", "3",
        ]  # fmt: skip
    servers: dict[str, LlamaServer] = {}
    try:
        for arm, extra in specs.items():
            servers[arm] = LlamaServer(
                Path(args.llama_server), gguf=gguf, threads=threads, extra=extra
            )
    except UagError:
        for server in servers.values():
            server.close()
        raise
    return servers


def run(args: argparse.Namespace) -> str:
    """Every arm over the prompts (module docstring); the report as Markdown."""
    threads = torch.get_num_threads()
    loaded = load_prompts(args.prompts, limit=args.limit)
    target = args.target or DEFAULT_TARGET
    if target not in EMBEDDED:
        raise UagError(f"--target {target!r}: an embedded name is needed here (uag models list)")
    gguf = embedded_gguf_path(EMBEDDED[target])
    server_mode = args.llama_server is not None
    worker = None if server_mode else LlamaWorker(args.llama_python, gguf=gguf, threads=threads)
    servers = _servers(args, gguf, threads) if server_mode else {}
    arms = ["uag target-only", "uag default", *servers] if server_mode else list(ARMS)
    try:  # the servers are running: whatever fails, they are stopped
        pair = api.load_pair(target, args.assistant) if args.assistant else api.load_pair(target)
        prompts = [as_text(pair, p, chat=False) for p in loaded]
        ids = [api.encode_prompt(pair, p)[0] for p in prompts]
        budgets = [p.max_new_tokens or args.max_new_tokens for p in loaded]
        lookup_spec, lengths = parse_policy("lookup"), lookup_lengths(pair)  # as uag generate runs
        stop_ids = sorted(pair.target.eos_ids)
        totals = {arm: ArmTotals([0] * len(prompts), [0.0] * len(prompts)) for arm in arms}
        outputs: dict[str, list[list[int]]] = {arm: [[] for _ in prompts] for arm in arms}

        def once(arm: str, i: int) -> tuple[list[int], float]:
            if arm in servers:
                return servers[arm].run(ids[i], max_new_tokens=budgets[i], stop=stop_ids)
            if arm.startswith("llama.cpp"):
                assert worker is not None
                kind = arm.split(" ", 1)[1]
                return worker.run(ids[i], arm=kind, max_new_tokens=budgets[i], stop=stop_ids)
            plan: Any = None
            if arm == "uag lookup":
                plan = lookup_spec.plan(lengths=lengths)
            elif arm == "uag default":
                plan = "default"
            result = api.generate(pair, prompts[i], plan=plan, max_new_tokens=budgets[i])
            return result.token_ids, result.seconds

        for arm in arms:  # warm-up, not timed
            once(arm, 0)
        for r in range(args.repeats):
            for i in range(len(prompts)):
                for arm in rotated(list(arms), i + r):
                    out, seconds = once(arm, i)
                    totals[arm].tokens[i] += len(out)
                    totals[arm].seconds[i] += seconds
                    outputs[arm][i] = out
                print(f"llamacpp: repeat {r + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)}",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        if worker is not None:
            worker.close()
        for server in servers.values():
            server.close()
    return _report(args, arms, totals, outputs, gguf=gguf, threads=threads, count=len(prompts))


def _report(
    args: argparse.Namespace,
    arms: list[str],
    totals: dict[str, ArmTotals],
    outputs: dict[str, list[list[int]]],
    *,
    gguf: Path,
    threads: int,
    count: int,
) -> str:
    reference = outputs["uag target-only"]
    lines = [
        f"{count} prompts of {args.prompts}, {args.max_new_tokens} new tokens (or the prompt's "
        f"own), {args.repeats} repeats, {threads} threads, `{gguf.name}`, machine: "
        f"{machine_id()} ({cpu_isa()})",
        "",
        "| arm | tokens/s | output equal to uag target-only |",
        "|---|---|---|",
    ]
    for arm in arms:
        same = sum(o == ref for o, ref in zip(outputs[arm], reference, strict=True))
        lines.append(f"| {arm} | {totals[arm].rate():.1f} | {same}/{count} |")
    lines += ["", "| ratio | value | 95 % interval (paired by prompt) |", "|---|---|---|"]
    llama = [a for a in arms if a.startswith("llama.cpp")]
    best = max(llama, key=lambda a: totals[a].rate())
    uag_arms = [a for a in arms if a.startswith("uag")]
    pairs = [(u, "llama.cpp target-only") for u in uag_arms]
    pairs += [(u, best) for u in uag_arms if best != "llama.cpp target-only"]
    pairs += [(a, "llama.cpp target-only") for a in llama if a != "llama.cpp target-only"]
    for num, den in pairs:
        low, high = rate_interval(totals[num], totals[den])
        ratio = totals[num].rate() / totals[den].rate()
        lines.append(f"| {num} / {den} | {ratio:.2f}x | {low:.2f}–{high:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m uag.harness.llamacpp",
        description="uag against llama.cpp on the same GGUF, prompts and threads",
    )
    backend = parser.add_mutually_exclusive_group(required=True)
    backend.add_argument("--llama-python", help="an interpreter that has llama-cpp-python")
    backend.add_argument(
        "--llama-server", help="a llama-server binary (built from llama.cpp's source)"
    )
    parser.add_argument(
        "--llama-draft",
        type=Path,
        default=None,
        help="with --llama-server: a same-vocabulary draft GGUF for a draft-simple arm",
    )
    parser.add_argument("--target", default=None, help="an embedded target (default: the default)")
    parser.add_argument("--assistant", default=None, help="uag's assistant (default: the default)")
    parser.add_argument("--prompts", default="humaneval:test+mixed:test")
    parser.add_argument("--limit", type=int, default=6, help="prompts per source")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except UagError as err:
        print(f"llamacpp: {err}", file=sys.stderr)
        return 2
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
