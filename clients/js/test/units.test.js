// The client's logic on its own, with frames fed by hand: the seq check
// (duplicates dropped, gaps allowed only in a compact replay), backoff
// bounds, and the localStorage store's snapshot.

import { test } from 'node:test';
import assert from 'node:assert/strict';

import { Conversation } from '../src/conversation.js';
import { Transcript, backoffDelay, localStorageStore, memoryStore } from '../src/index.js';

// Just enough of a LingerClient for a handle: records what it sends.
function fakeClient() {
  let req = 0;
  return {
    connected: true,
    store: memoryStore(),
    frames: [],
    nextReq: () => {
      req += 1;
      return req;
    },
    request(frame) {
      this.frames.push(frame);
      return new Promise(() => {});
    },
    sendFrame(frame) {
      this.frames.push(frame);
    },
    forget() {},
  };
}

const ev = (seq, kind, data = {}) => ({ type: 'event', conversation_id: 'c_1', seq, kind, data });

function attached(conv, fields) {
  const req = conv.client.frames.filter((f) => f.type === 'attach').at(-1).req;
  conv.onAttached({ type: 'attached', req, conversation_id: 'c_1', status: 'idle', pending_calls: [], ...fields });
}

test('duplicates are dropped and a gap in a normal attach makes it attach again', () => {
  const client = fakeClient();
  const conv = new Conversation(client, 'c_1');
  const seqs = [];
  const errors = [];
  conv.onEvent((e) => seqs.push(e.seq));
  conv.on('error', (e) => errors.push(e.code));
  conv.attach();
  attached(conv, { head_seq: 3, replay_from: 1 });
  for (const s of [1, 2, 2, 1, 3]) conv.onEventFrame(ev(s, 'agent_started'));
  assert.deepEqual(seqs, [1, 2, 3]);
  conv.onEventFrame(ev(5, 'agent_started'));
  assert.deepEqual(seqs, [1, 2, 3], 'a gap is not applied');
  assert.deepEqual(errors, ['gap']);
  const again = client.frames.filter((f) => f.type === 'attach').at(-1);
  assert.equal(again.last_seq, 3, 'attaches again from the last seq applied');
  conv.onEventFrame(ev(6, 'agent_started'));
  assert.deepEqual(errors, ['gap'], 'one re-attach for one gap');
  // The same gap after attaching again: shown, not asked for again.
  attached(conv, { head_seq: 6, replay_from: 4 });
  conv.onEventFrame(ev(5, 'agent_started'));
  assert.deepEqual(seqs, [1, 2, 3, 5]);
  assert.deepEqual(errors, ['gap', 'gap']);
  assert.equal(client.frames.filter((f) => f.type === 'attach').length, 2);
  assert.ok(conv.transcript.items.some((i) => i.kind === 'gap'));
});

test('a compact replay may skip the text_delta of finished turns, and only the replay', () => {
  const client = fakeClient();
  const conv = new Conversation(client, 'c_1', { compact: true });
  const seqs = [];
  conv.onEvent((e) => seqs.push(e.seq));
  conv.attach();
  assert.equal(client.frames[0].compact, true);
  attached(conv, { head_seq: 8, replay_from: 1, compact: true });
  conv.onEventFrame(ev(1, 'conversation_created', { title: 'x' }));
  conv.onEventFrame(ev(2, 'agent_started'));
  conv.onEventFrame(ev(3, 'user_message', { text: 'hi' }));
  conv.onEventFrame(ev(4, 'turn_started', { turn_id: 't1' }));
  // 5..6 were text_delta, left out.
  conv.onEventFrame(ev(7, 'assistant_message', { turn_id: 't1', text: 'hello there' }));
  conv.onEventFrame(ev(8, 'turn_finished', { turn_id: 't1', status: 'completed' }));
  conv.onEventFrame(ev(10, 'user_message', { text: 'live gap' }));
  assert.deepEqual(seqs, [1, 2, 3, 4, 7, 8]);
  assert.deepEqual(
    conv.transcript.items.map((i) => [i.kind, i.text]),
    [
      ['user', 'hi'],
      ['assistant', 'hello there'],
    ],
  );
});

test('a compact replay may not skip anything outside a turn', () => {
  const client = fakeClient();
  const conv = new Conversation(client, 'c_1', { compact: true });
  const seqs = [];
  conv.onEvent((e) => seqs.push(e.seq));
  conv.attach();
  attached(conv, { head_seq: 8, replay_from: 1, compact: true });
  conv.onEventFrame(ev(1, 'conversation_created'));
  conv.onEventFrame(ev(3, 'agent_started'));
  assert.deepEqual(seqs, [1]);
  const attaches = client.frames.filter((f) => f.type === 'attach');
  assert.equal(attaches.length, 2, 'attaches again');
  assert.equal(attaches[1].compact, undefined, 'in full this time');
});

test("compact: 'fresh' asks for a compact replay from nothing only, not to resume", () => {
  const client = fakeClient();
  const conv = new Conversation(client, 'c_1', { compact: 'fresh' });
  conv.attach();
  assert.equal(client.frames[0].last_seq, 0);
  assert.equal(client.frames[0].compact, true, 'a first open is compact');
  attached(conv, { head_seq: 3, replay_from: 1, compact: true });
  for (const s of [1, 2, 3]) conv.onEventFrame(ev(s, 'agent_started'));
  // The connection drops; the re-attach resumes from seq 3, in full.
  conv.onDisconnected();
  conv.onConnected();
  const again = client.frames.filter((f) => f.type === 'attach').at(-1);
  assert.equal(again.last_seq, 3);
  assert.equal(again.compact, undefined, 'a resume from a known seq is not compact');

  // A handle that starts from a stored seq is never compact.
  const stored = fakeClient();
  const resumed = new Conversation(stored, 'c_1', { compact: 'fresh', saved: { lastSeq: 9 } });
  resumed.attach();
  assert.equal(stored.frames[0].last_seq, 9);
  assert.equal(stored.frames[0].compact, undefined);
});

test('without compact: true in the reply, gaps are not allowed even in the replay', () => {
  const client = fakeClient();
  const conv = new Conversation(client, 'c_1', { compact: true });
  const seqs = [];
  conv.onEvent((e) => seqs.push(e.seq));
  conv.attach();
  attached(conv, { head_seq: 8, replay_from: 1 });
  conv.onEventFrame(ev(1, 'conversation_created'));
  conv.onEventFrame(ev(3, 'user_message', { text: 'hi' }));
  assert.deepEqual(seqs, [1]);
});

test('streamed text is replaced by the whole reply, once', () => {
  const t = new Transcript();
  t.apply(ev(1, 'turn_started', { turn_id: 't1' }));
  t.apply(ev(2, 'text_delta', { turn_id: 't1', text: 'a ' }));
  t.apply(ev(3, 'text_delta', { turn_id: 't1', text: 'b' }));
  assert.equal(t.apply(ev(3, 'text_delta', { turn_id: 't1', text: 'b' })), false);
  t.apply(ev(4, 'assistant_message', { turn_id: 't1', text: 'a b' }));
  t.apply(ev(5, 'turn_finished', { turn_id: 't1', status: 'failed', error: 'boom' }));
  assert.deepEqual(
    t.items.map((i) => [i.kind, i.text ?? i.status, i.final ?? null]),
    [
      ['assistant', 'a b', true],
      ['turn_end', 'failed', null],
    ],
  );
});

test('backoff doubles up to its ceiling, jittered within its upper half', () => {
  const opts = { baseMs: 100, maxMs: 1000 };
  for (const [attempt, ceiling] of [
    [0, 100],
    [1, 200],
    [3, 800],
    [4, 1000],
    [30, 1000],
  ]) {
    assert.equal(backoffDelay(attempt, opts, () => 0), ceiling / 2);
    assert.equal(backoffDelay(attempt, opts, () => 1), ceiling);
  }
});

test('the localStorage store keeps the seq and the transcript together', () => {
  const data = new Map();
  const storage = {
    getItem: (k) => (data.has(k) ? data.get(k) : null),
    setItem: (k, v) => data.set(k, String(v)),
    removeItem: (k) => data.delete(k),
    key: (i) => [...data.keys()][i] ?? null,
    get length() {
      return data.size;
    },
  };
  const store = localStorageStore({ storage, delayMs: 0 });
  const t = new Transcript();
  t.apply(ev(1, 'user_message', { text: 'kept' }));
  store.save('c_1', { lastSeq: 1, transcript: t });
  t.apply(ev(2, 'agent_started'));
  store.flush();
  const loaded = localStorageStore({ storage }).load('c_1');
  assert.equal(loaded.lastSeq, 2, 'the seq of the moment it was written');
  assert.equal(loaded.transcript.lastSeq, 2);
  assert.deepEqual(
    loaded.transcript.items.map((i) => i.text),
    ['kept'],
  );
  store.removeAll();
  assert.equal(data.size, 0);
});
