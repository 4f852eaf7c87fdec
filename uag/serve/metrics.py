"""``GET /metrics`` in Prometheus' text format (version 0.0.4): requests, tokens, generation
time, time to first token, queue depth, and how each round's action fared (candidates the
target was offered and how many it kept, per action: step, copy, draft).

Counters only ever grow, so a scraper derives rates (tokens/s, acceptance) itself; the last
request's tokens/s is a gauge for a quick look.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from uag import api


@dataclass
class Metrics:
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(endpoint, outcome: ok / error) → count."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generation_seconds: float = 0.0
    rounds: Counter[str] = field(default_factory=Counter)
    candidates: Counter[str] = field(default_factory=Counter)
    accepted: Counter[str] = field(default_factory=Counter)
    """Per action (step, copy, draft): rounds, candidates verified, candidates accepted."""
    first_token_seconds: float = 0.0
    first_tokens: int = 0
    last_tokens_per_second: float = 0.0
    queue_depth: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def failed(self, endpoint: str) -> None:
        with self.lock:
            self.requests[endpoint, "error"] += 1

    def finished(
        self, endpoint: str, *, result: api.GenerationResult, first_token_s: float | None
    ) -> None:
        with self.lock:
            self.requests[endpoint, "ok"] += 1
            self.prompt_tokens += result.prompt_tokens
            self.completion_tokens += result.new_tokens
            self.generation_seconds += result.seconds
            if result.seconds > 0:
                self.last_tokens_per_second = result.new_tokens / result.seconds
            if first_token_s is not None:
                self.first_token_seconds += first_token_s
                self.first_tokens += 1
            for record in result.iterations:
                action = type(record.action).__name__.lower()
                self.rounds[action] += 1
                self.candidates[action] += record.candidates
                self.accepted[action] += record.accepted_candidates

    def render(self, *, in_flight: int) -> str:
        """The text a Prometheus scrape reads."""
        with self.lock:
            lines: list[str] = []

            def metric(name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> None:
                lines.extend([f"# HELP uag_{name} {text}", f"# TYPE uag_{name} {kind}"])
                lines.extend(f"uag_{name}{labels} {value:g}" for labels, value in samples)

            metric(
                "requests_total",
                "counter",
                "Requests answered, by endpoint and outcome.",
                [
                    (f'{{endpoint="{e}",outcome="{o}"}}', n)
                    for (e, o), n in sorted(self.requests.items())
                ],
            )
            metric(
                "prompt_tokens_total", "counter", "Prompt tokens read.", [("", self.prompt_tokens)]
            )
            metric(
                "completion_tokens_total",
                "counter",
                "Tokens generated.",
                [("", self.completion_tokens)],
            )
            metric(
                "generation_seconds_total",
                "counter",
                "Seconds spent generating (prefill included).",
                [("", self.generation_seconds)],
            )
            metric(
                "time_to_first_token_seconds",
                "summary",
                "From a request's arrival (queueing included) to its first text.",
                [("_sum", self.first_token_seconds), ("_count", self.first_tokens)],
            )
            metric(
                "last_tokens_per_second",
                "gauge",
                "The last finished request's tokens per second.",
                [("", self.last_tokens_per_second)],
            )
            for name, counts, text in (
                ("rounds_total", self.rounds, "Rounds run, by action."),
                ("candidates_total", self.candidates, "Candidate tokens verified, by action."),
                ("accepted_total", self.accepted, "Candidates the target accepted, by action."),
            ):
                metric(
                    name,
                    "counter",
                    text,
                    [(f'{{action="{a}"}}', n) for a, n in sorted(counts.items())],
                )
            metric("queue_depth", "gauge", "Requests waiting.", [("", self.queue_depth)])
            metric("in_flight", "gauge", "Requests generating now.", [("", in_flight)])
            return "\n".join(lines) + "\n"
