"""The connection's state kept apart from the agent's, refused tokens,
unknown conversations, and resuming from a persisted seq."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Proxy, Server, spawn_server, within

from linger_client import (
    ConnectionState,
    Event,
    JsonFileSeqStore,
    LingerClient,
    MemorySeqStore,
    Note,
    ServerError,
    ToolCall,
    Unauthorized,
)


async def test_a_refused_token_stops_retrying(server: Server) -> None:
    client = LingerClient(server.http_url, token="")
    with pytest.raises(Unauthorized):
        await within(client.connect(), "the refusal")
    assert client.state is ConnectionState.UNAUTHORIZED
    await client.close()


async def test_a_stopped_agent_is_not_a_lost_connection(client: LingerClient) -> None:
    conv = await within(client.create(title="close me"), "created")
    await within(conv.wait_until(lambda t: t.status == "idle"), "the agent started")
    await within(conv.close(), "the close ack")
    await within(conv.wait_until(lambda t: t.status == "stopped" and not conv.attached), "the stop")
    assert conv.stop_reason == "closed"
    assert conv.detach_reason == "closed"
    assert client.state is ConnectionState.CONNECTED

    # Sending resumes it.
    ack = await within(conv.send("back again"), "the ack")
    turn = await within(conv.wait_turn(ack.seq), "the turn")
    assert turn.text == "back again"
    assert conv.status == "idle"
    assert any(isinstance(i, Note) and i.text == "Resumed." for i in conv.transcript.items)


async def test_opening_an_unknown_conversation_fails(client: LingerClient) -> None:
    with pytest.raises(ServerError) as e:
        await within(client.open("c_does_not_exist"), "the error")
    assert e.value.code == "not_found"
    assert client.conversation("c_does_not_exist") is None


async def test_a_new_process_resumes_after_the_persisted_seq(proxy: Proxy, tmp_path: Path) -> None:
    store_path = tmp_path / "seqs.json"
    async with LingerClient(proxy.http_url, token="alice", seq_store=JsonFileSeqStore(store_path)) as first:
        conv = await within(first.create(title="persisted"), "created")
        ack = await within(conv.send("one two"), "the ack")
        await within(conv.wait_turn(ack.seq), "the first turn")
        last = conv.last_seq
        cid = conv.id

    seen: list[Event] = []
    async with LingerClient(proxy.http_url, token="alice", seq_store=JsonFileSeqStore(store_path)) as second:
        conv = await within(second.open(cid, on_event=seen.append), "attached")
        assert conv.last_seq == last
        ack = await within(conv.send("three"), "the ack")
        await within(conv.wait_turn(ack.seq), "the second turn")
    assert seen[0].seq == last + 1, "nothing already processed comes again"
    assert [e.seq for e in seen] == list(range(last + 1, last + 1 + len(seen)))


async def test_a_server_crash_is_resumed_and_told_apart(server: Server, proxy: Proxy, client: LingerClient) -> None:
    seen: list[Event] = []
    conv = await within(client.create(title="crash", on_event=seen.append), "created")
    ack = await within(conv.send("/stream 200 50"), "the ack")
    await within(conv.wait_until(lambda t: sum(e.kind == "text_delta" for e in seen) >= 3), "three deltas")

    await server.kill()
    await within(conv.wait_until(lambda t: not conv.attached), "the socket lost")
    assert client.state is not ConnectionState.CONNECTED
    assert conv.status == "running", "a lost socket says nothing about the agent"

    # The same store on a new port: the crash recovery closes the turn.
    restarted = await spawn_server(server.store)
    try:
        proxy.retarget(restarted.host, restarted.port)
        turn = await within(conv.wait_turn(ack.seq), "the interrupted turn")
        assert turn.status == "interrupted"
        await within(conv.wait_until(lambda t: t.status == "idle"), "the agent back")
        assert client.connected
        kinds = [e.kind for e in seen[-3:]]
        assert kinds == ["turn_finished", "agent_stopped", "agent_started"]
        assert seen[-2].data["reason"] == "restart_recovery"
        seqs = [e.seq for e in seen]
        assert seqs == list(range(1, seqs[-1] + 1))

        ack = await within(conv.send("still here"), "the ack after the crash")
        assert (await within(conv.wait_turn(ack.seq), "a new turn")).text == "still here"
    finally:
        await restarted.kill()


async def test_a_compact_open_rebuilds_the_same_transcript(client: LingerClient, proxy: Proxy) -> None:
    conv = await within(client.create(title="compact"), "created")
    ack = await within(conv.send("/stream 12 5"), "the ack")
    await within(conv.wait_turn(ack.seq), "the turn")

    async with LingerClient(proxy.http_url, token="alice") as other:
        seen: list[Event] = []
        again = await within(other.open(conv.id, compact=True, on_event=seen.append), "attached")
        await within(again.wait_until(lambda t: t.last_seq >= conv.last_seq), "the replay")
        assert again.transcript.text() == conv.transcript.text()
        assert seen[-1].seq == conv.last_seq


async def test_a_new_process_answers_a_call_made_before_its_history(proxy: Proxy) -> None:
    seqs = MemorySeqStore()
    async with LingerClient(proxy.http_url, token="alice", seq_store=seqs) as first:
        conv = await within(first.create(title="orphan"), "created")
        ack = await within(conv.send('/ask lookup {"id":7}'), "the ack")
        await within(conv.wait_until(lambda t: t.status == "waiting"), "the tool call")
        cid = conv.id
    # The first process is gone without answering; the next one knows only
    # the seq it reached, not the call: the server's pending_calls and the
    # REST history tell it.
    answered: list[object] = []

    def lookup(call: ToolCall) -> object:
        answered.append(call.args)
        return {"found": call.args["id"]}

    async with LingerClient(proxy.http_url, token="alice", seq_store=seqs) as second:
        conv = await within(second.open(cid, on_tool_call=lookup), "attached")
        # Its turn began before this client's history: known by its end.
        await within(conv.wait_until(lambda t: t.status == "idle"), "the end of the turn")
        (turn,) = conv.transcript.turns.values()
        assert (turn.status, turn.text) == ("completed", 'lookup returned {"found":7}')
        assert ack.seq < conv.transcript.last_seq
    assert answered == [{"id": 7}]
    summaries = await second.rest.list_conversations()
    assert [s.id for s in summaries] == [cid]
