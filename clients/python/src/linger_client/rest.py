"""linger's REST API (protocol section 2): reads that never activate a
conversation, and deletes. Standard-library HTTP run in a worker thread, so
the package needs nothing beyond `websockets`."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from .errors import ServerError, Unauthorized
from .transcript import Event


def http_url(url: str) -> str:
    """The HTTP base URL for a server URL given as `http(s)://` or
    `ws(s)://`, with any `/v1/ws` path dropped."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https", "http": "http", "https": "https"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"not an http(s) or ws(s) URL: {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1/ws"):
        path = path[: -len("/v1/ws")]
    return urlunsplit((scheme, parts.netloc, path, "", ""))


@dataclass(frozen=True)
class Summary:
    """One conversation as the REST list shows it."""

    id: str
    title: str
    status: str
    head_seq: int
    created_at: str
    last_activity_at: str

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> Summary:
        return cls(
            str(v.get("id", "")),
            str(v.get("title") or ""),
            str(v.get("status", "")),
            int(v.get("head_seq") or 0),
            str(v.get("created_at", "")),
            str(v.get("last_activity_at", "")),
        )


class Rest:
    def __init__(self, url: str, token: str, *, timeout: float = 30.0) -> None:
        self.base = http_url(url)
        self._token = token
        self._timeout = timeout

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self._token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise Unauthorized("the server refused the token") from e
            try:
                err = json.loads(e.read())["error"]
                raise ServerError(str(err["code"]), str(err["message"])) from e
            except (ValueError, KeyError, TypeError):
                raise ServerError("http_" + str(e.code), str(e.reason)) from e
        return json.loads(raw) if raw else None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        return await asyncio.to_thread(self._request, method, path, body)

    async def list_conversations(self) -> list[Summary]:
        return [Summary.from_json(v) for v in await self._call("GET", "/v1/conversations")]

    async def get_conversation(self, conversation_id: str) -> Summary:
        return Summary.from_json(await self._call("GET", f"/v1/conversations/{quote(conversation_id)}"))

    async def create_conversation(self, title: str | None = None) -> Summary:
        body = {} if title is None else {"title": title}
        return Summary.from_json(await self._call("POST", "/v1/conversations", body))

    async def events(self, conversation_id: str, after: int = 0, limit: int = 1000) -> tuple[list[Event], int]:
        """Stored events with seq > `after`, oldest first, and the head seq."""
        page = await self._call("GET", f"/v1/conversations/{quote(conversation_id)}/events?after={after}&limit={limit}")
        events = [e for e in (Event.from_frame(v) for v in page.get("events", [])) if e is not None]
        return events, int(page.get("head_seq") or 0)

    async def delete_conversation(self, conversation_id: str) -> None:
        await self._call("DELETE", f"/v1/conversations/{quote(conversation_id)}")

    async def add_observer(self, conversation_id: str, user: str) -> None:
        await self._call("POST", f"/v1/conversations/{quote(conversation_id)}/observers", {"user": user})
