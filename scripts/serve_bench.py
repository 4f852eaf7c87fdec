"""Multi-turn chat through live ``uag serve`` processes, one per arm, interleaved: each turn
carries the whole conversation so far, as a chat client sends it. Per arm: end-to-end tokens/s
(prefill included) and time to first token on the first turn and on later ones (where prefix
reuse should show), with bootstrap intervals over conversations, and whether every arm's
replies were the same text (greedy: they must be).

    python -m scripts.serve_bench --max-tokens 64 --out runs/serve-bench.json

Arms (each its own server on 127.0.0.1): ``reuse`` (the default: prefix reuse on), ``fresh``
(``--prefix-cache 0``), ``target-only`` (``--policy target-only``, prefix reuse on). Every
request loop is bounded (conversations x turns) and the servers are stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ARMS = {
    "reuse": [],
    "fresh": ["--prefix-cache", "0"],
    "target-only": ["--policy", "target-only"],
}


def start(arm: str, extra: list[str], log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    log = log_dir / f"serve-{arm}.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uag", "serve", "--port", "0", *ARMS.get(arm, []), *extra],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{arm}: uag serve exited: {log.read_text()[-2000:]}")
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        time.sleep(0.2)
    raise SystemExit(f"{arm}: uag serve did not start")


def turn(
    client: Any, model: str, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    started = time.perf_counter()
    first = None
    pieces = []
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    done = time.perf_counter()
    return {
        "text": "".join(pieces),
        "seconds": done - started,
        "ttft": (first or done) - started,
        "tokens": usage.completion_tokens if usage else 0,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
    }


def interval(values: list[float], *, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(2000))
    return means[50], means[1949]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--conversations", type=Path, default=Path("data/conversations/multiturn.jsonl")
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--limit", type=int, default=None, help="first N conversations")
    parser.add_argument("--out", type=Path, default=Path("runs/serve-bench.json"))
    parser.add_argument("serve_args", nargs="*", help="passed to every uag serve (after --)")
    args = parser.parse_args()
    import openai

    convs = [json.loads(line) for line in args.conversations.read_text().splitlines() if line]
    convs = convs[: args.limit] if args.limit else convs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    servers = {arm: start(arm, args.serve_args, args.out.parent) for arm in args.arms}
    model = "gemma-3-270m"
    try:
        clients = {
            arm: openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            for arm, (_, url) in servers.items()
        }
        model = clients[args.arms[0]].models.list().data[0].id
        for client in clients.values():  # warm-up, excluded: one short request each
            turn(client, model, [{"role": "user", "content": "Hi"}], 4)
        rows = run(convs, clients, model, args.max_tokens)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(timeout=30)
    report(rows, args.arms, args.out)


def run(
    convs: list[dict[str, Any]], clients: dict[str, Any], model: str, max_tokens: int
) -> list[dict[str, Any]]:
    rows = []
    histories: dict[str, dict[str, list[dict[str, str]]]] = {
        arm: {c["id"]: [] for c in convs} for arm in clients
    }
    order = list(clients)
    for t in range(max(len(c["turns"]) for c in convs)):
        for c in convs:
            if t >= len(c["turns"]):
                continue
            order = order[1:] + order[:1]  # rotate which arm goes first
            for arm in order:
                history = histories[arm][c["id"]]
                history.append({"role": "user", "content": c["turns"][t]})
                out = turn(clients[arm], model, history, max_tokens)
                history.append({"role": "assistant", "content": out["text"]})
                rows.append({"arm": arm, "conversation": c["id"], "turn": t, **out})
                print(
                    f"{c['id']:12s} turn {t} {arm:12s} {out['tokens']:4d} tok "
                    f"{out['tokens'] / out['seconds']:6.1f} tok/s ttft {out['ttft'] * 1000:6.0f} ms "
                    f"(prompt {out['prompt_tokens']})",
                    flush=True,
                )
    return rows


def report(rows: list[dict[str, Any]], arms: list[str], out: Path) -> None:
    import platform

    summary: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "arms": {}}
    by_conv = {}
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        convs = sorted({r["conversation"] for r in mine})
        per_conv = [
            sum(r["tokens"] for r in mine if r["conversation"] == c)
            / sum(r["seconds"] for r in mine if r["conversation"] == c)
            for c in convs
        ]
        by_conv[arm] = per_conv
        later = [r["ttft"] for r in mine if r["turn"] > 0]
        summary["arms"][arm] = {
            "tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine),
            "tokens_per_s_interval": interval(per_conv),
            "ttft_first_turn_ms": 1000
            * statistics.median(r["ttft"] for r in mine if r["turn"] == 0),
            "ttft_later_turns_ms": 1000 * statistics.median(later) if later else None,
        }
    texts: dict[tuple[str, int], set[str]] = {}
    for r in rows:
        texts.setdefault((r["conversation"], r["turn"]), set()).add(r["text"])
    summary["identical_turns"] = sum(len(v) == 1 for v in texts.values())
    summary["turns"] = len(texts)
    if "fresh" in by_conv:
        for arm in arms:
            ratios = [a / b for a, b in zip(by_conv[arm], by_conv["fresh"], strict=True)]
            summary["arms"][arm]["vs_fresh"] = statistics.fmean(ratios)
            summary["arms"][arm]["vs_fresh_interval"] = interval(ratios)
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
