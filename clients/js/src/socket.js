// One websocket that comes back by itself: exponential backoff with full
// jitter in its upper half, a heartbeat that notices a dead network, and a
// connection state that is only ever about the socket (never the agent).
//
// States: 'idle' (not started or stopped), 'connecting' (first attempt),
// 'connected', 'reconnecting' (the socket went away; a retry is scheduled
// or running), 'unauthorized' (the token was refused: retrying would not
// help, so it stops).

import { Emitter } from './emitter.js';

export const DEFAULT_BACKOFF = { baseMs: 500, maxMs: 15000 };
export const DEFAULT_HEARTBEAT = { everyMs: 20000, silenceMs: 45000 };

// Delay before retry number `attempt` (0-based): doubling from baseMs up
// to maxMs, then a random point in the upper half, so that clients dropped
// together do not come back together.
export function backoffDelay(attempt, { baseMs, maxMs }, random = Math.random) {
  const ceiling = Math.min(maxMs, baseMs * 2 ** Math.min(attempt, 20));
  return ceiling / 2 + random() * (ceiling / 2);
}

export class ReconnectingSocket extends Emitter {
  // url(): the URL to open. WebSocket: the constructor. probe(): resolves
  // 'ok', 'unauthorized' or 'unreachable'; asked when a socket closed
  // before it opened, since a browser cannot see the HTTP status of a
  // refused upgrade.
  constructor({ url, WebSocket, probe, backoff, heartbeat, connectTimeoutMs = 10000 }) {
    super();
    this.url = url;
    this.WebSocket = WebSocket;
    this.probe = probe;
    this.backoff = { ...DEFAULT_BACKOFF, ...backoff };
    this.heartbeat = { ...DEFAULT_HEARTBEAT, ...heartbeat };
    this.connectTimeoutMs = connectTimeoutMs;
    this.ws = null;
    this.state = 'idle';
    this.attempt = 0;
    this.timer = null;
    this.beat = null;
    this.lastHeard = 0;
    this.running = false;
  }

  get connected() {
    return this.state === 'connected';
  }

  start() {
    if (this.running) return;
    this.running = true;
    this.attempt = 0;
    this.open('connecting');
  }

  // Stops for good: no retry until start() again.
  stop() {
    this.running = false;
    clearTimeout(this.timer);
    this.timer = null;
    this.stopHeartbeat();
    const ws = this.ws;
    this.ws = null;
    if (ws) {
      try {
        ws.close(1000, 'client stopped');
      } catch {
        // Already closing.
      }
      this.emit('close', { code: 1000, reason: 'client stopped' });
    }
    this.setState('idle');
  }

  // Retries at once instead of waiting for the backoff (the network is
  // back, the page became visible).
  retryNow() {
    if (this.running && this.state === 'reconnecting' && this.timer) {
      clearTimeout(this.timer);
      this.timer = null;
      this.open('reconnecting');
    }
  }

  // Drops the socket as if the network had gone (no close handshake
  // awaited) and reconnects with backoff.
  drop(why = 'dropped by the client') {
    const ws = this.ws;
    if (!ws) return;
    this.ws = null;
    this.stopHeartbeat();
    try {
      ws.close(4000, why.slice(0, 100));
    } catch {
      // Already closing.
    }
    this.lost(why, 4000, true);
  }

  send(frame) {
    const ws = this.ws;
    if (!ws || !this.connected || ws.readyState !== 1) return false;
    try {
      ws.send(JSON.stringify(frame));
      return true;
    } catch {
      return false;
    }
  }

  setState(state, detail) {
    if (this.state === state && state !== 'reconnecting') return;
    this.state = state;
    this.emit('state', state, detail || {});
  }

  open(state) {
    this.timer = null;
    if (!this.running) return;
    this.setState(state);
    let ws;
    try {
      ws = new this.WebSocket(this.url());
    } catch (e) {
      this.lost(`cannot open the socket: ${e.message}`, 0, false);
      return;
    }
    this.ws = ws;
    let opened = false;
    // Some WebSocket implementations (Node 20's) report a failed handshake
    // with an error and no close, or hang on a peer that never answers:
    // an error before open, or no open within connectTimeoutMs, is a
    // failed attempt too.
    const fail = (why, code) => {
      if (this.ws !== ws) return;
      this.ws = null;
      clearTimeout(connectTimer);
      this.stopHeartbeat();
      try {
        ws.close();
      } catch {
        // Not open yet, or already closing.
      }
      this.lost(why, code, opened);
    };
    const connectTimer = setTimeout(() => {
      if (!opened) fail('no answer while connecting', 0);
    }, this.connectTimeoutMs);
    ws.onopen = () => {
      if (this.ws !== ws) return;
      opened = true;
      clearTimeout(connectTimer);
      this.attempt = 0;
      this.lastHeard = Date.now();
      this.startHeartbeat();
      this.setState('connected');
      this.emit('open');
    };
    ws.onmessage = (msg) => {
      if (this.ws !== ws) return;
      this.lastHeard = Date.now();
      let frame;
      try {
        frame = JSON.parse(typeof msg.data === 'string' ? msg.data : String(msg.data));
      } catch {
        return;
      }
      if (frame && typeof frame === 'object') this.emit('frame', frame);
    };
    ws.onerror = () => {
      // Once open, a close event follows and says more.
      if (!opened) fail('cannot connect', 0);
    };
    ws.onclose = (ev) => {
      fail(`socket closed (code ${ev.code}${ev.reason ? `: ${ev.reason}` : ''})`, ev.code);
    };
  }

  // The socket is gone, whatever the reason. A dropped socket is never
  // taken for the agent stopping: conversations only learn that from
  // their events.
  lost(why, code, wasOpen) {
    if (wasOpen) this.emit('close', { code, reason: why });
    if (!this.running) {
      this.setState('idle');
      return;
    }
    const delay = backoffDelay(this.attempt, this.backoff);
    this.attempt += 1;
    this.setState('reconnecting', { why, code, retryInMs: Math.round(delay) });
    this.timer = setTimeout(() => this.retry(wasOpen), delay);
  }

  async retry(wasOpen) {
    this.timer = null;
    if (!this.running || this.ws) return;
    if (!wasOpen && this.probe) {
      let verdict = 'ok';
      try {
        verdict = await this.probe();
      } catch {
        verdict = 'unreachable';
      }
      if (!this.running || this.ws || this.timer) return;
      if (verdict === 'unauthorized') {
        this.running = false;
        this.setState('unauthorized', { why: 'the server refused the token' });
        return;
      }
      if (verdict === 'unreachable') {
        this.lost('the server cannot be reached', 0, false);
        return;
      }
    }
    this.open('reconnecting');
  }

  startHeartbeat() {
    this.stopHeartbeat();
    const { everyMs, silenceMs } = this.heartbeat;
    if (!everyMs) return;
    this.beat = setInterval(() => {
      if (!this.ws) return;
      if (Date.now() - this.lastHeard > silenceMs) {
        // Nothing heard, not even a pong: the network is gone. Do not wait
        // for a close handshake that may never come.
        this.drop('no answer from the server');
        return;
      }
      this.send({ type: 'ping', req: 'heartbeat' });
    }, everyMs);
  }

  stopHeartbeat() {
    clearInterval(this.beat);
    this.beat = null;
  }
}
