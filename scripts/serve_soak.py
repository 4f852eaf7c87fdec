"""Soak: a steady stream of requests to one live ``uag serve`` for a while, its resident memory
sampled as it goes. What it shows: RSS settles once the caches it is allowed (the prefix cache's
positions, the models' scratch) are full, and does not keep growing.

    python -m scripts.serve_soak --minutes 30 --out runs/serve-soak.json

Traffic goes to 127.0.0.1 only, from one client thread at a time (a mix of completions and
chats, streamed and not, greedy and sampled, some cut by a stop string, some abandoned
mid-stream); the loop stops by itself after ``--minutes`` (and after ``--max-requests``), then
the server is stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import time
from pathlib import Path

from scripts.serve_bench import start


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_request(client, httpx, url: str, model: str, rng: random.Random, convs: list) -> str:
    kind = rng.choice(["chat", "chat", "completion", "abandon"])
    conv = rng.choice(convs)
    turns = conv["turns"][: rng.randint(1, len(conv["turns"]))]
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": "Sure, here it is."})
    sampled = rng.random() < 0.3
    extra = {} if sampled else {"temperature": 0}
    if kind == "chat":
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=rng.choice([16, 48, 96]), **extra
        )
    elif kind == "completion":
        client.completions.create(
            model=model,
            prompt=turns[-1],
            max_tokens=rng.choice([16, 48]),
            stop=["\n\n"] if rng.random() < 0.5 else None,
            **extra,
        )
    else:  # a client that leaves after its first chunk
        body = {"model": model, "messages": messages, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
    return kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument(
        "--conversations", type=Path, default=Path("data/conversations/multiturn.jsonl")
    )
    parser.add_argument("--out", type=Path, default=Path("runs/serve-soak.json"))
    args = parser.parse_args()
    import httpx2 as httpx
    import openai

    convs = [json.loads(line) for line in args.conversations.read_text().splitlines() if line]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start("soak", [], args.out.parent)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    rng = random.Random(0)
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    kinds: dict[str, int] = {}
    try:
        n = 0
        while time.monotonic() - started < 60 * args.minutes and n < args.max_requests:
            kind = one_request(client, httpx, url, model, rng, convs)
            kinds[kind] = kinds.get(kind, 0) + 1
            n += 1
            if n % 10 == 0:
                samples.append(
                    {"s": time.monotonic() - started, "requests": n, "rss_mb": rss_mb(proc.pid)}
                )
                print(
                    f"{samples[-1]['s']:7.0f} s  {n:6d} requests  RSS {samples[-1]['rss_mb']:.0f} MB",
                    flush=True,
                )
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    settled = [s["rss_mb"] for s in samples if s["s"] > 60 * args.minutes / 3]
    summary = {
        "requests": sum(kinds.values()),
        "kinds": kinds,
        "minutes": (time.monotonic() - started) / 60,
        "rss_first_mb": samples[0]["rss_mb"] if samples else None,
        "rss_after_first_third_min_mb": min(settled) if settled else None,
        "rss_after_first_third_max_mb": max(settled) if settled else None,
        "rss_last_mb": samples[-1]["rss_mb"] if samples else None,
        "exit_code": code,
    }
    args.out.write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
