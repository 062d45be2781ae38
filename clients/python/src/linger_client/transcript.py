"""A conversation's transcript, rebuilt from its events only, in seq order.

An event whose seq is not above the last one applied is a duplicate and is
ignored, so a replay after a reconnect never shows anything twice. An event
that skips seqs is a gap and is refused (the conversation re-attaches),
except where the protocol allows one: the start of a replay whose older
history was deleted (`replay_incomplete`), and, in a compact replay
(protocol section 11), the omitted `text_delta` events of finished turns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeAlias

# agent_stopped and detached reasons (protocol section 4), in plain words.
_STOP_WORDS = {
    "idle": "it was idle for a while",
    "user_limit": "too many conversations",
    "closed": "it was closed",
    "shutdown": "server restart",
    "restart_recovery": "server restart",
    "deleted": "it was deleted",
    "node_lost": "its server went away",
    "client": "you detached",
    "moved": "it moved to another server",
}


def reason_words(reason: str | None) -> str:
    """An `agent_stopped` or `detached` reason in plain words."""
    if not reason:
        return "unknown reason"
    return _STOP_WORDS.get(reason, reason.replace("_", " "))


@dataclass(frozen=True)
class Event:
    """One sequenced event (protocol section 4)."""

    conversation_id: str
    seq: int
    kind: str
    data: dict[str, Any]
    ts: str = ""

    @classmethod
    def from_frame(cls, frame: dict[str, Any]) -> Event | None:
        """The event of an `event` frame (or a REST history entry), or None
        when the frame is not a well-formed event."""
        seq = frame.get("seq")
        cid = frame.get("conversation_id")
        kind = frame.get("kind")
        data = frame.get("data")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
            return None
        if not isinstance(cid, str) or not isinstance(kind, str):
            return None
        return cls(cid, seq, kind, data if isinstance(data, dict) else {}, str(frame.get("ts") or ""))

    @property
    def turn_id(self) -> str | None:
        t = self.data.get("turn_id")
        return t if isinstance(t, str) else None


@dataclass
class UserMessage:
    seq: int
    text: str
    client_msg_id: str | None


@dataclass
class AssistantText:
    """A reply: streamed `text_delta`s until `final`, then the turn's whole
    `assistant_message` text, which replaces what was streamed."""

    turn_id: str
    text: str
    final: bool = False


@dataclass
class ToolCall:
    seq: int
    turn_id: str
    call_id: str
    name: str
    args: Any
    target: str
    answered: bool = False
    output: Any = None
    is_error: bool = False
    # Its turn ended before an answer: it can no longer be answered.
    expired: bool = False

    @property
    def pending(self) -> bool:
        return self.target == "client" and not self.answered and not self.expired


@dataclass
class Note:
    """Something that happened to the conversation rather than in it."""

    seq: int
    text: str
    bad: bool = False


Item: TypeAlias = UserMessage | AssistantText | ToolCall | Note


@dataclass
class Turn:
    turn_id: str
    message_seq: int | None
    # running, then the turn_finished status: completed, failed, stopped,
    # abandoned, interrupted.
    status: str = "running"
    text: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.status != "running"


class Applied(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    GAP = "gap"


_TURN_END_NOTES = {
    "failed": "The turn failed",
    "stopped": "Turn stopped.",
    "abandoned": "Turn abandoned: nobody was attached for too long.",
    "interrupted": "Turn interrupted by a server restart.",
}


@dataclass
class Transcript:
    conversation_id: str
    last_seq: int = 0
    items: list[Item] = field(default_factory=list)
    title: str = ""
    # running, waiting, idle, stopped; None until known.
    status: str | None = None
    stop_reason: str | None = None
    turns: dict[str, Turn] = field(default_factory=dict)
    # The turn between its turn_started and turn_finished, if any.
    open_turn: str | None = None
    # A compact replay runs up to this seq (inclusive); 0 when none.
    _compact_until: int = 0
    # A replay that starts after deleted history may begin inside a turn
    # this transcript never saw start.
    _turn_unknown: bool = False
    _was_stopped: bool = False
    # Indexes, so that per-event checks do not scan the items.
    _calls: dict[str, ToolCall] = field(default_factory=dict)
    _pending: dict[str, ToolCall] = field(default_factory=dict)
    # Replies still streaming, per turn (more than one when a tool call
    # came between deltas).
    _streaming: dict[str, list[AssistantText]] = field(default_factory=dict)
    _turn_of_message: dict[int, str] = field(default_factory=dict)

    def begin_replay(self, replay_from: int, head_seq: int, compact: bool) -> None:
        """Called on `attached`: what the replay that follows may skip."""
        if replay_from > self.last_seq + 1:
            self.items.append(Note(replay_from, "Older history was deleted by retention."))
            self.last_seq = replay_from - 1
            self._turn_unknown = True
        self._compact_until = head_seq if compact else 0

    def gap_allowed(self, ev: Event) -> bool:
        if ev.seq > self._compact_until or ev.kind == "text_delta":
            return False
        if self.open_turn is None and not self._turn_unknown:
            return False
        # Only the deltas of the open turn were left out: what follows them
        # belongs to that turn, or is a message queued while it ran.
        return ev.kind == "user_message" or self._turn_unknown or ev.turn_id == self.open_turn

    def apply(self, ev: Event) -> Applied:
        if ev.seq <= self.last_seq:
            return Applied.DUPLICATE
        if ev.seq != self.last_seq + 1 and not self.gap_allowed(ev):
            return Applied.GAP
        self.last_seq = ev.seq
        self._apply(ev)
        return Applied.APPLIED

    # ---- views ----

    def pending_calls(self) -> list[ToolCall]:
        return list(self._pending.values())

    def tool_call(self, call_id: str) -> ToolCall | None:
        return self._calls.get(call_id)

    def turn_for_message(self, message_seq: int) -> Turn | None:
        tid = self._turn_of_message.get(message_seq)
        return self.turns.get(tid) if tid is not None else None

    def text(self) -> str:
        """The transcript as plain text, one item a line."""
        lines = []
        for i in self.items:
            if isinstance(i, UserMessage):
                lines.append(f"> {i.text}")
            elif isinstance(i, AssistantText):
                lines.append(i.text)
            elif isinstance(i, ToolCall):
                state = "pending" if i.pending else "expired" if i.expired else f"-> {i.output!r}"
                lines.append(f"[tool {i.name} {i.args!r} {state}]")
            else:
                lines.append(f"[{i.text}]")
        return "\n".join(lines)

    # ---- the events ----

    def _apply(self, ev: Event) -> None:
        d = ev.data
        kind = ev.kind
        if kind == "conversation_created":
            self.title = str(d.get("title") or "")
        elif kind == "agent_started":
            if self._was_stopped:
                self.items.append(Note(ev.seq, "Resumed."))
            self._was_stopped = False
            self.status = "idle"
            self.stop_reason = None
        elif kind == "user_message":
            cmid = d.get("client_msg_id")
            self.items.append(UserMessage(ev.seq, str(d.get("text") or ""), cmid if isinstance(cmid, str) else None))
        elif kind == "turn_started":
            tid = ev.turn_id or f"?{ev.seq}"
            mseq = d.get("message_seq")
            self.turns[tid] = Turn(tid, mseq if isinstance(mseq, int) else None)
            if isinstance(mseq, int):
                self._turn_of_message[mseq] = tid
            self.open_turn = tid
            self._turn_unknown = False
            self.status = "running"
        elif kind == "text_delta":
            self._delta(ev.turn_id or "", str(d.get("text") or ""))
        elif kind == "assistant_message":
            self._reply(ev.turn_id or "", str(d.get("text") or ""))
        elif kind == "tool_call":
            target = str(d.get("target") or "")
            call = ToolCall(
                ev.seq,
                ev.turn_id or "",
                str(d.get("call_id") or ""),
                str(d.get("name") or ""),
                d.get("args", {}),
                target,
            )
            self.items.append(call)
            self._calls[call.call_id] = call
            if target == "client":
                self._pending[call.call_id] = call
                self.status = "waiting"
        elif kind == "tool_result":
            call_id = str(d.get("call_id") or "")
            self._pending.pop(call_id, None)
            answered = self._calls.get(call_id)
            if answered is not None:
                answered.answered = True
                answered.output = d.get("output")
                answered.is_error = bool(d.get("is_error"))
            if self.status == "waiting" and not self._pending:
                self.status = "running"
        elif kind == "turn_finished":
            self._turn_finished(ev)
        elif kind == "agent_stopped":
            self.status = "stopped"
            self._was_stopped = True
            self.open_turn = None
            reason = d.get("reason")
            self.stop_reason = reason if isinstance(reason, str) else None
            self.items.append(Note(ev.seq, f"Stopped: {reason_words(self.stop_reason)}."))
        # Kinds this client does not know yet change nothing.

    def _delta(self, turn_id: str, text: str) -> None:
        last = self.items[-1] if self.items else None
        if isinstance(last, AssistantText) and last.turn_id == turn_id and not last.final:
            last.text += text
        else:
            item = AssistantText(turn_id, text)
            self.items.append(item)
            self._streaming.setdefault(turn_id, []).append(item)

    def _reply(self, turn_id: str, text: str) -> None:
        streamed = self._streaming.pop(turn_id, [])
        keep = streamed.pop() if streamed else None
        for i in streamed:
            self.items.remove(i)
        if keep is not None and self.items and keep is self.items[-1]:
            keep.text = text
            keep.final = True
        else:
            if keep is not None:
                self.items.remove(keep)
            self.items.append(AssistantText(turn_id, text, final=True))
        # A turn that began before this transcript's history is known from here.
        self.turns.setdefault(turn_id, Turn(turn_id, None)).text = text

    def _turn_finished(self, ev: Event) -> None:
        d = ev.data
        tid = ev.turn_id or ""
        status = str(d.get("status") or "completed")
        error = d.get("error")
        turn = self.turns.setdefault(tid, Turn(tid, None))
        turn.status = status
        turn.error = error if isinstance(error, str) else None
        if self.open_turn == tid:
            self.open_turn = None
        self.status = "idle"
        for item in self._streaming.pop(tid, []):
            item.final = True
        for call in [c for c in self._pending.values() if c.turn_id == tid]:
            # Its turn is over: the call can no longer be answered.
            call.expired = True
            del self._pending[call.call_id]
        note = _TURN_END_NOTES.get(status)
        if note:
            text = f"{note}: {turn.error}" if status == "failed" and turn.error else note
            self.items.append(Note(ev.seq, text, bad=status == "failed"))
