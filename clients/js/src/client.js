// LingerClient: one websocket to a linger server shared by every
// conversation handle, requests matched to their replies by `req`,
// reconnects with backoff and jitter, and re-attaches every handle that
// wants to be attached. Its `state` is the connection's only; whether an
// agent runs or stopped is each conversation's `status`.

import { Conversation } from './conversation.js';
import { Emitter } from './emitter.js';
import { LingerError } from './errors.js';
import { Rest } from './rest.js';
import { ReconnectingSocket } from './socket.js';
import { memoryStore } from './store.js';

export class LingerClient extends Emitter {
  // Options:
  //   url        the server's base URL: 'http://127.0.0.1:7420/' (REST, and
  //              /v1/ws with ws: or wss:); in a page, document.baseURI
  //   token      a string, or a function returning one (read at every
  //              connect); sent as ?token= on the socket (browsers cannot
  //              set headers there) and as a Bearer header over REST
  //   WebSocket  a WebSocket constructor (default: the global one; Node 20
  //              needs --experimental-websocket or an injected one)
  //   fetch      default: the global fetch
  //   store      where last seqs are kept (default memoryStore())
  //   backoff    {baseMs, maxMs}; heartbeat {everyMs, silenceMs};
  //   connectTimeoutMs (an attempt not open by then is given up)
  constructor({ url, token = '', WebSocket, fetch, store, backoff, heartbeat, connectTimeoutMs } = {}) {
    super();
    if (!url) throw new TypeError('LingerClient: url is required');
    this.base = new URL(url).toString();
    this.token = typeof token === 'function' ? token : () => token;
    const Ws = WebSocket || globalThis.WebSocket;
    if (typeof Ws !== 'function') {
      throw new TypeError(
        'LingerClient: no WebSocket constructor (Node 20: run with --experimental-websocket or pass one as options.WebSocket)',
      );
    }
    this.store = store || memoryStore();
    const fetchFn = fetch || (globalThis.fetch && globalThis.fetch.bind(globalThis));
    this.rest = new Rest({ base: this.base, token: () => this.token(), fetch: fetchFn });
    this.socket = new ReconnectingSocket({
      url: () => this.socketUrl(),
      WebSocket: Ws,
      probe: fetchFn ? () => this.rest.probe() : null,
      backoff,
      heartbeat,
      connectTimeoutMs,
    });
    this.conversations = new Map();
    this.pending = new Map();
    this.reqCounter = 0;
    this.connectWaiters = [];
    this.socket.on('state', (state, detail) => this.onState(state, detail));
    this.socket.on('open', () => this.onOpen());
    this.socket.on('close', () => this.onClose());
    this.socket.on('frame', (frame) => this.onFrame(frame));
    this.wake = () => this.socket.retryNow();
  }

  // 'idle', 'connecting', 'connected', 'reconnecting' or 'unauthorized'.
  get state() {
    return this.socket.state;
  }

  get connected() {
    return this.socket.connected;
  }

  socketUrl() {
    const u = new URL('v1/ws', this.base);
    if (u.protocol === 'https:') u.protocol = 'wss:';
    else if (u.protocol === 'http:') u.protocol = 'ws:';
    u.searchParams.set('token', this.token());
    return u.toString();
  }

  // Connects (and keeps reconnecting); resolves once connected, rejects
  // if the token is refused or disconnect() is called first.
  connect() {
    const promise = this.connected
      ? Promise.resolve()
      : new Promise((resolve, reject) => this.connectWaiters.push({ resolve, reject }));
    if (typeof globalThis.addEventListener === 'function' && globalThis.document) {
      globalThis.addEventListener('online', this.wake);
      globalThis.document.addEventListener('visibilitychange', this.wake);
    }
    this.socket.start();
    return promise;
  }

  // Closes the socket for good; handles stay, and attach again on the next
  // connect().
  disconnect() {
    if (typeof globalThis.removeEventListener === 'function' && globalThis.document) {
      globalThis.removeEventListener('online', this.wake);
      globalThis.document.removeEventListener('visibilitychange', this.wake);
    }
    this.socket.stop();
    this.settleConnect(new LingerError('closed', 'disconnected by the client'));
  }

  // Retries at once instead of waiting out the backoff.
  retryNow() {
    this.socket.retryNow();
  }

  // A new conversation, attached in control mode.
  async create({ title, closeDelay } = {}) {
    const frame = { type: 'create' };
    if (title) frame.title = title;
    if (closeDelay) frame.close_delay = closeDelay;
    const reply = await this.request(frame, { needsConnection: true });
    return this.conversations.get(reply.conversation_id);
  }

  // The handle for a conversation, not attached yet (attach() it, or read
  // its history with loadHistory()). One handle per id.
  conversation(id, { mode = 'control', compact = false } = {}) {
    let conv = this.conversations.get(id);
    if (conv) return conv;
    const saved = this.store.load(id);
    if (saved && typeof saved.then === 'function') {
      throw new TypeError('conversation(): this store loads asynchronously; use open()');
    }
    conv = new Conversation(this, id, { mode, compact, saved });
    this.conversations.set(id, conv);
    return conv;
  }

  // The handle for a conversation, attached: the replay of what came after
  // the stored last seq follows, then live events.
  async open(id, { mode = 'control', compact = false } = {}) {
    let conv = this.conversations.get(id);
    if (!conv) {
      const saved = await this.store.load(id);
      conv = this.conversations.get(id) || new Conversation(this, id, { mode, compact, saved });
      this.conversations.set(id, conv);
    }
    await conv.attach();
    return conv;
  }

  // REST: the caller's conversations, one summary, stored events (never
  // activating), delete (also forgets the stored seq).
  list() {
    return this.rest.list();
  }

  get(id) {
    return this.rest.get(id);
  }

  events(id, after = 0) {
    return this.rest.events(id, after);
  }

  async delete(id) {
    await this.rest.delete(id);
    const conv = this.conversations.get(id);
    if (conv) conv.detach();
    this.store.remove(id);
  }

  // ---- used by conversations ----

  nextReq() {
    this.reqCounter += 1;
    return this.reqCounter;
  }

  sendFrame(frame) {
    return this.socket.send(frame);
  }

  // Sends a frame and resolves with its reply (rejects with a LingerError
  // for an `error` reply, or 'disconnected' if the socket goes first).
  request(frame, { needsConnection = false } = {}) {
    const req = frame.req ?? this.nextReq();
    const sent = { ...frame, req };
    return new Promise((resolve, reject) => {
      if (!this.connected) {
        if (needsConnection) {
          // Wait for the connection rather than fail at once.
          this.connectWaiters.push({
            resolve: () => this.request(sent).then(resolve, reject),
            reject,
          });
          if (this.state === 'idle') this.connect().catch(() => {});
          return;
        }
        reject(new LingerError('disconnected', 'not connected'));
        return;
      }
      this.pending.set(req, { resolve, reject, frame: sent });
      if (!this.socket.send(sent)) {
        this.pending.delete(req);
        reject(new LingerError('disconnected', 'not connected'));
      }
    });
  }

  forget(conv) {
    if (this.conversations.get(conv.id) === conv) this.conversations.delete(conv.id);
  }

  // ---- socket events ----

  onState(state, detail) {
    this.emit('state', state, detail);
    if (state === 'unauthorized') {
      this.settleConnect(new LingerError('unauthorized', 'the server refused the token'));
    }
  }

  onOpen() {
    this.settleConnect(null);
    for (const conv of this.conversations.values()) conv.onConnected();
  }

  onClose() {
    const pending = this.pending;
    this.pending = new Map();
    for (const p of pending.values()) p.reject(new LingerError('disconnected', 'the connection was lost before the reply'));
    for (const conv of this.conversations.values()) conv.onDisconnected();
  }

  settleConnect(err) {
    const waiters = this.connectWaiters;
    this.connectWaiters = [];
    for (const w of waiters) {
      if (err) w.reject(err);
      else w.resolve();
    }
  }

  onFrame(f) {
    const conv = f.conversation_id ? this.conversations.get(f.conversation_id) : null;
    switch (f.type) {
      case 'event':
        if (conv) conv.onEventFrame(f);
        break;
      case 'created': {
        const p = this.pending.get(f.req);
        if (p && f.conversation_id) {
          // Before any of its events: they follow this frame.
          const created = new Conversation(this, f.conversation_id, { mode: 'control' });
          this.conversations.set(f.conversation_id, created);
          created.onCreated();
        }
        break;
      }
      case 'attached':
        if (conv) conv.onAttached(f);
        else this.sendFrame({ type: 'detach', conversation_id: f.conversation_id });
        break;
      case 'detached':
        if (conv) conv.onDetached(f);
        break;
      case 'error':
        if (!this.pending.has(f.req)) {
          if (conv) conv.onError(f);
          else this.emit('error', new LingerError(f.code, f.message, { req: f.req }));
        }
        break;
      default:
        break;
    }
    if (f.req !== undefined && f.req !== null && this.pending.has(f.req)) {
      const p = this.pending.get(f.req);
      this.pending.delete(f.req);
      if (f.type === 'error') p.reject(new LingerError(f.code, f.message, { req: f.req }));
      else p.resolve(f);
    }
  }
}
