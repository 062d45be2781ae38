// One websocket that comes back by itself: exponential backoff with jitter,
// a heartbeat that notices a dead network, and a state the page shows.
//
// States: 'idle' (not started), 'connecting' (first attempt), 'connected',
// 'reconnecting' (the socket went away and a retry is scheduled or running),
// 'unauthorized' (the token was refused: retrying would not help).

const BASE_DELAY_MS = 500;
const MAX_DELAY_MS = 15000;
const PING_EVERY_MS = 20000;
const SILENCE_LIMIT_MS = 45000;

export class Connection {
  // url(): the URL to open; check(): resolves 'ok', 'unauthorized' or
  // 'unreachable' (asked before each retry); onOpen(), onFrame(frame),
  // onState(state, detail) are callbacks.
  constructor({ url, check, onOpen, onFrame, onState }) {
    this.url = url;
    this.check = check;
    this.onOpen = onOpen;
    this.onFrame = onFrame;
    this.onState = onState;
    this.ws = null;
    this.state = 'idle';
    this.attempt = 0;
    this.timer = null;
    this.heartbeat = null;
    this.lastHeard = 0;
    this.running = false;
    window.addEventListener('online', () => this.retryNow());
    document.addEventListener('visibilitychange', () => {
      if (document.visibilityState === 'visible') this.retryNow();
    });
  }

  start() {
    this.running = true;
    if (!this.ws && !this.timer) this.open(this.state === 'idle' ? 'connecting' : 'reconnecting');
  }

  // Stops for good (token changed, page going away).
  stop() {
    this.running = false;
    clearTimeout(this.timer);
    this.timer = null;
    this.stopHeartbeat();
    const ws = this.ws;
    this.ws = null;
    if (ws) ws.close(1000, 'client stopped');
    this.setState('idle');
  }

  restart() {
    this.stop();
    this.attempt = 0;
    this.start();
  }

  get connected() {
    return this.state === 'connected';
  }

  send(frame) {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  setState(state, detail) {
    this.state = state;
    this.onState(state, detail);
  }

  open(state) {
    this.timer = null;
    if (!this.running) return;
    this.setState(state);
    let ws;
    try {
      ws = new WebSocket(this.url());
    } catch (e) {
      this.lost(`cannot open the socket: ${e.message}`);
      return;
    }
    this.ws = ws;
    ws.onopen = () => {
      if (this.ws !== ws) return;
      this.attempt = 0;
      this.lastHeard = Date.now();
      this.startHeartbeat();
      this.setState('connected');
      this.onOpen();
    };
    ws.onmessage = (msg) => {
      if (this.ws !== ws) return;
      this.lastHeard = Date.now();
      let frame;
      try {
        frame = JSON.parse(msg.data);
      } catch {
        return;
      }
      this.onFrame(frame);
    };
    ws.onclose = (ev) => {
      if (this.ws !== ws) return;
      this.ws = null;
      this.stopHeartbeat();
      this.lost(`socket closed (code ${ev.code}${ev.reason ? `: ${ev.reason}` : ''})`);
    };
  }

  // The socket is gone, whatever the reason: a dropped socket is never
  // taken for the agent stopping.
  async lost(why) {
    if (!this.running) {
      this.setState('idle');
      return;
    }
    const base = Math.min(MAX_DELAY_MS, BASE_DELAY_MS * 2 ** Math.min(this.attempt, 10));
    this.attempt += 1;
    const delay = base / 2 + Math.random() * (base / 2);
    this.setState('reconnecting', { why, retryInMs: Math.round(delay) });
    this.timer = setTimeout(async () => {
      this.timer = null;
      if (!this.running || this.ws) return;
      const verdict = await this.check();
      if (!this.running || this.ws || this.timer) return;
      if (verdict === 'unauthorized') {
        this.running = false;
        this.setState('unauthorized');
        return;
      }
      if (verdict === 'unreachable') {
        this.lost('the server cannot be reached');
        return;
      }
      this.open('reconnecting');
    }, delay);
  }

  retryNow() {
    if (this.running && this.state === 'reconnecting' && this.timer) {
      clearTimeout(this.timer);
      this.timer = null;
      this.open('reconnecting');
    }
  }

  startHeartbeat() {
    this.stopHeartbeat();
    this.heartbeat = setInterval(() => {
      if (!this.ws) return;
      if (Date.now() - this.lastHeard > SILENCE_LIMIT_MS) {
        // Nothing heard, not even a pong: the network is gone. Do not wait
        // for a close handshake that may never come.
        const ws = this.ws;
        this.ws = null;
        this.stopHeartbeat();
        ws.close(4000, 'heartbeat lost');
        this.lost('no answer from the server');
        return;
      }
      this.send({ type: 'ping', req: 'heartbeat' });
    }, PING_EVERY_MS);
  }

  stopHeartbeat() {
    clearInterval(this.heartbeat);
    this.heartbeat = null;
  }
}
