"""The transcript's seq rules without a server: duplicates ignored, gaps
refused except where the protocol allows them."""

from __future__ import annotations

import random

from linger_client import Applied, AssistantText, Backoff, Event, Transcript

CID = "c_test"


def ev(seq: int, kind: str, **data: object) -> Event:
    return Event(CID, seq, kind, dict(data))


def finished_turn(start: int, turn: str, words: list[str]) -> list[Event]:
    """turn_started, one delta per word, assistant_message, turn_finished."""
    out = [ev(start, "turn_started", turn_id=turn, message_seq=start - 1)]
    for i, w in enumerate(words):
        out.append(ev(start + 1 + i, "text_delta", turn_id=turn, text=w))
    n = start + 1 + len(words)
    out.append(ev(n, "assistant_message", turn_id=turn, text="".join(words)))
    out.append(ev(n + 1, "turn_finished", turn_id=turn, status="completed"))
    return out


def history() -> list[Event]:
    head = [
        ev(1, "conversation_created", user="alice", title="t"),
        ev(2, "agent_started", reason="created"),
        ev(3, "user_message", text="hi there", client_msg_id=None),
    ]
    return head + finished_turn(4, "t1", ["hi ", "there"])


def test_duplicates_are_ignored_and_text_is_whole() -> None:
    t = Transcript(CID)
    events = history()
    for e in events[:5]:
        assert t.apply(e) is Applied.APPLIED
    for e in events:
        t.apply(e)
    assert t.last_seq == events[-1].seq
    replies = [i for i in t.items if isinstance(i, AssistantText)]
    assert [(r.text, r.final) for r in replies] == [("hi there", True)]
    assert t.turns["t1"].status == "completed"
    assert t.status == "idle"


def test_a_gap_is_refused_without_compact() -> None:
    t = Transcript(CID)
    events = history()
    t.begin_replay(1, events[-1].seq, compact=False)
    for e in events[:4]:
        t.apply(e)
    # The deltas (seq 5, 6) missing: refused, nothing applied.
    assert t.apply(events[6]) is Applied.GAP
    assert t.last_seq == 4


def test_compact_replay_may_skip_deltas_of_finished_turns_only() -> None:
    events = history() + [ev(9, "user_message", text="more", client_msg_id=None)]
    events += [ev(10, "turn_started", turn_id="t2", message_seq=9), ev(11, "text_delta", turn_id="t2", text="mo")]
    compact = [e for e in events if not (e.kind == "text_delta" and e.data["turn_id"] == "t1")]
    t = Transcript(CID)
    t.begin_replay(1, 11, compact=True)
    for e in compact:
        assert t.apply(e) is Applied.APPLIED, e
    assert [i.text for i in t.items if isinstance(i, AssistantText)] == ["hi there", "mo"]
    # Live events after the replay must be contiguous again.
    assert t.apply(ev(13, "text_delta", turn_id="t2", text="re")) is Applied.GAP


def test_compact_replay_refuses_a_gap_outside_a_turn_or_before_a_delta() -> None:
    t = Transcript(CID)
    t.begin_replay(1, 20, compact=True)
    t.apply(ev(1, "conversation_created", user="alice", title="t"))
    assert t.apply(ev(3, "user_message", text="x", client_msg_id=None)) is Applied.GAP
    t.apply(ev(2, "agent_started", reason="created"))
    t.apply(ev(3, "user_message", text="x", client_msg_id=None))
    t.apply(ev(4, "turn_started", turn_id="t1", message_seq=3))
    assert t.apply(ev(6, "text_delta", turn_id="t1", text="y")) is Applied.GAP
    assert t.apply(ev(6, "assistant_message", turn_id="t2", text="y")) is Applied.GAP
    assert t.apply(ev(6, "assistant_message", turn_id="t1", text="y")) is Applied.APPLIED


def test_deleted_history_starts_the_replay_later() -> None:
    t = Transcript(CID)
    t.begin_replay(50, 60, compact=False)
    assert t.last_seq == 49
    assert t.apply(ev(50, "text_delta", turn_id="t9", text="x")) is Applied.APPLIED


def test_backoff_grows_with_jitter_and_stays_capped() -> None:
    b = Backoff(initial=1.0, maximum=8.0, rng=random.Random(7))
    for attempt, step in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (10, 8.0), (100, 8.0)]:
        for _ in range(20):
            d = b.delay(attempt)
            assert step / 2 <= d <= step
