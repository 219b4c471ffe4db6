"""The dashboard's ASGI application: read-only routes over an :class:`Observer`.

Routes (GET or HEAD; anything else is 405)::

    /             the page (flodl/observe/static/dashboard.html)
    /api/state    Observer.state() as JSON
    /api/events   ?since=N[&limit=M]: {"events": [...], "next": N', "first": F}
    /metrics      Prometheus text format (flodl.observe.metrics)

With a token, every route wants it (``Authorization: Bearer TOKEN`` or ``?token=TOKEN``) and
answers 401 without it; the comparison is :func:`hmac.compare_digest`. A request with a body
is refused (413). Every request first waits its turn in the request budget (at most
:data:`REQUESTS_PER_S` over all clients, :mod:`flodl.observe.budget`). Nothing here awaits the
coordinator: a handler reads the observer's state, builds its answer without a checkpoint in
between, and only then sends, so a slow client holds its own connection, never a round.
Building is kept cheap: the state is built at most once per :data:`STATE_TTL_S` whoever
asks, and an event is encoded once, on first request.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

import trio

from flodl.observe.budget import RequestBudget
from flodl.observe.hub import Observer
from flodl.observe.metrics import CONTENT_TYPE, RunMetrics

__all__ = [
    "EVENTS_BYTES_LIMIT",
    "EVENTS_LIMIT",
    "REQUESTS_PER_S",
    "REQUEST_BURST",
    "STATE_TTL_S",
    "DashboardApp",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

EVENTS_LIMIT = 500
"""Most events one ``/api/events`` answer holds (the page asks again from ``next``)."""
EVENTS_BYTES_LIMIT = 256 * 1024
"""An ``/api/events`` answer stops adding events past this size (it holds at least one)."""
STATE_TTL_S = 0.2
"""``/api/state`` answers built within this many seconds of each other are the same one, so
fifty clients cost no more than one."""
REQUESTS_PER_S = 20.0
"""Requests answered per second over all clients (the page asks about twice a second per
viewer, a Prometheus scrape once in 15 s); beyond, requests wait their turn
(:mod:`flodl.observe.budget`)."""
REQUEST_BURST = 40


def _page() -> tuple[bytes, str]:
    """The page and its Content-Security-Policy: its one inline script and style block are
    allowed by hash, nothing else runs, nothing is fetched from elsewhere."""
    html = resources.files("flodl.observe").joinpath("static/dashboard.html").read_text("utf-8")
    hashes = []
    for tag in ("script", "style"):
        found = re.search(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
        if found is None:
            hashes.append("'none'")
            continue
        digest = hashlib.sha256(found.group(1).encode("utf-8")).digest()
        hashes.append(f"'sha256-{base64.b64encode(digest).decode()}'")
    policy = (
        f"default-src 'none'; script-src {hashes[0]}; style-src {hashes[1]}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return html.encode("utf-8"), policy


class _Answer:
    """A whole response, built before anything is sent."""

    def __init__(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        self.status = status
        self.body = body
        self.headers = {"content-type": content_type, **headers}

    @classmethod
    def text(cls, status: int, text: str, **headers: str) -> _Answer:
        return cls(status, (text + "\n").encode(), "text/plain; charset=utf-8", **headers)

    @classmethod
    def json(cls, body: bytes) -> _Answer:
        return cls(200, body, "application/json")


class DashboardApp:
    """The ASGI app (module docstring). ``token``: None, or what every request must present."""

    def __init__(self, observer: Observer, token: str | None, metrics: RunMetrics) -> None:
        self.observer = observer
        self._token = None if token is None else token.encode("utf-8")
        self.metrics = metrics
        self._page, self._policy = _page()
        self._state: tuple[float, bytes] | None = None
        self._encoded: list[bytes | None] = []
        """The JSON of events already asked for; ``_encoded[0]`` is event ``_encoded_base``."""
        self._encoded_base = 0
        self.budget = RequestBudget(REQUESTS_PER_S, REQUEST_BURST)
        """Requests over all clients the coordinator's process answers per second."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan(receive, send)
        elif kind == "http":
            await self.budget.take()
            answer = self.answer(scope)
            await _send(send, answer, head=scope["method"] == "HEAD")
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    # --- deciding ---------------------------------------------------------------------------

    def answer(self, scope: Scope) -> _Answer:
        """The response to the request ``scope`` describes (never waits)."""
        if scope["method"] not in ("GET", "HEAD"):
            return _Answer.text(405, "read-only: GET or HEAD", allow="GET, HEAD")
        try:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"), max_num_fields=8)
        except ValueError:
            return _Answer.text(400, "too many query fields")
        if not self._authorized(scope, query):
            return _Answer.text(401, "token required", **{"www-authenticate": "Bearer"})
        if _has_body(scope):
            return _Answer.text(413, "no request body is accepted")
        path = scope["path"]
        if path in ("/", "/index.html"):
            return _Answer(
                200,
                self._page,
                "text/html; charset=utf-8",
                **{"content-security-policy": self._policy},
            )
        if path == "/api/state":
            return _Answer.json(self._state_json())
        if path == "/api/events":
            since = _int_arg(query, "since", 0)
            limit = _int_arg(query, "limit", EVENTS_LIMIT)
            if since is None or limit is None:
                return _Answer.text(400, "since and limit must be integers >= 0")
            return _Answer.json(self._events_json(since, min(limit, EVENTS_LIMIT)))
        if path == "/metrics":
            return _Answer(200, self.metrics.render(), CONTENT_TYPE)
        return _Answer.text(404, "not found")

    def _authorized(self, scope: Scope, query: dict[str, list[str]]) -> bool:
        if self._token is None:
            return True
        offered: list[bytes] = [v.encode("utf-8") for v in query.get("token", [])]
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization" and value[:7].lower() == b"bearer ":
                offered.append(value[7:].strip())
        # Every offer is compared in full (no early exit), each in constant time.
        ok = False
        for candidate in offered:
            ok |= hmac.compare_digest(candidate, self._token)
        return ok

    def _state_json(self) -> bytes:
        now = trio.current_time()
        if self._state is None or now - self._state[0] >= STATE_TTL_S:
            body = json.dumps(self.observer.state(), separators=(",", ":")).encode()
            self._state = (now, body)
        return self._state[1]

    def _events_json(self, since: int, limit: int) -> bytes:
        self._forget_before(self.observer.history_start)
        records, after = self.observer.events_since(since, limit)
        first = after - len(records)
        parts: list[bytes] = []
        size = 0
        for index, record in enumerate(records, first):
            encoded = self._encoding(index, record)
            if parts and size + len(encoded) > EVENTS_BYTES_LIMIT:
                break
            parts.append(encoded)
            size += len(encoded) + 1
        after = first + len(parts)
        head = f'{{"first":{self.observer.history_start},"next":{after},"events":['.encode()
        return head + b",".join(parts) + b"]}"

    def _encoding(self, index: int, record: dict[str, Any]) -> bytes:
        """Event ``index``'s JSON, encoded on first request only."""
        slot = index - self._encoded_base
        if slot >= len(self._encoded):
            self._encoded.extend([None] * (slot + 1 - len(self._encoded)))
        encoded = self._encoded[slot]
        if encoded is None:
            encoded = self._encoded[slot] = json.dumps(record, separators=(",", ":")).encode()
        return encoded

    def _forget_before(self, start: int) -> None:
        """Drop encodings of events the observer no longer holds (memory stays bounded)."""
        if start > self._encoded_base:
            del self._encoded[: start - self._encoded_base]
            self._encoded_base = start


def _int_arg(query: dict[str, list[str]], name: str, default: int) -> int | None:
    values = query.get(name)
    if not values:
        return default
    try:
        value = int(values[0])
    except ValueError:
        return None
    return value if value >= 0 else None


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


async def _send(send: Send, answer: _Answer, *, head: bool) -> None:
    headers = {
        **answer.headers,
        "content-length": str(len(answer.body)),
        "cache-control": "no-store",
        "referrer-policy": "no-referrer",
        "x-content-type-options": "nosniff",
    }
    await send(
        {
            "type": "http.response.start",
            "status": answer.status,
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        }
    )
    await send({"type": "http.response.body", "body": b"" if head else answer.body})


async def _lifespan(receive: Receive, send: Send) -> None:
    """Nothing to start or stop: acknowledge both."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
