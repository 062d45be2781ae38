"""Fixtures: a real linger server started per test, and a TCP proxy in front
of it that a test can cut (every connection dropped at once, no close frame,
as when a network goes away) or freeze in one direction."""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from linger_client import Backoff, LingerClient

REPO = Path(__file__).resolve().parents[3]
# A bound for waits that should end at once: a failing test fails instead
# of hanging. Never an expectation on speed.
WAIT = 30.0

T = TypeVar("T")


def linger_binary() -> Path:
    explicit = os.environ.get("LINGER_BIN")
    path = Path(explicit) if explicit else REPO / "target" / "release" / "linger"
    if not path.is_file():
        pytest.fail(f"no linger binary at {path}: build it (cargo build --release) or set LINGER_BIN")
    return path


@dataclass
class Server:
    process: asyncio.subprocess.Process
    host: str
    port: int
    store: Path
    log: list[str] = field(default_factory=list)
    drain: asyncio.Task[None] | None = None

    async def kill(self) -> None:
        """SIGKILL, as in a crash."""
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()
        if self.drain is not None:
            await self.drain

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _get(self, path: str, token: str) -> Any:
        req = urllib.request.Request(self.http_url + path, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=WAIT) as resp:
            return json.loads(resp.read())

    async def events(self, conversation_id: str, token: str = "alice") -> list[dict[str, Any]]:
        """The conversation's whole stored history, over REST."""
        out: list[dict[str, Any]] = []
        after = 0
        while True:
            page = await asyncio.to_thread(
                self._get, f"/v1/conversations/{conversation_id}/events?after={after}&limit=500", token
            )
            out.extend(page["events"])
            if not page["events"]:
                return out
            after = page["events"][-1]["seq"]


async def _drain(stream: asyncio.StreamReader, log: list[str], ready: asyncio.Future[tuple[str, int]]) -> None:
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        log.append(text)
        m = re.search(r"listening on (\S+):(\d+)", text)
        if m and not ready.done():
            ready.set_result((m.group(1).strip("[]"), int(m.group(2))))
    if not ready.done():
        ready.set_exception(RuntimeError("linger exited before listening:\n" + "\n".join(log)))


async def spawn_server(store: Path) -> Server:
    """Starts `linger serve` on a free port with its store in `store` and
    waits for `listening on ADDR`."""
    store.mkdir(parents=True, exist_ok=True)
    config = store / "linger-test.toml"
    config.write_text(f'[server]\nlisten = "127.0.0.1:0"\n[store]\npath = {json.dumps(str(store))}\n')
    env = {**os.environ, "LINGER_LOG": "info", "NO_COLOR": "1"}
    process = await asyncio.create_subprocess_exec(
        str(linger_binary()),
        "serve",
        "--config",
        str(config),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    log: list[str] = []
    ready: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
    assert process.stderr is not None
    drain = asyncio.create_task(_drain(process.stderr, log, ready))
    try:
        host, port = await asyncio.wait_for(ready, WAIT)
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return Server(process, host, port, store, log, drain)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    s = await spawn_server(tmp_path / "store")
    try:
        yield s
    finally:
        await s.kill()


class Proxy:
    """Forwards loopback TCP connections to the server."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._blocked = False
        self._downstream = asyncio.Event()
        self._downstream.set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._blocked:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        link = (writer, up_writer)
        self._links.add(link)
        for task in (
            asyncio.create_task(self._pump(reader, up_writer, None)),
            asyncio.create_task(self._pump(up_reader, writer, self._downstream)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gate: asyncio.Event | None) -> None:
        try:
            while data := await src.read(65536):
                if gate is not None:
                    await gate.wait()
                dst.write(data)
                await dst.drain()
            dst.close()
        except (OSError, ConnectionError):
            dst.transport.abort()

    def cut(self) -> None:
        """Drops every open connection (RST, no close frame) and refuses
        new ones until `heal`."""
        self._blocked = True
        for client_side, server_side in self._links:
            client_side.transport.abort()
            server_side.transport.abort()
        self._links.clear()
        for task in list(self._tasks):
            task.cancel()

    def freeze_downstream(self) -> None:
        """Holds back everything the server sends; the client's frames still
        reach the server."""
        self._downstream.clear()

    def retarget(self, host: str, port: int) -> None:
        """New connections go to another server (one restarted elsewhere)."""
        self._target = (host, port)

    def heal(self) -> None:
        self._blocked = False
        self._downstream.set()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
async def proxy(server: Server) -> AsyncIterator[Proxy]:
    p = Proxy(server.host, server.port)
    await p.start()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def client(proxy: Proxy) -> AsyncIterator[LingerClient]:
    """A client through the proxy, quick to retry (the tests cut often)."""
    c = LingerClient(proxy.http_url, token="alice", backoff=Backoff(initial=0.05, maximum=0.5))
    await asyncio.wait_for(c.connect(), WAIT)
    try:
        yield c
    finally:
        await c.close()


async def within(awaitable: Any, what: str) -> Any:
    """Awaits with the failure bound, naming what did not happen."""
    try:
        return await asyncio.wait_for(awaitable, WAIT)
    except (asyncio.TimeoutError, TimeoutError):
        pytest.fail(f"timed out waiting for {what}")


async def poll(check: Callable[[], Any], what: str) -> Any:
    """Polls an outside view (REST) until `check()` returns something true."""

    async def loop() -> Any:
        while True:
            result = await check()
            if result:
                return result
            await asyncio.sleep(0.02)

    return await within(loop(), what)
