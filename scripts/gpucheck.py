"""The GPU check, in one short run: greedy identity on the nasty prompts per dtype, then speed.

``python -m scripts.gpucheck --target T.gguf --assistant A.gguf --out DIR`` on a machine
with a GPU (``--device cpu`` runs the same on a CPU, for a dry run). For each ``--dtypes``
entry it loads the pair on the device (the plain path, checked for row-count invariance at load,
``uag.runtime.invariance``), and for every nasty prompt compares target-alone with a lookahead-6
draft and with the lookup arm, token for token. Then, in the first dtype, it times the arms on
``--speed-prompts`` prompts (order rotated per repeat, the device synchronised around each
generation, the first pass a warm-up) and prints each arm's speed-up over target-alone with the
spread over prompts. Writes ``gpucheck.json`` and prints one table; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import uag
from controllers.spec import parse_policy

# The CI nasty prompts, kept here so the check needs nothing from tests/ on the device.
NASTY: dict[str, str] = {
    "python_deep_indent": "class Tree:\n    def walk(self, node):\n        for child in node.children:\n"
    "            if child.leaf:\n                yield child\n",
    "unicode_mix": "Café, naïve, façade, Ångström, 😀🎉 and 你好世界 — translate to French:",
    "combining_accents": "cafe\u0301 re\u0301sume\u0301 n\u0303 a\u0308 o\u0302: write three more:",
    "cjk": "日本語の文章を書いてください。東京は",
    "emoji_run": "Rate it: ⭐⭐⭐⭐⭐ 🍕🍕🍕 👍🏽👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵 next:",
    "spaces_tabs": "a\t\tb    c      d\t e  \t f\n\t\t\tindented\n        eight spaces then",
    "crlf": "line one\r\nline two\r\n\r\nline four\r\nSo the next line is",
    "long_digits": "pi = 3.14159265358979323846264338327950288419716939937510 and e = 2.71828",
    "repeated_digits": "9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9",
    "byte_fallback": "Rare glyphs: \U00010348 \U0001d54f \u2fd5 \U0001f9ec \u0f3a\u0f3b and then",
    "special_token_text": "<bos> <eos> <|im_start|>user <start_of_turn> </s> are just text; go on:",
    "json": '{"name": "Ada", "tags": ["x", "y"], "nested": {"k": [1, 2, {"z": null}]}, "next":',
    "javascript": "function debounce(fn, ms) {\n  let t;\n  return (...args) => {\n",
    "sql": "SELECT u.id, COUNT(o.id) AS orders\nFROM users u\nLEFT JOIN orders o ON o.user_id = u.id\n",
    "math": "Solve for x: 3x + 7 = 22. Step 1:",
    "russian": "Москва — столица России. Город расположен",
}
SPEED_PROMPTS = [
    "def is_prime(n: int) -> bool:\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Write a short story about a robot who learns to paint.",
    "def merge_sort(xs: list[int]) -> list[int]:\n",
    "Explain what a hash table is, in three sentences.",
    "class Stack:\n    def __init__(self):\n",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY",
    "The three laws of thermodynamics are",
]
ARMS = ("target-only", "lookup", "static-1", "static-2", "static-4", "static-2+lookup", "bandit")


def _arm(name: str):
    """The arm's plan for ``uag.generate``; target-only is None (the target alone)."""
    if name == "target-only":
        return None
    return parse_policy(name).plan()


def _run(pair, prompt: str, arm: str, tokens: int, device: torch.device):
    plan = _arm(arm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = uag.generate(pair, prompt, plan=plan, max_new_tokens=tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out.token_ids, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--assistant", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--identity-tokens", type=int, default=32)
    p.add_argument("--speed-tokens", type=int, default=128)
    p.add_argument("--speed-prompts", type=int, default=len(SPEED_PROMPTS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    report: dict[str, object] = {"torch": torch.__version__}
    device = torch.device(args.device)
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    ok = True
    for n, dtype in enumerate(args.dtypes.split(",")):
        t0 = time.perf_counter()
        pair = uag.load_pair(
            args.target, args.assistant, device=args.device, dtype=dtype, kernels="plain"
        )
        inv = pair.target_lm.invariance
        print(f"[{dtype}] loaded in {time.perf_counter() - t0:.1f}s; {inv}", flush=True)
        differ = []
        for name, prompt in NASTY.items():
            ref, _ = _run(pair, prompt, "target-only", args.identity_tokens, device)
            for arm in ("static-6", "lookup"):
                got, _ = _run(pair, prompt, arm, args.identity_tokens, device)
                if got != ref:
                    differ.append(f"{name}/{arm}")
        ok &= not differ
        line = f"{len(NASTY) * 2 - len(differ)}/{len(NASTY) * 2} identical"
        print(f"[{dtype}] identity: {line}; differing: {differ}", flush=True)
        report[dtype] = {
            "invariance": {"invariant": inv.invariant, "padded": inv.padded, "detail": inv.detail},
            "identity": line,
            "differing": differ,
        }
        if n == 0:
            report["speed"] = _speed(pair, args, device)
        del pair
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpucheck.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    return 0 if ok else 1


def _speed(pair, args, device: torch.device) -> dict[str, object]:
    """Seconds per arm per prompt (median over repeats after a warm-up pass), rotated order."""
    arms = args.arms.split(",")
    prompts = SPEED_PROMPTS[: args.speed_prompts]
    for prompt in prompts[:2]:  # warm-up: kernels, allocator, caches
        for arm in arms:
            _run(pair, prompt, arm, 16, device)
    secs: dict[str, list[list[float]]] = {a: [[] for _ in prompts] for a in arms}
    mismatch = []
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            order = arms[(i + rep) % len(arms) :] + arms[: (i + rep) % len(arms)]
            ref = None
            outs = {}
            for arm in order:
                ids, s = _run(pair, prompt, arm, args.speed_tokens, device)
                outs[arm] = ids
                secs[arm][i].append(s)
            ref = outs["target-only"]
            mismatch += [f"{i}/{a}" for a, ids in outs.items() if ids != ref]
    base = [statistics.median(x) for x in secs["target-only"]]
    table = {}
    for arm in arms:
        per = [b / statistics.median(x) for b, x in zip(base, secs[arm], strict=True)]
        total = sum(base) / sum(statistics.median(x) for x in secs[arm])
        table[arm] = {
            "speedup": round(total, 3),
            "per_prompt_min": round(min(per), 3),
            "per_prompt_max": round(max(per), 3),
            "tok_s": round(
                args.speed_tokens * len(prompts) / sum(map(statistics.median, secs[arm])), 1
            ),
        }
        print(f"  {arm:18s} {total:6.2f}x  (prompts {min(per):.2f}-{max(per):.2f})  "
              f"{table[arm]['tok_s']} tok/s", flush=True)  # fmt: skip
    print(f"  outputs differing from target-only: {mismatch}", flush=True)
    return {"arms": table, "differing": mismatch, "prompts": len(prompts), "repeats": args.repeats}


if __name__ == "__main__":
    sys.exit(main())
