// The client against a real linger behind a proxy the test cuts: a stream
// that survives a dropped socket (or a network gone silent) with no gap and
// no duplicate, a message whose ack was lost resent and acknowledged once,
// client tool calls answered after a reconnect, the connection's state kept
// apart from the agent's status, compact attach passed on, a new client
// resuming from the seq and transcript a store kept, and events the server
// sends in fragments arriving whole.

import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';

import { LingerClient, localStorageStore } from '../src/index.js';
import { startLinger } from './support/linger.js';
import { startProxy } from './support/proxy.js';
import { gate, until, within } from './support/wait.js';

// Short backoff: the tests wait for reconnects, not for the defaults.
const FAST = { backoff: { baseMs: 20, maxMs: 200 } };

// An injected constructor (as Node 20 without --experimental-websocket
// would need) that also records every frame the client sends.
const sent = [];
class RecordingWebSocket extends globalThis.WebSocket {
  static opened = 0;
  constructor(...args) {
    super(...args);
    RecordingWebSocket.opened += 1;
  }
  send(data) {
    sent.push(JSON.parse(data));
    super.send(data);
  }
}

let server;
let proxy;
const clients = [];

before(async () => {
  server = await startLinger('[conversations]\nmax_per_user = 0');
  proxy = await startProxy(server.addr);
});

after(async () => {
  clients.forEach((c) => c.disconnect());
  await proxy.stop();
  await server.stop();
});

// A client through the proxy (the one whose network the test cuts).
async function viaProxy(user) {
  const client = new LingerClient({ url: proxy.url, token: user, WebSocket: RecordingWebSocket, ...FAST });
  clients.push(client);
  await client.connect();
  return client;
}

// A second client straight to the server: the test's view of what the
// server did while the first one was cut off.
async function direct(user) {
  const client = new LingerClient({ url: server.url, token: user, ...FAST });
  clients.push(client);
  await client.connect();
  return client;
}

function streamText(n) {
  let s = '';
  for (let i = 1; i <= n; i += 1) s += `tok${i} `;
  return s;
}

function lastAssistant(conv) {
  const replies = conv.transcript.items.filter((i) => i.kind === 'assistant');
  return replies[replies.length - 1];
}

// Every event applied by the handle, in order.
function record(conv) {
  const seen = [];
  conv.onEvent((ev) => seen.push(ev));
  return seen;
}

async function watch(user, id) {
  const client = await direct(user);
  return client.open(id);
}

test('a stream survives a socket dropped mid-turn: no gap, no duplicate', async () => {
  const client = await viaProxy('alice');
  const conv = await client.create({ title: 'drop mid-turn' });
  const seen = record(conv);
  const watcher = await watch('alice', conv.id);
  const states = [];
  client.on('state', (s) => states.push(s));

  const whole = streamText(40);
  const ack = await conv.send('/stream 40 30');
  assert.equal(ack.duplicate, false);
  await until('the stream to start', () => lastAssistant(conv)?.text.includes('tok5 '), [[conv, 'event']]);

  proxy.cut();
  await until('the client to notice', () => client.state === 'reconnecting', [[client, 'state']]);
  assert.equal(conv.status, 'running', 'a dropped socket is not the agent stopping');
  assert.equal(conv.attached, false);
  // The turn goes on while the client is away.
  await until(
    'the turn to go on without the client',
    () => watcher.transcript.items.some((i) => i.kind === 'assistant' && i.text.includes('tok20 ')),
    [[watcher, 'event']],
  );
  proxy.heal();
  client.retryNow();
  await until('the whole reply', () => lastAssistant(conv)?.final, [[conv, 'event']]);

  assert.equal(lastAssistant(conv).text, whole);
  assert.ok(states.includes('reconnecting') && states.at(-1) === 'connected', `states: ${states}`);
  // Each seq once, in order, with no gap, and the same events as stored
  // (the first ones may have come before the listener was added).
  const seqs = seen.map((e) => e.seq);
  assert.ok(seqs[0] <= 3, `seqs: ${seqs}`);
  assert.deepEqual(
    seqs,
    seqs.map((_, i) => seqs[0] + i),
  );
  const stored = await client.events(conv.id, seqs[0] - 1);
  const upTo = stored.filter((e) => e.seq <= seqs.at(-1));
  assert.deepEqual(
    seen.map((e) => [e.seq, e.kind, e.data]),
    upTo.map((e) => [e.seq, e.kind, e.data]),
  );
  const deltas = seen.filter((e) => e.kind === 'text_delta').map((e) => e.data.text);
  assert.equal(deltas.join(''), whole, 'every token once');
  // The re-attach asked for what came after the last seq applied.
  const attaches = sent.filter((f) => f.type === 'attach' && f.conversation_id === conv.id);
  assert.equal(attaches.length, 1);
  assert.ok(attaches[0].last_seq > 0);
  assert.equal(conv.transcript.items.filter((i) => i.kind === 'user').length, 1);
});

test('a network gone silent is noticed by the heartbeat, and the stream resumes', async () => {
  const client = new LingerClient({
    url: proxy.url,
    token: 'ivan',
    WebSocket: RecordingWebSocket,
    ...FAST,
    heartbeat: { everyMs: 50, silenceMs: 400 },
    connectTimeoutMs: 1000,
  });
  clients.push(client);
  await client.connect();
  const conv = await client.create({ title: 'silent network' });
  await conv.send('/stream 30 30');
  await until('the stream to start', () => lastAssistant(conv)?.text.includes('tok5 '), [[conv, 'event']]);
  let why = null;
  client.on('state', (state, detail) => {
    if (state === 'reconnecting' && !why) why = detail.why;
  });
  // Nothing more reaches the client, and no close either.
  proxy.holdDownstream();
  await until('the heartbeat to give up', () => why, [[client, 'state']]);
  assert.equal(why, 'no answer from the server');
  assert.equal(conv.status, 'running');
  proxy.cut();
  proxy.heal();
  await until('the whole reply', () => lastAssistant(conv)?.final, [[conv, 'event']]);
  assert.equal(lastAssistant(conv).text, streamText(30));
});

test('a message whose ack was lost is resent and acknowledged once', async () => {
  const client = await viaProxy('bob');
  const conv = await client.create({ title: 'lost ack' });
  const watcher = await watch('bob', conv.id);
  await until('the agent to start', () => conv.status === 'idle', [[conv, 'status']]);

  proxy.holdDownstream();
  let settled = 0;
  const acked = conv.send('hello over a bad network').then((ack) => {
    settled += 1;
    return ack;
  });
  // The server recorded it; the client never heard.
  const stored = await until(
    'the message to be recorded',
    () => watcher.transcript.items.find((i) => i.kind === 'user' && i.text === 'hello over a bad network'),
    [[watcher, 'event']],
  );
  assert.equal(conv.outbox.length, 1, 'still unacknowledged');
  proxy.cut();
  proxy.heal();
  const ack = await within('the ack after the reconnect', acked);
  assert.equal(settled, 1);
  assert.equal(ack.seq, stored.seq);
  assert.equal(ack.duplicate, true, 'the server knew it by its client_msg_id');
  assert.equal(ack.clientMsgId, stored.clientMsgId);
  assert.equal(conv.outbox.length, 0);
  const sends = sent.filter((f) => f.type === 'message' && f.client_msg_id === ack.clientMsgId);
  assert.equal(sends.length, 2, 'sent, then sent again with the same client_msg_id');

  await until('the echo', () => lastAssistant(conv)?.final, [[conv, 'event']]);
  const events = await client.events(conv.id, 0);
  assert.equal(events.filter((e) => e.kind === 'user_message').length, 1, 'recorded once');
  assert.equal(events.filter((e) => e.kind === 'turn_started').length, 1, 'one turn');
  assert.deepEqual(
    conv.transcript.items.filter((i) => i.kind === 'user').map((i) => i.text),
    ['hello over a bad network'],
  );
});

test('a tool call is answered after a reconnect', async () => {
  const client = await viaProxy('carol');
  const conv = await client.create({ title: 'tool after reconnect' });
  const answer = gate();
  const called = gate();
  const calls = [];
  conv.onToolCall(async (call) => {
    calls.push(call);
    called.open();
    await answer.promise;
    return { temp: 21, city: call.args.city };
  });
  await conv.send('/ask weather {"city":"Paris"}');
  await within('the handler to be called', called.promise);
  assert.equal(conv.status, 'waiting');

  proxy.cut();
  await until('the client to notice', () => client.state === 'reconnecting', [[client, 'state']]);
  answer.open();
  proxy.heal();
  client.retryNow();
  await until('the agent to use the result', () => lastAssistant(conv)?.final, [[conv, 'event']]);
  assert.equal(lastAssistant(conv).text, 'weather returned {"city":"Paris","temp":21}');
  assert.equal(calls.length, 1, 'the handler ran once');
  const results = sent.filter((f) => f.type === 'tool_result' && f.call_id === calls[0].callId);
  assert.equal(results.length, 1, 'answered once, after the re-attach');
  assert.equal(conv.status, 'idle');
});

test('a tool call the client missed is answered from the replay', async () => {
  const client = await viaProxy('dave');
  const conv = await client.create({ title: 'missed tool call' });
  const watcher = await watch('dave', conv.id);
  await until('the agent to start', () => conv.status === 'idle', [[conv, 'status']]);
  const calls = [];
  conv.onToolCall((call) => {
    calls.push(call);
    return 'sunny';
  });

  proxy.holdDownstream();
  const acked = conv.send('/ask forecast');
  await until(
    'the tool call to be recorded',
    () => watcher.transcript.items.some((i) => i.kind === 'tool'),
    [[watcher, 'event']],
  );
  assert.equal(calls.length, 0, 'the client has not seen it');
  proxy.cut();
  proxy.heal();
  await within('the ack after the reconnect', acked);
  await until('the agent to use the result', () => lastAssistant(conv)?.final, [[conv, 'event']]);
  assert.equal(lastAssistant(conv).text, 'forecast returned "sunny"');
  assert.equal(calls.length, 1);
  assert.equal(conv.transcript.items.filter((i) => i.kind === 'tool').length, 1);
});

test('the agent stopping is not the connection going down', async () => {
  const client = await viaProxy('erin');
  const conv = await client.create({ title: 'closed elsewhere' });
  await until('the agent to start', () => conv.status === 'idle', [[conv, 'status']]);
  const watcher = await watch('erin', conv.id);
  const detached = [];
  conv.on('detached', (d) => detached.push(d.reason));
  await watcher.close();
  await until('the stop', () => conv.status === 'stopped' && detached.length > 0, [[conv, 'status'], [conv, 'detached']]);
  assert.equal(client.state, 'connected');
  assert.deepEqual(detached, ['closed']);
  assert.equal(conv.transcript.stopReason, 'closed');

  // Sending resumes it: attach first, then the message.
  const ack = await conv.send('back again');
  assert.equal(ack.duplicate, false);
  await until('the resumed reply', () => lastAssistant(conv)?.text === 'back again' && conv.status === 'idle', [
    [conv, 'event'],
  ]);
  assert.ok(conv.transcript.items.some((i) => i.kind === 'resumed'));
});

test('stop() ends the running turn and resolves with its ack', async () => {
  const client = await viaProxy('hank');
  const conv = await client.create({ title: 'stop' });
  await conv.send('/sleep 30s');
  await until('the turn to run', () => conv.status === 'running', [[conv, 'status']]);
  const ack = await conv.stop();
  assert.equal(ack.type, 'ack');
  await until(
    'the stopped turn',
    () => conv.transcript.items.some((i) => i.kind === 'turn_end' && i.status === 'stopped'),
    [[conv, 'event']],
  );
  assert.equal(conv.status, 'idle');
  assert.equal(client.state, 'connected');
});

test('events over 16 KiB, which the server sends in fragments, arrive whole', async () => {
  const client = await direct('iris');
  const conv = await client.create({ title: 'large' });
  const blob = 'é'.repeat(60_000); // 120 KB, cut between characters
  conv.onToolCall(async () => ({ blob }));
  const seen = record(conv);
  await conv.send('/ask fetch');
  await until('the reply', () => lastAssistant(conv)?.final, [[conv, 'event']]);
  assert.equal(lastAssistant(conv).text, `fetch returned ${JSON.stringify({ blob })}`);
  const result = seen.find((ev) => ev.kind === 'tool_result');
  assert.deepEqual(result.data.output, { blob });
});

test('open(id, {compact}) passes compact on and rebuilds the transcript', async () => {
  const writer = await direct('frank');
  const conv = await writer.create({ title: 'compact' });
  await conv.send('/stream 10 5');
  await until('the reply', () => lastAssistant(conv)?.final, [[conv, 'event']]);

  const reader = await viaProxy('frank');
  const opened = await reader.open(conv.id, { compact: true, mode: 'observe' });
  await until('the replay', () => lastAssistant(opened)?.final, [[opened, 'event']]);
  assert.equal(lastAssistant(opened).text, streamText(10));
  const attach = sent.filter((f) => f.type === 'attach' && f.conversation_id === conv.id).at(-1);
  assert.equal(attach.compact, true);
  assert.equal(attach.mode, 'observe');
  await assert.rejects(opened.send('nope'), { code: 'read_only' });
});

// A Storage over a Map, as a browser's localStorage behaves.
function fakeStorage() {
  const data = new Map();
  return {
    getItem: (k) => (data.has(k) ? data.get(k) : null),
    setItem: (k, v) => data.set(k, String(v)),
    removeItem: (k) => data.delete(k),
    key: (i) => [...data.keys()][i] ?? null,
    get length() {
      return data.size;
    },
  };
}

test('a new client with the stored seq and transcript resumes where the last one stopped', async () => {
  const storage = fakeStorage();
  const first = new LingerClient({ url: proxy.url, token: 'gina', store: localStorageStore({ storage }), ...FAST });
  clients.push(first);
  await first.connect();
  const conv = await first.create({ title: 'reload' });
  await conv.send('/stream 30 30');
  await until('the stream to start', () => lastAssistant(conv)?.text.includes('tok5 '), [[conv, 'event']]);
  // A reload: the page goes away (its store flushed on pagehide).
  first.disconnect();
  first.store.flush();
  const kept = conv.lastSeq;

  const second = new LingerClient({ url: proxy.url, token: 'gina', store: localStorageStore({ storage }), ...FAST });
  clients.push(second);
  await second.connect();
  const again = second.conversation(conv.id);
  assert.notEqual(again, conv);
  assert.equal(again.lastSeq, kept, 'the stored seq');
  assert.ok(lastAssistant(again).text.includes('tok5 '), 'the stored transcript');
  const seen = record(again);
  const reply = await again.attach();
  assert.equal(reply.replay_from, kept + 1);
  await until('the whole reply', () => lastAssistant(again)?.final, [[again, 'event']]);
  assert.equal(seen[0].seq, kept + 1, 'only what was missed');
  assert.equal(lastAssistant(again).text, streamText(30));
  assert.equal(again.transcript.items.filter((i) => i.kind === 'assistant').length, 1);
});

test('a refused token is reported, not retried', async () => {
  const client = new LingerClient({ url: proxy.url, token: '', WebSocket: RecordingWebSocket, ...FAST });
  clients.push(client);
  await assert.rejects(client.connect(), { code: 'unauthorized' });
  assert.equal(client.state, 'unauthorized');
});
