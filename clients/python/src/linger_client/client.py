"""One websocket to a linger server that comes back by itself.

`LingerClient` owns the socket: it connects with the token, reconnects with
backoff and jitter when the socket goes away (never taking that for the
agent stopping), reports its state, matches replies to requests by `req`,
and hands every conversation's frames to that conversation's handle
(`Conversation`), which re-attaches after each reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from .backoff import Backoff
from .conversation import Conversation, EventListener, ToolHandler
from .errors import ClientClosed, ConnectionLost, ServerError, Unauthorized
from .rest import Rest
from .seqstore import MemorySeqStore, SeqStore

log = logging.getLogger("linger_client")


class ConnectionState(str, enum.Enum):
    """The connection's state, never the agent's: a conversation's agent
    keeps working while the connection is `RECONNECTING`."""

    IDLE = "idle"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    RECONNECTING = "reconnecting"
    # The token was refused: the client stopped retrying.
    UNAUTHORIZED = "unauthorized"
    CLOSED = "closed"


@dataclass(frozen=True)
class StateChange:
    state: ConnectionState
    # Why the socket went away, when it did.
    why: str | None = None
    # Seconds until the next attempt, while reconnecting.
    retry_in: float | None = None


StateListener = Callable[[StateChange], object]
ErrorListener = Callable[[Exception], object]


def socket_url(url: str) -> str:
    """The websocket URL for a server base URL: `http://host:port` (or
    `ws://`, `https://`, `wss://`, with or without `/v1/ws`)."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"not an http(s) or ws(s) URL: {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/ws"):
        path += "/v1/ws"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class LingerClient:
    """A connection to linger, shared by any number of conversations.

    ```python
    async with LingerClient("http://127.0.0.1:7420", token="alice") as client:
        conv = await client.create(title="demo")
        ack = await conv.send("hello")
        turn = await conv.wait_turn(ack.seq)
    ```
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        seq_store: SeqStore | None = None,
        backoff: Backoff | None = None,
        ping_interval: float | None = 20.0,
        ping_timeout: float | None = 20.0,
        open_timeout: float | None = 10.0,
    ) -> None:
        self.url = socket_url(url)
        self._token = token
        # REST reads: the list, history without activating, deletes.
        self.rest = Rest(url, token)
        self.seq_store: SeqStore = seq_store if seq_store is not None else MemorySeqStore()
        self._backoff = backoff or Backoff()
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._open_timeout = open_timeout
        self._state = StateChange(ConnectionState.IDLE)
        self._ws: ClientConnection | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._conversations: dict[str, Conversation] = {}
        self._requests: dict[str, asyncio.Future[dict[str, Any]]] = {}
        # Replies a conversation handles itself (attach, message, tool_result).
        self._routes: dict[str, Callable[[dict[str, Any]], Awaitable[None]]] = {}
        self._create_hooks: dict[str, tuple[EventListener | None, ToolHandler | None]] = {}
        self._req_ids = itertools.count(1)
        self._state_listeners: list[StateListener] = []
        self._error_listeners: list[ErrorListener] = []
        self._state_waiters: set[asyncio.Future[None]] = set()
        self._send_lock = asyncio.Lock()

    # ---- state ----

    @property
    def state(self) -> ConnectionState:
        return self._state.state

    @property
    def connected(self) -> bool:
        return self._state.state is ConnectionState.CONNECTED

    def on_state(self, listener: StateListener) -> Callable[[], None]:
        """Calls `listener(StateChange)` on every change; returns a function
        that removes it."""
        self._state_listeners.append(listener)
        return lambda: self._state_listeners.remove(listener)

    def on_error(self, listener: ErrorListener) -> Callable[[], None]:
        """Errors that belong to no request: server `error` frames without a
        `req`, failing callbacks, unexpected gaps in a replay."""
        self._error_listeners.append(listener)
        return lambda: self._error_listeners.remove(listener)

    def _set_state(self, change: StateChange) -> None:
        self._state = change
        for listener in list(self._state_listeners):
            try:
                listener(change)
            except Exception as e:  # an application callback: report, go on
                self._report(e)
        for fut in self._state_waiters:
            if not fut.done():
                fut.set_result(None)
        self._state_waiters.clear()

    def _report(self, error: Exception) -> None:
        if not self._error_listeners:
            log.warning("linger client: %s", error)
        for listener in list(self._error_listeners):
            try:
                listener(error)
            except Exception:
                log.exception("linger client: error listener failed")

    async def wait_connected(self) -> None:
        """Returns once connected; raises `Unauthorized` or `ClientClosed`
        when that will not happen. Starts the client if needed."""
        if self._task is None:
            self.start()
        while True:
            state = self._state.state
            if state is ConnectionState.CONNECTED:
                return
            if state is ConnectionState.UNAUTHORIZED:
                raise Unauthorized("the server refused the token")
            if state is ConnectionState.CLOSED:
                raise ClientClosed("the client is closed")
            fut = asyncio.get_running_loop().create_future()
            self._state_waiters.add(fut)
            await fut

    # ---- lifecycle ----

    def start(self) -> None:
        """Starts connecting (and reconnecting) in the background."""
        if self._state.state is ConnectionState.CLOSED:
            raise ClientClosed("the client is closed")
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="linger-client")

    async def connect(self) -> LingerClient:
        """Starts the client and waits for the first connection."""
        self.start()
        await self.wait_connected()
        return self

    async def close(self) -> None:
        """Closes the socket for good. Conversations are not stopped: their
        turns go on in the server, as after any disconnect."""
        if self._state.state is ConnectionState.CLOSED:
            return
        task = self._task
        self._set_state(StateChange(ConnectionState.CLOSED))
        if self._wake is not None:
            self._wake.set()
        ws = self._ws
        if ws is not None:
            await ws.close(1000, "client closed")
        elif task is not None:
            # Connecting or waiting to retry: nothing to close cleanly.
            task.cancel()
        if task is not None:
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise
            except Exception as e:
                self._report(e)
        self._fail_requests(ClientClosed("the client is closed"))
        for conv in self._conversations.values():
            conv._client_closed()

    async def __aenter__(self) -> LingerClient:
        return await self.connect()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def retry_now(self) -> None:
        """Skips the wait before the next reconnect attempt (the network is
        known to be back)."""
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        attempt = 0
        self._set_state(StateChange(ConnectionState.CONNECTING))
        while not self._closed():
            # Between attempts the state stays RECONNECTING, with its reason.
            why: str
            try:
                ws = await connect(
                    self.url,
                    additional_headers={"Authorization": f"Bearer {self._token}"},
                    ping_interval=self._ping_interval,
                    ping_timeout=self._ping_timeout,
                    open_timeout=self._open_timeout,
                    max_size=None,
                )
            except InvalidStatus as e:
                if e.response.status_code in (401, 403):
                    self._set_state(StateChange(ConnectionState.UNAUTHORIZED, why=str(e)))
                    self._fail_requests(Unauthorized("the server refused the token"))
                    for conv in self._conversations.values():
                        conv._client_closed()
                    return
                why = f"cannot open the websocket: {e}"
            except (OSError, InvalidHandshake, TimeoutError, asyncio.TimeoutError) as e:
                why = f"cannot open the websocket: {e or type(e).__name__}"
            else:
                if self._closed():
                    await ws.close(1000, "client closed")
                    return
                attempt = 0
                why = await self._serve(ws)
            if self._closed():
                return
            delay = self._backoff.delay(attempt)
            attempt += 1
            self._set_state(StateChange(ConnectionState.RECONNECTING, why=why, retry_in=delay))
            assert self._wake is not None
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    def _closed(self) -> bool:
        # A method, not an inline test: the state changes across awaits.
        return self._state.state is ConnectionState.CLOSED

    async def _serve(self, ws: ClientConnection) -> str:
        """Reads one socket until it goes away; returns why it did."""
        self._ws = ws
        self._set_state(StateChange(ConnectionState.CONNECTED))
        for conv in list(self._conversations.values()):
            await conv._connected()
        why = "the socket closed"
        try:
            async for raw in ws:
                if isinstance(raw, bytes):
                    continue
                try:
                    frame = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(frame, dict):
                    await self._dispatch(frame)
        except ConnectionClosed as e:
            why = f"the socket closed ({e})"
        finally:
            self._ws = None
        if ws.close_code is not None:
            why = f"the socket closed (code {ws.close_code}{': ' + ws.close_reason if ws.close_reason else ''})"
        self._fail_requests(ConnectionLost(why))
        for conv in list(self._conversations.values()):
            conv._disconnected()
        return why

    def _fail_requests(self, error: Exception) -> None:
        self._routes.clear()
        requests, self._requests = self._requests, {}
        for fut in requests.values():
            if not fut.done():
                fut.set_exception(error)

    # ---- sending ----

    async def _send(self, frame: dict[str, Any]) -> bool:
        """Sends one frame if connected; False when it could not be sent
        (the caller keeps it for after the reconnect)."""
        ws = self._ws
        if ws is None:
            return False
        try:
            async with self._send_lock:
                await ws.send(json.dumps(frame))
        except ConnectionClosed:
            return False
        return True

    def _next_req(self, what: str) -> str:
        return f"{what}:{next(self._req_ids)}"

    async def _call(
        self,
        frame: dict[str, Any],
        *,
        retry: bool,
        before: Callable[[], Awaitable[None]] | None = None,
        hooks: tuple[EventListener | None, ToolHandler | None] | None = None,
    ) -> dict[str, Any]:
        """Sends a request and returns its reply. With `retry`, a socket
        lost before the reply means sending it again once reconnected
        (after `before()`, which re-establishes what it needs)."""
        while True:
            await self.wait_connected()
            if before is not None:
                await before()
            req = self._next_req("r")
            fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._requests[req] = fut
            if hooks is not None:
                self._create_hooks[req] = hooks
            try:
                if not await self._send({**frame, "req": req}):
                    if retry:
                        continue
                    raise ConnectionLost("not connected")
                return await fut
            except ConnectionLost:
                if not retry:
                    raise
            finally:
                self._requests.pop(req, None)
                self._create_hooks.pop(req, None)

    # ---- receiving ----

    async def _dispatch(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        req = frame.get("req")
        if isinstance(req, str) and req in self._routes:
            await self._routes.pop(req)(frame)
            return
        if isinstance(req, str) and req in self._requests:
            fut = self._requests.pop(req)
            if kind == "error":
                error = ServerError(str(frame.get("code")), str(frame.get("message")), frame.get("conversation_id"))
                if not fut.done():
                    fut.set_exception(error)
                return
            if kind == "created":
                # Events follow at once: the handle must exist before the
                # next frame is read, not when the caller resumes.
                cid = frame.get("conversation_id")
                if isinstance(cid, str):
                    self._adopt_created(cid, self._create_hooks.pop(req, (None, None)))
            if not fut.done():
                fut.set_result(frame)
            return
        cid = frame.get("conversation_id")
        conv = self._conversations.get(cid) if isinstance(cid, str) else None
        if conv is not None:
            await conv._frame(frame)
        elif kind == "error":
            self._report(
                ServerError(str(frame.get("code")), str(frame.get("message")), cid if isinstance(cid, str) else None)
            )

    def _adopt_created(self, conversation_id: str, hooks: tuple[EventListener | None, ToolHandler | None]) -> None:
        conv = Conversation(self, conversation_id, mode="control", compact=False)
        on_event, on_tool_call = hooks
        if on_event is not None:
            conv.on_event(on_event)
        conv._tool_handler = on_tool_call
        self._conversations[conversation_id] = conv
        conv._created()

    # ---- conversations ----

    def conversation(self, conversation_id: str) -> Conversation | None:
        """The handle of an open conversation."""
        return self._conversations.get(conversation_id)

    @property
    def conversations(self) -> list[Conversation]:
        return list(self._conversations.values())

    async def create(
        self,
        title: str | None = None,
        *,
        close_delay: str | None = None,
        on_event: EventListener | None = None,
        on_tool_call: ToolHandler | None = None,
    ) -> Conversation:
        """Creates a conversation; the client is attached to it in control
        mode. `on_event` and `on_tool_call` are set before its first event
        arrives (see `Conversation.on_event`, `Conversation.on_tool_call`).
        A socket lost before `created` raises `ConnectionLost` (the
        conversation may exist: it is in the REST list)."""
        frame: dict[str, Any] = {"type": "create"}
        if title is not None:
            frame["title"] = title
        if close_delay is not None:
            frame["close_delay"] = close_delay
        hooks = (on_event, on_tool_call)
        reply = await self._call(frame, retry=False, hooks=hooks)
        cid = reply["conversation_id"]
        return self._conversations[cid]

    async def open(
        self,
        conversation_id: str,
        *,
        mode: str = "control",
        compact: bool = False,
        on_event: EventListener | None = None,
        on_tool_call: ToolHandler | None = None,
    ) -> Conversation:
        """Attaches to a conversation (activating it if stopped), resuming
        after the last seq this client applied or its seq store holds, and
        returns its handle once `attached`. `mode` is `control` or
        `observe`; `compact` asks for a compact replay (protocol section
        11). `on_event` and `on_tool_call` are set before the replay."""
        if mode not in ("control", "observe"):
            raise ValueError("mode must be 'control' or 'observe'")
        conv = self._conversations.get(conversation_id)
        if conv is None or conv.mode != mode:
            if conv is not None:
                await conv.detach()
            conv = Conversation(self, conversation_id, mode=mode, compact=compact)
            stored = self.seq_store.get(conversation_id)
            if stored:
                conv.transcript.last_seq = stored
            self._conversations[conversation_id] = conv
        else:
            conv.compact = compact
        if on_event is not None:
            conv.on_event(on_event)
        if on_tool_call is not None:
            conv.on_tool_call(on_tool_call)
        try:
            await conv.attach()
        except BaseException:
            if not conv.attached and self._conversations.get(conversation_id) is conv:
                del self._conversations[conversation_id]
            raise
        return conv

    def _forget(self, conv: Conversation) -> None:
        if self._conversations.get(conv.id) is conv:
            del self._conversations[conv.id]
