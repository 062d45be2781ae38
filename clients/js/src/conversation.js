// A handle on one conversation: attaches (and re-attaches after every
// reconnect with the last seq it applied), drops duplicates, checks there
// is no gap, rebuilds the transcript, keeps unacknowledged messages and
// resends them with their client_msg_id, and answers client tool calls,
// including those still owed after a reconnect (`attached.pending_calls`).
//
// Created by LingerClient (create, open, conversation); not constructed
// directly.

import { Emitter } from './emitter.js';
import { LingerError } from './errors.js';
import { Transcript } from './transcript.js';

export class Conversation extends Emitter {
  constructor(client, id, { mode = 'control', compact = false, saved = null } = {}) {
    super();
    this.client = client;
    this.id = id;
    this.mode = mode;
    // true: every attach asks for a compact replay; 'fresh': only one
    // from nothing (last seq 0), so that a resume from a known seq gets
    // every event it missed.
    this.compact = compact === 'fresh' ? 'fresh' : !!compact;
    this.transcript = restore(saved);
    // Should be attached: re-attach after reconnects. Cleared by detach()
    // and by the server detaching it (closed, user limit, ...).
    this.wanted = false;
    this.attached = false;
    this.attachReq = null;
    this.attachWaiters = [];
    // The `attached` reply of the current attachment: replay bounds.
    this.replayHead = 0;
    this.compactReplay = false;
    this.resyncing = false;
    // lastSeq when a gap last made it attach again.
    this.resyncedAt = null;
    this.detachReason = null;
    // Messages not acknowledged yet, in send order.
    this.outbox = [];
    // Client tool calls this client owes an answer to (call ids), and the
    // answers being worked out or sent.
    this.owed = new Set();
    this.answers = new Map();
    this.toolHandler = null;
    this.lastStatus = this.transcript.status;
  }

  get lastSeq() {
    return this.transcript.lastSeq;
  }

  // running, waiting, idle or stopped: the agent's status, from events and
  // `attached` only; a dropped connection never changes it.
  get status() {
    return this.transcript.status;
  }

  // Calls fn(event, {replay}) for every event applied, once per seq.
  onEvent(fn) {
    return this.on('event', fn);
  }

  // fn(call) answers a client tool call: its return value (or what its
  // promise resolves to) is the output; a throw answers with is_error and
  // the error's message. Calls still owed after a reconnect are answered
  // too; one call is never given to fn twice.
  onToolCall(fn) {
    this.toolHandler = fn;
    this.answerOwed();
    return () => {
      if (this.toolHandler === fn) this.toolHandler = null;
    };
  }

  // Attaches (activating a stopped conversation); resolves with the
  // `attached` reply. Re-attaches by itself after every reconnect until
  // detach() or the server detaches it.
  attach() {
    if (this.client.state === 'idle') this.client.connect().catch(() => {});
    this.wanted = true;
    this.detachReason = null;
    const promise = new Promise((resolve, reject) => this.attachWaiters.push({ resolve, reject }));
    if (this.attached) this.settleAttach(null, { type: 'attached', conversation_id: this.id, status: this.status });
    else this.sendAttach();
    return promise;
  }

  // Stops following it; unacknowledged messages are rejected ('detached').
  detach() {
    const was = this.attached || this.attachReq !== null;
    this.wanted = false;
    this.attached = false;
    this.attachReq = null;
    if (was) this.client.sendFrame({ type: 'detach', conversation_id: this.id });
    this.settleAttach(new LingerError('detached', 'detached by the client'));
    this.failOutbox(new LingerError('detached', 'detached before the message was acknowledged'));
    this.client.forget(this);
  }

  // Sends a user message; resolves with {seq, duplicate} from its `ack`.
  // Not acknowledged before a disconnect, it is sent again (same
  // client_msg_id, so the server records it once) after the re-attach. A
  // conversation the server detached (closed, user limit) is attached
  // again first, which resumes it.
  send(text, { clientMsgId } = {}) {
    if (this.mode !== 'control') {
      return Promise.reject(new LingerError('read_only', 'observing: this connection cannot send'));
    }
    return new Promise((resolve, reject) => {
      const entry = { clientMsgId: clientMsgId || newId(), text: String(text), req: null, resolve, reject };
      this.outbox.push(entry);
      this.emit('outbox', this.outbox);
      if (!this.wanted) {
        this.attach().catch(() => {
          // Reported through the message's own promise (failOutbox).
        });
      } else if (this.attached) {
        this.transmit(entry);
      }
    });
  }

  // Aborts the running turn; resolves with the ack.
  stop() {
    return this.control({ type: 'stop', conversation_id: this.id });
  }

  // Stops the conversation now; resolves with the ack.
  close() {
    return this.control({ type: 'close', conversation_id: this.id });
  }

  // Answers a client tool call by hand (instead of onToolCall).
  answer(callId, output, { isError = false } = {}) {
    const manual = { state: 'manual' };
    this.answers.set(callId, manual);
    return this.control({ type: 'tool_result', conversation_id: this.id, call_id: callId, output, is_error: isError }).then(
      (ack) => {
        this.owed.delete(callId);
        return ack;
      },
      (err) => {
        // Not answered: a handler may still take it.
        if (this.answers.get(callId) === manual) this.answers.delete(callId);
        throw err;
      },
    );
  }

  // Reads the stored events after lastSeq over REST and applies them:
  // history without activating the conversation.
  async loadHistory() {
    const events = await this.client.rest.events(this.id, this.lastSeq);
    for (const ev of events) {
      if (ev.seq <= this.lastSeq) continue;
      if (ev.seq > this.lastSeq + 1) this.transcript.gap(ev.seq);
      this.applyEvent(ev, { replay: true, stored: true });
    }
    return events.length;
  }

  // ---- called by the client ----

  control(frame) {
    if (this.mode !== 'control') {
      return Promise.reject(new LingerError('read_only', 'observing: this connection cannot send'));
    }
    if (!this.attached) return Promise.reject(new LingerError('not_attached', 'not attached now: try again when attached'));
    return this.client.request(frame);
  }

  sendAttach() {
    if (!this.wanted || !this.client.connected || this.attachReq !== null) return;
    const frame = { type: 'attach', conversation_id: this.id, last_seq: this.lastSeq, mode: this.mode };
    if (this.asksCompact()) frame.compact = true;
    const req = this.client.nextReq();
    this.attachReq = req;
    this.client.request({ ...frame, req }).catch((err) => {
      if (this.attachReq !== req) return;
      this.attachReq = null;
      if (err.code === 'disconnected') return;
      // not_found, limit_reached, ...: attaching again would not help.
      this.wanted = false;
      this.emit('error', err);
      this.settleAttach(err);
      this.failOutbox(err);
    });
  }

  // Whether the next attach asks for a compact replay. Not after a gap:
  // the full replay is the one to trust then.
  asksCompact() {
    if (!this.compact || this.resyncing) return false;
    return this.compact !== 'fresh' || this.lastSeq === 0;
  }

  onConnected() {
    this.sendAttach();
  }

  onDisconnected() {
    this.attached = false;
    this.attachReq = null;
    this.resyncing = false;
    for (const m of this.outbox) m.req = null;
    for (const a of this.answers.values()) if (a.state === 'sending') a.state = 'ready';
    this.emit('connection', false);
  }

  onCreated() {
    this.wanted = true;
    this.attached = true;
    this.replayHead = 0;
    this.compactReplay = false;
    this.owed.clear();
  }

  onAttached(f) {
    if (f.req !== this.attachReq) return;
    this.attachReq = null;
    if (typeof f.head_seq === 'number' && f.head_seq < this.lastSeq) {
      // Our seq belongs to another history (the server lost its store, or
      // the id was reused): start again from nothing.
      this.transcript = new Transcript();
      this.emit('reset', this.transcript);
      this.sendAttach();
      return;
    }
    this.attached = true;
    this.resyncing = false;
    this.detachReason = null;
    this.replayHead = typeof f.head_seq === 'number' ? f.head_seq : this.lastSeq;
    this.compactReplay = f.compact === true;
    if (typeof f.replay_from === 'number' && f.replay_from > this.lastSeq + 1) this.transcript.gap(f.replay_from);
    if (f.status) this.transcript.status = f.status;
    this.owed = new Set(Array.isArray(f.pending_calls) ? f.pending_calls : []);
    for (const [callId, a] of this.answers) {
      if (!this.owed.has(callId) && a.state !== 'running') this.answers.delete(callId);
    }
    this.save();
    this.noteStatus();
    this.emit('attached', f);
    this.settleAttach(null, f);
    for (const m of this.outbox) if (m.req === null) this.transmit(m);
    this.answerOwed();
  }

  onDetached(f) {
    this.attached = false;
    this.attachReq = null;
    if (f.reason === 'moved') {
      // Another node owns it now (protocol §10): attach again, anywhere.
      this.sendAttach();
      return;
    }
    if (f.reason !== 'client') {
      this.wanted = false;
      this.detachReason = f.reason || null;
      this.settleAttach(new LingerError('detached', `detached: ${f.reason}`, { reason: f.reason }));
    }
    this.emit('detached', { reason: f.reason });
  }

  onError(f) {
    this.emit('error', new LingerError(f.code, f.message, { req: f.req }));
  }

  onEventFrame(f) {
    if (typeof f.seq !== 'number' || f.seq <= this.lastSeq) return;
    if (f.seq > this.lastSeq + 1) {
      // A compact replay leaves out finished turns' text_delta: gaps are
      // allowed there, inside a turn, and nowhere else.
      const allowed = this.compactReplay && f.seq <= this.replayHead && this.transcript.turnId !== null;
      if (!allowed) {
        // Waiting for the new attachment: the old one's frames may still come.
        if (this.resyncing) return;
        if (this.resyncedAt !== this.lastSeq) {
          this.resyncing = true;
          this.resyncedAt = this.lastSeq;
          this.emit('error', new LingerError('gap', `expected seq ${this.lastSeq + 1}, got ${f.seq}: attaching again`));
          this.attached = false;
          this.sendAttach();
          return;
        }
        // Attaching again from here (in full) did not help: show the gap
        // rather than ask for the same replay for ever.
        this.emit('error', new LingerError('gap', `seq ${this.lastSeq + 1} to ${f.seq - 1} are missing`));
        this.transcript.gap(f.seq);
      }
    }
    this.applyEvent(f, { replay: f.seq <= this.replayHead });
  }

  applyEvent(ev, info) {
    this.transcript.apply(ev);
    const d = ev.data || {};
    if (ev.kind === 'tool_call' && d.target === 'client' && !info.replay) this.owed.add(d.call_id);
    else if (ev.kind === 'tool_result') {
      this.owed.delete(d.call_id);
      this.answers.delete(d.call_id);
    } else if (ev.kind === 'turn_finished') {
      for (const item of this.transcript.items) {
        if (item.kind === 'tool' && item.turnId === d.turn_id) {
          this.owed.delete(item.callId);
          this.answers.delete(item.callId);
        }
      }
    }
    this.save();
    this.emit('event', ev, info);
    this.noteStatus();
    if (ev.kind === 'tool_call' && !info.stored) this.answerOwed();
  }

  // ---- internals ----

  save() {
    this.client.store.save(this.id, this);
  }

  noteStatus() {
    if (this.transcript.status !== this.lastStatus) {
      this.lastStatus = this.transcript.status;
      this.emit('status', this.lastStatus);
    }
  }

  settleAttach(err, reply) {
    const waiters = this.attachWaiters;
    this.attachWaiters = [];
    for (const w of waiters) {
      if (err) w.reject(err);
      else w.resolve(reply);
    }
  }

  transmit(entry) {
    const req = this.client.nextReq();
    entry.req = req;
    const frame = {
      type: 'message',
      conversation_id: this.id,
      text: entry.text,
      client_msg_id: entry.clientMsgId,
      req,
    };
    this.client.request(frame).then(
      (ack) => {
        if (entry.req !== req) return;
        this.dropEntry(entry);
        entry.resolve({ seq: ack.seq, duplicate: !!ack.duplicate, clientMsgId: entry.clientMsgId });
      },
      (err) => {
        if (entry.req !== req) return;
        entry.req = null;
        if (err.code === 'disconnected') return; // sent again after the re-attach
        if (err.code === 'not_attached') {
          // Detached under us (closed, user limit): attach again, which
          // resumes it, and the message follows.
          this.attached = false;
          if (!this.wanted) this.attach().catch(() => {});
          else this.sendAttach();
          return;
        }
        this.dropEntry(entry);
        entry.reject(err);
      },
    );
  }

  dropEntry(entry) {
    const i = this.outbox.indexOf(entry);
    if (i >= 0) this.outbox.splice(i, 1);
    this.emit('outbox', this.outbox);
  }

  failOutbox(err) {
    const entries = this.outbox;
    this.outbox = [];
    for (const m of entries) m.reject(err);
    if (entries.length) this.emit('outbox', this.outbox);
  }

  // Starts the handler on every owed call it has not been given yet, and
  // sends the answers that are ready.
  answerOwed() {
    if (this.mode !== 'control') return;
    for (const callId of this.owed) {
      const a = this.answers.get(callId);
      if (!a) {
        const item = this.transcript.tool(callId);
        if (this.toolHandler && item && !item.answered && !item.expired) this.runTool(item);
      } else if (a.state === 'ready') {
        this.deliver(callId, a);
      }
    }
  }

  runTool(item) {
    const a = { state: 'running', result: null };
    this.answers.set(item.callId, a);
    const handler = this.toolHandler;
    const call = { callId: item.callId, name: item.name, args: item.args, turnId: item.turnId, seq: item.seq, conversation: this };
    Promise.resolve()
      .then(() => handler(call))
      .then(
        (output) => ({ output: output === undefined ? null : output, isError: false }),
        (err) => ({ output: err && err.message ? err.message : String(err), isError: true }),
      )
      .then((result) => {
        if (this.answers.get(item.callId) !== a) return; // answered elsewhere, or its turn ended
        a.state = 'ready';
        a.result = result;
        if (this.attached && this.owed.has(item.callId)) this.deliver(item.callId, a);
      });
  }

  deliver(callId, a) {
    a.state = 'sending';
    const frame = {
      type: 'tool_result',
      conversation_id: this.id,
      call_id: callId,
      output: a.result.output,
      is_error: a.result.isError,
    };
    this.client.request(frame).then(
      () => {
        a.state = 'done';
        this.owed.delete(callId);
      },
      (err) => {
        if (err.code === 'disconnected') {
          if (a.state === 'sending') a.state = 'ready';
          return;
        }
        a.state = 'done';
        this.owed.delete(callId);
        // unknown_call: another client answered first. Anything else is
        // worth telling the app.
        if (err.code !== 'unknown_call') this.emit('error', err);
      },
    );
  }
}

function restore(saved) {
  if (!saved) return new Transcript();
  if (saved.transcript instanceof Transcript) return saved.transcript;
  const t = new Transcript();
  if (Number.isInteger(saved.lastSeq) && saved.lastSeq > 0) t.lastSeq = saved.lastSeq;
  return t;
}

export function newId() {
  const c = globalThis.crypto;
  if (c && typeof c.randomUUID === 'function') return c.randomUUID();
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}-${Math.random().toString(36).slice(2)}`;
}
