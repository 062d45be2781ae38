"""One conversation seen through a `LingerClient`: its handle.

The handle owns what must survive a reconnect: the transcript and its last
seq (the point to resume from), the outbox of messages not yet acknowledged
(resent with the same `client_msg_id`, so the server records each once),
and the answers to client tool calls (computed once, sent again after a
reconnect while the server still lists the call in `pending_calls`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ClientClosed, Detached, LingerError, ReadOnly, ServerError, ToolError
from .transcript import Applied, Event, ToolCall, Transcript, Turn

if TYPE_CHECKING:
    from .client import LingerClient

EventListener = Callable[[Event], "Awaitable[object] | object"]
ToolHandler = Callable[[ToolCall], Any]


@dataclass(frozen=True)
class Ack:
    """The server recorded a message as the `user_message` event `seq`.
    `duplicate` is true when it had been recorded already: a resend after a
    reconnect of a message whose first acknowledgement was lost."""

    seq: int
    duplicate: bool


class SeqGap(LingerError):
    """Events skipped seqs where the protocol allows no gap; the
    conversation re-attaches from its last seq."""


@dataclass
class _Outgoing:
    client_msg_id: str
    text: str
    future: asyncio.Future[Ack]
    sent: bool = False


@dataclass
class _Answer:
    output: Any
    is_error: bool
    sent: bool = False


@dataclass
class _Attachment:
    """What `attached` said, for the replay that follows it."""

    head_seq: int = 0
    server_pending: set[str] = field(default_factory=set)
    tools_checked: bool = False


class Conversation:
    """A handle on one conversation. Get it from `LingerClient.create` or
    `LingerClient.open`; it re-attaches by itself after a reconnect."""

    def __init__(self, client: LingerClient, conversation_id: str, *, mode: str, compact: bool) -> None:
        self._client = client
        self.id = conversation_id
        self.mode = mode
        self.compact = compact
        self.transcript = Transcript(conversation_id)
        self.attached = False
        # Why the server detached it, until it is attached again.
        self.detach_reason: str | None = None
        self._want_attached = False
        self._attaching = False
        self._attachment = _Attachment()
        self._outbox: list[_Outgoing] = []
        self._answers: dict[str, _Answer] = {}
        self._tool_tasks: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._tool_handler: ToolHandler | None = None
        self._listeners: list[EventListener] = []
        self._attach_waiters: list[asyncio.Future[None]] = []
        self._waiters: set[asyncio.Future[None]] = set()
        self._ended: Exception | None = None

    def __repr__(self) -> str:
        return f"<Conversation {self.id} {self.mode} status={self.status} attached={self.attached}>"

    # ---- state ----

    @property
    def status(self) -> str | None:
        """The agent's status from the events: `running`, `waiting`,
        `idle` or `stopped` (None before anything is known). It says
        nothing about the connection: see `LingerClient.state`."""
        return self.transcript.status

    @property
    def stop_reason(self) -> str | None:
        return self.transcript.stop_reason

    @property
    def last_seq(self) -> int:
        return self.transcript.last_seq

    @property
    def pending_calls(self) -> list[ToolCall]:
        return self.transcript.pending_calls()

    @property
    def unacked(self) -> list[str]:
        """Texts of messages sent and not yet acknowledged."""
        return [o.text for o in self._outbox]

    # ---- application hooks ----

    def on_event(self, listener: EventListener) -> Callable[[], None]:
        """Calls `listener(event)` for each new event, in seq order, once
        each (never for a replayed duplicate); a coroutine is awaited before
        the next frame is read. Returns a function that removes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def on_tool_call(self, handler: ToolHandler | None) -> None:
        """Answers client tool calls: `handler(call)` (or a coroutine)
        returns the output; raising `ToolError(output)` answers with
        `is_error: true`, another exception with its message. It runs once
        per call, even across reconnects; calls pending now are answered at
        once."""
        self._tool_handler = handler
        if handler is not None and self.attached:
            self._check_tools()

    def events(self) -> AsyncIterator[Event]:
        """New events as an async iterator (from now on)."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        remove = self.on_event(queue.put_nowait)

        async def iterate() -> AsyncIterator[Event]:
            try:
                while True:
                    yield await queue.get()
            finally:
                remove()

        return iterate()

    async def wait_until(self, predicate: Callable[[Transcript], object]) -> None:
        """Waits until `predicate(transcript)` holds (checked after each
        event and each attach or detach)."""
        while not predicate(self.transcript):
            if self._ended is not None:
                raise self._ended
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.add(fut)
            try:
                await fut
            finally:
                self._waiters.discard(fut)

    async def wait_turn(self, message_seq: int) -> Turn:
        """Waits for the end of the turn that answers the message recorded
        at `message_seq` (`Ack.seq`) and returns it."""
        found: list[Turn] = []

        def done(t: Transcript) -> bool:
            turn = t.turn_for_message(message_seq)
            if turn is not None and turn.finished:
                found.append(turn)
                return True
            return False

        await self.wait_until(done)
        return found[0]

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # ---- requests ----

    def _control(self) -> None:
        if self.mode != "control":
            raise ReadOnly(f"{self.id} is open in {self.mode} mode")
        if self._ended is not None:
            raise self._ended

    async def attach(self) -> None:
        """Attaches (again), resuming after the last seq applied; returns
        once `attached`. Not needed after `create`/`open`, nor after a
        reconnect; needed to follow a conversation the server detached."""
        if self._ended is not None:
            raise self._ended
        self._want_attached = True
        if self.attached:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._attach_waiters.append(fut)
        if self._client.connected:
            await self._send_attach()
        else:
            self._client.start()
        await fut

    async def send(self, text: str, *, client_msg_id: str | None = None) -> Ack:
        """Sends a message and returns its acknowledgement. Across
        reconnects it is sent again with the same `client_msg_id` until
        acknowledged, so it is recorded once. A conversation the server
        detached (or stopped) is attached again first, which resumes it."""
        self._control()
        fut: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        out = _Outgoing(client_msg_id or uuid.uuid4().hex, text, fut)
        self._outbox.append(out)
        self._want_attached = True
        try:
            await self._flush()
            return await fut
        except asyncio.CancelledError:
            if out in self._outbox and not out.sent:
                self._outbox.remove(out)
            raise

    async def answer(self, call_id: str, output: Any, *, is_error: bool = False) -> None:
        """Answers a client tool call by hand (without `on_tool_call`). The
        answer is sent again after a reconnect while the call is pending."""
        self._control()
        self._answers[call_id] = _Answer(output, is_error)
        await self._send_answer(call_id)

    async def stop(self) -> None:
        """Aborts the running turn (`turn_finished stopped`)."""
        self._control()
        await self._client._call({"type": "stop", "conversation_id": self.id}, retry=True, before=self.attach)

    async def close(self) -> None:
        """Stops the conversation now (`agent_stopped closed`); the server
        then detaches it. Sending a message resumes it."""
        self._control()
        await self._client._call({"type": "close", "conversation_id": self.id}, retry=True, before=self.attach)

    async def detach(self) -> None:
        """Stops following it: the handle is dropped from the client, the
        turn goes on in the server."""
        self._want_attached = False
        if self.attached or self._attaching:
            await self._client._send({"type": "detach", "conversation_id": self.id})
        self.attached = False
        self._attaching = False
        self._end(Detached(self.id, "client"))
        self._client._forget(self)

    # ---- the socket's side ----

    def _expect(self, what: str, on_reply: Callable[[dict[str, Any]], Awaitable[None]]) -> str:
        req = self._client._next_req(what)
        self._client._routes[req] = on_reply
        return req

    async def _send_attach(self) -> None:
        if self._attaching or self.attached:
            return
        self._attaching = True
        frame: dict[str, Any] = {
            "type": "attach",
            "conversation_id": self.id,
            "last_seq": self.transcript.last_seq,
            "mode": self.mode,
            "req": self._expect("attach", self._on_attach_reply),
        }
        if self.compact:
            frame["compact"] = True
        if not await self._client._send(frame):
            self._attaching = False

    async def _flush(self) -> None:
        if not any(not o.sent for o in self._outbox):
            return
        if not self.attached:
            if self._client.connected:
                await self._send_attach()
            else:
                self._client.start()
            return
        # A snapshot: acks may remove entries while a send awaits.
        for out in list(self._outbox):
            if out.sent or out not in self._outbox:
                continue
            out.sent = True
            frame = {
                "type": "message",
                "conversation_id": self.id,
                "text": out.text,
                "client_msg_id": out.client_msg_id,
                "req": self._expect("msg", functools.partial(self._on_message_reply, out)),
            }
            if not await self._client._send(frame):
                out.sent = False
                return

    async def _send_answer(self, call_id: str) -> None:
        answer = self._answers.get(call_id)
        if answer is None or answer.sent or not self.attached:
            return
        answer.sent = True
        frame = {
            "type": "tool_result",
            "conversation_id": self.id,
            "call_id": call_id,
            "output": answer.output,
            "is_error": answer.is_error,
            "req": self._expect("tool", functools.partial(self._on_tool_reply, call_id)),
        }
        if not await self._client._send(frame):
            answer.sent = False

    def _created(self) -> None:
        self._want_attached = True
        self.attached = True
        self._attachment = _Attachment()

    async def _connected(self) -> None:
        self._attaching = False
        if self._want_attached and self._ended is None:
            await self._send_attach()

    def _disconnected(self) -> None:
        # The server detaches a socket that goes away; what was not
        # acknowledged is sent again after the re-attach.
        self.attached = False
        self._attaching = False
        for out in self._outbox:
            out.sent = False
        for answer in self._answers.values():
            answer.sent = False
        self._notify()

    def _client_closed(self) -> None:
        self.attached = False
        self._attaching = False
        self._end(ClientClosed("the client is closed"))

    def _end(self, error: Exception) -> None:
        """The handle is done: fail everything still waiting."""
        self._ended = error
        outbox, self._outbox = self._outbox, []
        for out in outbox:
            if not out.future.done():
                out.future.set_exception(error)
        waiters, self._attach_waiters = self._attach_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(error)
        for task in [*self._tool_tasks.values(), *self._background]:
            task.cancel()
        self._notify()

    async def _on_attach_reply(self, frame: dict[str, Any]) -> None:
        self._attaching = False
        if frame.get("type") == "error":
            error = ServerError(str(frame.get("code")), str(frame.get("message")), self.id)
            self._want_attached = False
            waiters, self._attach_waiters = self._attach_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(error)
            for out in [o for o in self._outbox if not o.sent]:
                self._outbox.remove(out)
                if not out.future.done():
                    out.future.set_exception(error)
            if not waiters:
                self._client._report(error)
            self._notify()
            return
        if frame.get("type") != "attached":
            return
        self.attached = True
        self.detach_reason = None
        head = frame.get("head_seq")
        replay_from = frame.get("replay_from")
        head_seq = head if isinstance(head, int) else self.transcript.last_seq
        self.transcript.begin_replay(
            replay_from if isinstance(replay_from, int) else self.transcript.last_seq + 1,
            head_seq,
            frame.get("compact") is True,
        )
        status = frame.get("status")
        if isinstance(status, str):
            self.transcript.status = status
        pending = frame.get("pending_calls")
        server_pending = {c for c in pending if isinstance(c, str)} if isinstance(pending, list) else set()
        self._attachment = _Attachment(head_seq, server_pending)
        # Answers the server no longer waits for were taken (the ack was
        # lost) or their turn ended: drop them; send the others again.
        for call_id in [c for c in self._answers if c not in server_pending]:
            del self._answers[call_id]
        waiters, self._attach_waiters = self._attach_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        await self._flush()
        for call_id in list(self._answers):
            await self._send_answer(call_id)
        self._check_tools()
        self._notify()

    async def _on_message_reply(self, out: _Outgoing, frame: dict[str, Any]) -> None:
        if frame.get("type") == "ack":
            if out in self._outbox:
                self._outbox.remove(out)
            seq = frame.get("seq")
            if not out.future.done() and isinstance(seq, int):
                out.future.set_result(Ack(seq, frame.get("duplicate") is True))
            return
        if frame.get("type") != "error":
            return
        if frame.get("code") == "not_attached":
            # Detached in the meantime (user limit, close): attach, resend.
            out.sent = False
            self.attached = False
            await self._flush()
            return
        if out in self._outbox:
            self._outbox.remove(out)
        if not out.future.done():
            out.future.set_exception(ServerError(str(frame.get("code")), str(frame.get("message")), self.id))

    async def _on_tool_reply(self, call_id: str, frame: dict[str, Any]) -> None:
        answer = self._answers.get(call_id)
        if frame.get("type") == "ack" or frame.get("code") == "unknown_call":
            # Recorded, or answered first elsewhere, or its turn is over.
            self._answers.pop(call_id, None)
            return
        if frame.get("type") != "error" or answer is None:
            return
        if frame.get("code") == "not_attached":
            answer.sent = False
            return
        self._answers.pop(call_id, None)
        self._client._report(ServerError(str(frame.get("code")), str(frame.get("message")), self.id))

    async def _frame(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if kind == "event":
            await self._on_event(frame)
        elif kind == "detached":
            await self._on_detached(frame)
        elif kind == "error":
            self._client._report(ServerError(str(frame.get("code")), str(frame.get("message")), self.id))

    async def _on_detached(self, frame: dict[str, Any]) -> None:
        self.attached = False
        reason = str(frame.get("reason") or "")
        if reason == "client":
            self._notify()
            return
        if reason == "moved":
            # Another node owns it now: attach again (protocol section 10).
            await self._send_attach()
            return
        self._want_attached = False
        self.detach_reason = reason
        for out in [o for o in self._outbox if o.sent]:
            # Its ack, if any, came before this frame: not recorded.
            self._outbox.remove(out)
            if not out.future.done():
                out.future.set_exception(Detached(self.id, reason))
        self._notify()

    async def _on_event(self, frame: dict[str, Any]) -> None:
        ev = Event.from_frame(frame)
        if ev is None or not self.attached:
            return
        outcome = self.transcript.apply(ev)
        if outcome is Applied.DUPLICATE:
            return
        if outcome is Applied.GAP:
            self._client._report(
                SeqGap(f"{self.id}: got seq {ev.seq} after {self.transcript.last_seq}; attaching again")
            )
            await self._resync()
            return
        if ev.kind == "tool_result":
            call_id = ev.data.get("call_id")
            if isinstance(call_id, str):
                self._answers.pop(call_id, None)
        for listener in list(self._listeners):
            try:
                result = listener(ev)
                if inspect.isawaitable(result):
                    await result
            except Exception as e:  # an application callback: report, go on
                self._client._report(e)
        self._client.seq_store.set(self.id, self.transcript.last_seq)
        self._check_tools()
        self._notify()

    async def _resync(self) -> None:
        self.attached = False
        await self._client._send({"type": "detach", "conversation_id": self.id})
        await self._send_attach()

    # ---- client tool calls ----

    def _check_tools(self) -> None:
        """Starts the handler for pending client calls once the replay has
        caught up (a call that looks pending mid-replay may be answered or
        expired a few events later)."""
        att = self._attachment
        if not self.attached or self.transcript.last_seq < att.head_seq:
            return
        if self._tool_handler is None or self.mode != "control":
            return
        if not att.tools_checked:
            att.tools_checked = True
            unknown = att.server_pending - {c.call_id for c in self.pending_calls}
            if unknown:
                self._spawn(self._recover_calls(unknown))
        for call in self.pending_calls:
            self._start_tool(call)

    def _start_tool(self, call: ToolCall) -> None:
        if call.call_id not in self._tool_tasks and call.call_id not in self._answers:
            self._tool_tasks[call.call_id] = asyncio.get_running_loop().create_task(self._run_tool(call))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _recover_calls(self, unknown: set[str]) -> None:
        """Pending calls made before this client's history began (it resumed
        from a persisted seq): their `tool_call` events come from REST."""
        after = 0
        try:
            while unknown:
                events, head = await self._client.rest.events(self.id, after)
                for ev in events:
                    call_id = ev.data.get("call_id")
                    if ev.kind == "tool_call" and call_id in unknown and ev.data.get("target") == "client":
                        unknown.discard(str(call_id))
                        d = ev.data
                        call = ToolCall(
                            ev.seq,
                            ev.turn_id or "",
                            str(call_id),
                            str(d.get("name") or ""),
                            d.get("args", {}),
                            "client",
                        )
                        self._start_tool(call)
                if not events or events[-1].seq >= head:
                    break
                after = events[-1].seq
        except LingerError as e:
            self._client._report(e)
            return
        except OSError as e:
            self._client._report(LingerError(f"{self.id}: cannot read the history of pending tool calls: {e}"))
            return
        if unknown:
            self._client._report(
                LingerError(f"{self.id}: pending tool calls {sorted(unknown)} not found in the history")
            )

    async def _run_tool(self, call: ToolCall) -> None:
        handler = self._tool_handler
        if handler is None:
            return
        try:
            result = handler(call)
            if inspect.isawaitable(result):
                result = await result
            answer = _Answer(result, False)
        except ToolError as e:
            answer = _Answer(e.output, True)
        except Exception as e:
            self._client._report(e)
            answer = _Answer({"error": f"{type(e).__name__}: {e}"}, True)
        # Answered elsewhere, or its turn ended, while the handler ran (for
        # a call recovered from REST the server says so: `unknown_call`).
        if not call.pending or self._ended is not None:
            return
        self._answers[call.call_id] = answer
        await self._send_answer(call.call_id)
