"""The client against a real linger behind a proxy the tests cut: a turn
streamed across a dropped socket, a message whose ack was lost, and client
tool calls answered across a reconnect."""

from __future__ import annotations

import asyncio
from typing import Any

from conftest import Proxy, Server, poll, within

from linger_client import (
    AssistantText,
    ConnectionState,
    Event,
    LingerClient,
    StateChange,
    ToolCall,
    UserMessage,
)


def tokens(n: int) -> str:
    return "".join(f"tok{i} " for i in range(1, n + 1))


async def wait_state(client: LingerClient, state: ConnectionState) -> None:
    seen = asyncio.get_running_loop().create_future()

    def listener(change: StateChange) -> None:
        if change.state is state and not seen.done():
            seen.set_result(None)

    remove = client.on_state(listener)
    try:
        if client.state is not state:
            await within(seen, f"connection state {state.value}")
    finally:
        remove()


async def test_socket_dropped_mid_turn_resumes_without_gap_or_duplicate(
    client: LingerClient, proxy: Proxy, server: Server
) -> None:
    states: list[ConnectionState] = []
    client.on_state(lambda change: states.append(change.state))
    seen: list[Event] = []
    conv = await within(client.create(title="drop", on_event=seen.append), "created")

    ack = await within(conv.send("/stream 40 30"), "the ack")
    await within(conv.wait_until(lambda t: sum(e.kind == "text_delta" for e in seen) >= 5), "five deltas")

    proxy.cut()
    await wait_state(client, ConnectionState.RECONNECTING)
    # The socket is gone, the agent is not: its status is still the turn's.
    assert conv.status == "running"
    assert not conv.attached

    # Let the turn move on without us, so the re-attach has something to replay.
    last_seen = conv.last_seq
    await poll(
        lambda: _events_after(server, conv.id, last_seen, 3),
        "events recorded while the client was away",
    )
    proxy.heal()
    turn = await within(conv.wait_turn(ack.seq), "the end of the turn")
    await wait_state(client, ConnectionState.CONNECTED)

    assert turn.status == "completed"
    assert turn.text == tokens(40)
    assert ConnectionState.RECONNECTING in states
    seqs = [e.seq for e in seen]
    assert seqs == list(range(1, seqs[-1] + 1)), "every seq once, in order"
    assert "".join(e.data["text"] for e in seen if e.kind == "text_delta") == tokens(40)
    stored = await server.events(conv.id)
    assert [(e["seq"], e["kind"]) for e in stored[: len(seen)]] == [(e.seq, e.kind) for e in seen]

    replies = [i for i in conv.transcript.items if isinstance(i, AssistantText)]
    assert [(r.text, r.final) for r in replies] == [(tokens(40), True)]
    assert [i.text for i in conv.transcript.items if isinstance(i, UserMessage)] == ["/stream 40 30"]
    assert client.seq_store.get(conv.id) == conv.last_seq


async def _events_after(server: Server, conversation_id: str, seq: int, count: int) -> bool:
    return len([e for e in await server.events(conversation_id) if e["seq"] > seq]) >= count


async def _recorded(server: Server, conversation_id: str, text: str) -> list[dict[str, Any]]:
    return [
        e for e in await server.events(conversation_id) if e["kind"] == "user_message" and e["data"]["text"] == text
    ]


async def test_unacked_message_is_resent_and_acked_once(client: LingerClient, proxy: Proxy, server: Server) -> None:
    conv = await within(client.create(title="resend"), "created")
    await within(conv.wait_until(lambda t: t.status == "idle"), "the agent started")

    # The message reaches the server; its ack does not reach the client.
    proxy.freeze_downstream()
    first = asyncio.create_task(conv.send("hello there"))
    recorded = await poll(lambda: _recorded(server, conv.id, "hello there"), "the message recorded")
    assert not first.done()
    assert conv.unacked == ["hello there"]

    proxy.cut()
    await wait_state(client, ConnectionState.RECONNECTING)
    # Sent while the socket is down: kept until the re-attach.
    second = asyncio.create_task(conv.send("and again"))
    await asyncio.sleep(0)
    proxy.heal()

    ack1 = await within(first, "the first ack")
    ack2 = await within(second, "the second ack")
    assert ack1.duplicate, "the resend found the message already recorded"
    assert ack1.seq == recorded[0]["seq"]
    assert not ack2.duplicate
    assert ack2.seq > ack1.seq
    await within(conv.wait_turn(ack2.seq), "the second turn")
    assert conv.unacked == []

    assert len(await _recorded(server, conv.id, "hello there")) == 1
    assert len(await _recorded(server, conv.id, "and again")) == 1
    users = [(i.seq, i.text) for i in conv.transcript.items if isinstance(i, UserMessage)]
    assert users == [(ack1.seq, "hello there"), (ack2.seq, "and again")]
    replies = [i.text for i in conv.transcript.items if isinstance(i, AssistantText)]
    assert replies == ["hello there", "and again"]


async def test_tool_call_answered_after_a_reconnect(client: LingerClient, proxy: Proxy, server: Server) -> None:
    conv = await within(client.create(title="tools"), "created")
    calls: list[ToolCall] = []
    called = asyncio.Event()
    release = asyncio.Event()

    async def weather(call: ToolCall) -> Any:
        calls.append(call)
        called.set()
        await release.wait()
        return {"temp": 21, "city": call.args["city"]}

    conv.on_tool_call(weather)
    ack = await within(conv.send('/ask weather {"city":"Paris"}'), "the ack")
    await within(called.wait(), "the tool call")

    # The answer is ready only once the socket is gone: it waits for the
    # re-attach, where `pending_calls` still lists the call.
    proxy.cut()
    await wait_state(client, ConnectionState.RECONNECTING)
    release.set()
    await asyncio.sleep(0)
    assert conv.status == "waiting"
    proxy.heal()

    turn = await within(conv.wait_turn(ack.seq), "the end of the turn")
    assert turn.status == "completed"
    assert turn.text == 'weather returned {"city":"Paris","temp":21}'
    assert len(calls) == 1, "the handler ran once"
    stored = await server.events(conv.id)
    results = [e for e in stored if e["kind"] == "tool_result"]
    assert len(results) == 1
    assert results[0]["data"]["output"] == {"temp": 21, "city": "Paris"}


async def test_tool_call_made_while_away_is_answered_on_reattach(
    client: LingerClient, proxy: Proxy, server: Server
) -> None:
    conv = await within(client.create(title="away"), "created")
    await within(conv.wait_until(lambda t: t.status == "idle"), "the agent started")
    calls: list[str] = []

    def confirm(call: ToolCall) -> Any:
        calls.append(call.call_id)
        return {"ok": True}

    conv.on_tool_call(confirm)
    # The client hears nothing from here: the call is made while it is
    # effectively away, and it learns of it from the replay.
    proxy.freeze_downstream()
    sent = asyncio.create_task(conv.send("/ask confirm"))

    async def call_recorded() -> bool:
        return any(e["kind"] == "tool_call" for e in await server.events(conv.id))

    await poll(call_recorded, "the tool call recorded")
    assert calls == []
    proxy.cut()
    await wait_state(client, ConnectionState.RECONNECTING)
    proxy.heal()

    ack = await within(sent, "the ack")
    turn = await within(conv.wait_turn(ack.seq), "the end of the turn")
    assert turn.text == 'confirm returned {"ok":true}'
    assert len(calls) == 1
