"""The OpenAI wire format ``uag serve`` speaks: request bodies (checked by pydantic, unknown
fields refused), the error shape, and the response and stream-chunk bodies.

Why refuse rather than ignore: a client that asks for ``n=2``, log-probabilities or a penalty
and silently gets something else has a bug it cannot see. Fields OpenAI documents as hints
(``user``, ``metadata``, ``store``...) are accepted and ignored, as OpenAI does.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOPS = 4
"""OpenAI's limit on ``stop`` sequences."""


class _Request(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def unsupported(self) -> str | None:
        """Why this request asks for something uag does not do, or None."""
        if self.n != 1:
            return f"n={self.n} is not supported: uag returns one completion per request"
        if self.frequency_penalty or self.presence_penalty:
            return (
                "frequency_penalty and presence_penalty are not supported (they change the "
                "target's distribution, which uag reproduces exactly)"
            )
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def stops(self) -> tuple[str, ...]:
        """``stop`` as a tuple of non-empty strings (OpenAI: at most 4)."""
        raw = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(raw) > MAX_STOPS:
            raise ValueError(f"stop holds {len(raw)} sequences; at most {MAX_STOPS}")
        return tuple(s for s in raw if s)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[str]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.best_of not in (None, 1):
            return "best_of is not supported: uag returns one completion per request"
        if self.echo:
            return "echo is not supported"
        if self.logprobs is not None:
            return "logprobs is not supported"
        if self.suffix:
            return "suffix (insertion) is not supported"
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> str | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs is not supported"
        if self.tools or self.tool_choice not in (None, "none"):
            return "tools are not supported"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format other than text is not supported"
        return super().unsupported()

    def conversation(self) -> list[dict[str, str]]:
        """The messages as a chat template reads them (``developer`` as ``system``)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


@dataclass(eq=False)
class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Shape:
    """How one endpoint writes its answers: a whole completion, or stream chunks."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, *, chat: bool, model: str) -> Shape:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{secrets.token_hex(12)}", int(time.time()))

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: FinishReason, usage: Usage) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage.body()}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage.body()}

    def chunk(
        self, text: str | None, finish: FinishReason | None = None, *, first: bool = False
    ) -> dict[str, Any]:
        """One stream chunk: ``text`` (None: none, as in the last chunk), the finish reason on
        the last; a chat stream's first chunk names the role."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage.body()}
