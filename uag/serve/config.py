"""``uag serve``'s settings: plain data, so the CLI can declare its flags without importing
the web stack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What ``uag serve`` listens on and allows."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    queue: int = 16
    """Requests that may wait while one generates; more are answered 429."""
    max_tokens: int = 1024
    """The most tokens one request may ask for, and a chat request's default."""
    max_body: int = 1 << 20
    """Request bodies above this many bytes are answered 413."""
