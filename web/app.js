// The linger web client: conversations, a chat view that resumes by seq,
// client tool calls, and a socket that comes back by itself.

import * as api from './api.js';
import { Connection } from './connection.js';
import { Transcript, stopWords, detachWords } from './transcript.js';

const $ = (id) => document.getElementById(id);

function h(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function newId() {
  if (crypto.randomUUID) return crypto.randomUUID();
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
}

function ago(iso) {
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return '';
  const s = Math.max(0, Math.round((Date.now() - t) / 1000));
  if (s < 60) return `${s}s ago`;
  if (s < 3600) return `${Math.round(s / 60)}m ago`;
  if (s < 86400) return `${Math.round(s / 3600)}h ago`;
  return `${Math.round(s / 86400)}d ago`;
}

const STATUS_WORDS = { running: 'running', waiting: 'waiting for you', idle: 'idle', stopped: 'stopped' };

// The open conversation's status the list was last drawn with.
let lastListKey = '';

const state = {
  list: [],
  listError: null,
  // The open conversation: { id, mode, transcript, attached, attaching,
  // outbox, gone, problem }.
  open: null,
};

const conn = new Connection({
  url: api.socketUrl,
  check: async () => {
    try {
      await api.listConversations();
      return 'ok';
    } catch (e) {
      if (e.status === 401) return 'unauthorized';
      return e.status === 0 ? 'unreachable' : 'ok';
    }
  },
  onOpen: () => sync(),
  onFrame: (frame) => onFrame(frame),
  onState: (s, detail) => showConnection(s, detail),
});

// A handle for debugging from the console (and for the browser test).
window.linger = { connection: conn, state };

// ---- connection indicator (never mixed up with the agent's status) ----

function showConnection(s, detail) {
  const node = $('conn');
  const words = {
    idle: api.getToken() ? 'offline' : 'not signed in',
    connecting: 'connecting…',
    connected: 'connected',
    reconnecting: 'reconnecting…',
    unauthorized: 'token refused',
  };
  node.dataset.state = s;
  node.textContent = words[s] || s;
  node.title = detail && detail.why ? `${detail.why}; retrying in ${Math.ceil(detail.retryInMs / 1000)}s` : '';
  if (s !== 'connected') {
    const o = state.open;
    if (o) {
      // The server detaches a socket that goes away; what was sent and not
      // acknowledged is sent again (same client_msg_id) after the re-attach.
      o.attached = false;
      o.attaching = false;
      for (const m of o.outbox) if (!m.acked) m.sent = false;
    }
  }
  if (s === 'unauthorized') {
    state.listError = 'The server refused this token.';
    renderList();
  }
  renderHead();
}

// ---- frames ----

function onFrame(f) {
  const o = state.open;
  const mine = o && f.conversation_id === o.id;
  switch (f.type) {
    case 'event':
      if (mine) {
        o.transcript.apply(f);
        if (f.kind === 'user_message' && f.data && f.data.client_msg_id) {
          o.outbox = o.outbox.filter((m) => m.cmid !== f.data.client_msg_id);
          renderOutbox();
        }
        if (f.kind === 'agent_stopped' && f.data && f.data.reason === 'deleted') {
          o.gone = 'This conversation was deleted.';
        }
        // A stop or a start here often goes with one elsewhere (user limit).
        if (f.kind === 'agent_stopped' || f.kind === 'agent_started') refreshSoon();
        scheduleSave();
        renderHead();
      }
      break;
    case 'attached':
      if (!mine) {
        // An attach that raced with switching away: let it go.
        conn.send({ type: 'detach', conversation_id: f.conversation_id });
        break;
      }
      o.attached = true;
      o.attaching = false;
      o.problem = null;
      o.transcript.gap(f.replay_from);
      if (f.replay_from > o.transcript.lastSeq + 1) o.transcript.lastSeq = f.replay_from - 1;
      o.detachReason = null;
      o.transcript.status = f.status;
      flushOutbox();
      renderHead();
      break;
    case 'detached':
      if (mine) {
        o.attached = false;
        o.attaching = false;
        if (f.reason === 'deleted') o.gone = 'This conversation was deleted.';
        else if (f.reason !== 'client') o.detachReason = f.reason;
        renderHead();
      }
      break;
    case 'ack':
      onAck(f);
      break;
    case 'error':
      onError(f);
      break;
    default:
      break;
  }
}

function reqParts(f) {
  const req = typeof f.req === 'string' ? f.req : '';
  const i = req.indexOf(':');
  return i < 0 ? [req, ''] : [req.slice(0, i), req.slice(i + 1)];
}

function onAck(f) {
  const o = state.open;
  if (!o || f.conversation_id !== o.id) return;
  const [what, key] = reqParts(f);
  if (what === 'msg') {
    const m = o.outbox.find((x) => x.cmid === key);
    if (m) m.acked = true;
  } else if (what === 'tool') {
    const card = document.querySelector(`.tool[data-call="${CSS.escape(key)}"]`);
    if (card) card.dataset.sent = 'true';
  }
}

function onError(f) {
  const o = state.open;
  const [what, key] = reqParts(f);
  if (!o) return;
  if (what === 'attach' && key === o.id) {
    o.attaching = false;
    if (f.code === 'not_found') {
      o.gone = 'This conversation does not exist (any more).';
      Transcript.forget(o.id);
    } else if (f.code === 'limit_reached') {
      o.problem = 'Too many conversations are active; close one to resume this one.';
      failOutbox(o, 'not sent: too many conversations are active');
    } else {
      o.problem = `Could not attach: ${f.message}`;
      failOutbox(o, `not sent: ${f.message}`);
    }
  } else if (what === 'msg') {
    const m = o.outbox.find((x) => x.cmid === key);
    if (!m) return;
    if (f.code === 'not_attached') {
      o.attached = false;
      m.sent = false;
      flushOutbox();
      return;
    }
    m.error = f.code === 'queue_full' ? 'not sent: too many messages are queued' : `not sent: ${f.message}`;
  } else if (what === 'tool') {
    const card = document.querySelector(`.tool[data-call="${CSS.escape(key)}"]`);
    const line = card && card.querySelector('.tool-error');
    if (line) line.textContent = f.code === 'unknown_call' ? 'This call was already answered.' : f.message;
  } else if (f.conversation_id === o.id || !f.conversation_id) {
    o.problem = f.message;
  }
  renderHead();
  renderOutbox();
}

function failOutbox(o, why) {
  for (const m of o.outbox) if (!m.sent) m.error = why;
}

// ---- attach, or read history without activating ----

async function sync() {
  const o = state.open;
  if (!o || o.gone) return;
  let summary = null;
  try {
    summary = await api.getConversation(o.id);
  } catch (e) {
    if (state.open !== o) return;
    if (e.status === 404) {
      o.gone = 'This conversation does not exist (any more).';
      Transcript.forget(o.id);
      renderHead();
      return;
    }
  }
  if (state.open !== o) return;
  if (summary) {
    o.summary = summary;
    o.transcript.title = summary.title || o.transcript.title;
  }
  const wantsResume = o.mode === 'control' && o.outbox.some((m) => !m.error);
  if (summary && summary.status === 'stopped' && !wantsResume) {
    // Reading a stopped conversation does not start it again.
    try {
      const events = await api.eventsAfter(o.id, o.transcript.lastSeq);
      if (state.open !== o) return;
      events.forEach((ev) => o.transcript.apply(ev));
      o.transcript.status = 'stopped';
      scheduleSave();
    } catch (e) {
      o.problem = `Could not read the history: ${e.message}`;
    }
    renderHead();
    return;
  }
  attach(o);
}

function attach(o) {
  if (!conn.connected || o.attached || o.attaching || o.gone) return;
  o.attaching = true;
  conn.send({
    type: 'attach',
    conversation_id: o.id,
    last_seq: o.transcript.lastSeq,
    mode: o.mode,
    req: `attach:${o.id}`,
  });
}

// ---- sending ----

function flushOutbox() {
  const o = state.open;
  if (!o || o.mode !== 'control' || o.gone) return;
  if (!o.outbox.some((m) => !m.sent && !m.error)) return;
  if (!conn.connected) return;
  if (!o.attached) {
    // A stopped conversation resumes: attach first, then the message.
    attach(o);
    return;
  }
  for (const m of o.outbox) {
    if (m.sent || m.error) continue;
    conn.send({ type: 'message', conversation_id: o.id, text: m.text, client_msg_id: m.cmid, req: `msg:${m.cmid}` });
    m.sent = true;
  }
  renderOutbox();
}

function sendMessage(text) {
  const o = state.open;
  if (!o || o.mode !== 'control' || o.gone) return;
  o.outbox.push({ cmid: newId(), text, sent: false, acked: false, error: null });
  o.problem = null;
  renderOutbox();
  flushOutbox();
}

function sendToolResult(callId, output, isError) {
  const o = state.open;
  if (!o || !o.attached) return false;
  return conn.send({
    type: 'tool_result',
    conversation_id: o.id,
    call_id: callId,
    output,
    is_error: isError,
    req: `tool:${callId}`,
  });
}

// ---- saving the transcript for reloads ----

let saveTimer = null;
function scheduleSave() {
  if (saveTimer) return;
  saveTimer = setTimeout(() => {
    saveTimer = null;
    if (state.open && !state.open.gone) state.open.transcript.save();
  }, 200);
}
window.addEventListener('pagehide', () => {
  if (state.open && !state.open.gone) state.open.transcript.save();
});

// ---- opening conversations ----

function route() {
  const m = /^#(open|observe)=(.+)$/.exec(location.hash);
  if (!m) {
    closeView();
    return;
  }
  const mode = m[1] === 'observe' ? 'observe' : 'control';
  const id = decodeURIComponent(m[2]);
  if (state.open && state.open.id === id && state.open.mode === mode) return;
  openConversation(id, mode);
}

function leave() {
  const prev = state.open;
  if (!prev) return;
  if (prev.attached || prev.attaching) conn.send({ type: 'detach', conversation_id: prev.id });
  prev.transcript.view = null;
  if (!prev.gone) prev.transcript.save();
  state.open = null;
}

function closeView() {
  leave();
  $('conversation').hidden = true;
  $('empty').hidden = false;
  renderList();
}

function openConversation(id, mode) {
  leave();
  const transcript = Transcript.load(id);
  const o = {
    id,
    mode,
    transcript,
    attached: false,
    attaching: false,
    outbox: [],
    gone: null,
    problem: null,
    detachReason: null,
    summary: state.list.find((s) => s.id === id) || null,
  };
  state.open = o;
  $('empty').hidden = true;
  $('conversation').hidden = false;
  transcriptView.reset(transcript);
  transcript.view = transcriptView;
  renderOutbox();
  renderHead();
  renderList();
  if (mode === 'control') $('message').focus();
  sync();
}

// ---- rendering ----

const transcriptView = {
  nodes: new Map(),
  reset(t) {
    this.nodes.clear();
    $('transcript').replaceChildren();
    t.items.forEach((item) => this.add(item));
    scrollDown(true);
  },
  add(item) {
    const stick = nearBottom();
    const node = renderItem(item);
    this.nodes.set(item.key, node);
    $('transcript').append(node);
    scrollDown(stick);
  },
  update(item) {
    const old = this.nodes.get(item.key);
    if (!old) return this.add(item);
    const stick = nearBottom();
    if (item.k === 'text') {
      old.textContent = item.text;
      old.dataset.final = String(item.final);
    } else {
      const node = renderItem(item);
      old.replaceWith(node);
      this.nodes.set(item.key, node);
    }
    scrollDown(stick);
    return undefined;
  },
  remove(item) {
    const node = this.nodes.get(item.key);
    if (node) node.remove();
    this.nodes.delete(item.key);
  },
};

function nearBottom() {
  const t = $('transcript');
  return t.scrollHeight - t.scrollTop - t.clientHeight < 60;
}

function scrollDown(stick) {
  if (stick) {
    const t = $('transcript');
    t.scrollTop = t.scrollHeight;
  }
}

function renderItem(item) {
  switch (item.k) {
    case 'user': {
      const node = h('div', 'msg user', item.text);
      node.dataset.seq = item.seq;
      return node;
    }
    case 'text': {
      const node = h('div', 'msg assistant', item.text);
      node.dataset.turn = item.turn;
      node.dataset.final = String(item.final);
      return node;
    }
    case 'tool':
      return renderTool(item);
    default:
      return h('div', item.bad ? 'note bad' : 'note', item.text);
  }
}

function json(value) {
  try {
    return JSON.stringify(value, null, 2);
  } catch {
    return String(value);
  }
}

function renderTool(item) {
  const o = state.open;
  const card = h('div', 'tool');
  card.dataset.call = item.call_id;
  card.dataset.state = item.answered ? 'answered' : item.expired ? 'expired' : 'pending';
  const head = h('div', 'tool-head', `Tool call: ${item.name}`);
  head.append(h('span', 'mono', item.call_id));
  card.append(head);
  card.append(h('pre', 'mono', json(item.args)));
  if (item.answered) {
    card.append(h('div', 'tool-output', `${item.is_error ? 'error' : 'result'}: ${JSON.stringify(item.output)}`));
    return card;
  }
  if (item.expired) {
    card.append(h('div', 'tool-output', 'not answered: the turn ended'));
    return card;
  }
  if (item.target !== 'client') {
    card.append(h('div', 'tool-output', 'run by the agent'));
    return card;
  }
  if (!o || o.mode !== 'control') {
    card.append(h('div', 'tool-output', 'waiting for its owner to answer'));
    return card;
  }
  const form = h('form', 'tool-form');
  const input = h('textarea', 'json');
  input.placeholder = 'result as JSON, e.g. {"ok": true}';
  input.spellcheck = false;
  const row = h('div', 'tool-row');
  const label = h('label');
  const isError = h('input');
  isError.type = 'checkbox';
  label.append(isError, ' is an error');
  const button = h('button', 'primary', 'Send result');
  button.type = 'submit';
  row.append(button, label);
  const error = h('div', 'tool-error');
  form.append(input, row, error);
  form.addEventListener('submit', (ev) => {
    ev.preventDefault();
    let output;
    try {
      output = JSON.parse(input.value);
    } catch (e) {
      error.textContent = `Not valid JSON: ${e.message}`;
      return;
    }
    error.textContent = '';
    if (!sendToolResult(item.call_id, output, isError.checked)) {
      error.textContent = 'Not connected: try again when the connection is back.';
    }
  });
  card.append(form);
  return card;
}

function renderOutbox() {
  const box = $('outbox');
  box.replaceChildren();
  const o = state.open;
  if (!o) return;
  for (const m of o.outbox) {
    const node = h('div', m.error ? 'msg user failed' : 'msg user pending', m.text);
    if (m.error) {
      node.append(h('span', 'why', `${m.error} (click to dismiss)`));
      node.addEventListener('click', () => {
        o.outbox = o.outbox.filter((x) => x !== m);
        renderOutbox();
      });
    }
    box.append(node);
  }
}

function bannerText(o) {
  if (o.gone) return ['gone', o.gone];
  if (o.problem) return ['warn', o.problem];
  const t = o.transcript;
  if (t.status === 'stopped') {
    const why = t.stopReason ? stopWords(t.stopReason) : detachWords(o.detachReason);
    if (o.mode === 'observe') return ['warn', `Stopped: ${why}. Only its owner can resume it.`];
    return ['warn', `Stopped: ${why}. Send a message to resume it.`];
  }
  if (o.mode === 'control' && !o.attached && o.detachReason) {
    return ['warn', `Detached: ${detachWords(o.detachReason)}. Send a message to resume it.`];
  }
  return null;
}

function renderHead() {
  const o = state.open;
  if (!o) return;
  const t = o.transcript;
  $('title').textContent = t.title || (o.summary && o.summary.title) || 'Untitled conversation';
  $('conv-id').textContent = o.id;
  const status = t.status || (o.summary && o.summary.status) || '';
  const badge = $('agent-status');
  badge.dataset.status = status;
  badge.textContent = status ? `agent: ${STATUS_WORDS[status] || status}` : '';
  $('observe-badge').hidden = o.mode !== 'observe';
  const control = o.mode === 'control' && !o.gone;
  $('composer').hidden = !control;
  $('stop').hidden = !control;
  $('close').hidden = !control;
  $('delete').hidden = o.mode !== 'control';
  $('stop').disabled = !(o.attached && (status === 'running' || status === 'waiting'));
  $('close').disabled = !(o.attached && status !== 'stopped');
  const banner = $('banner');
  const text = bannerText(o);
  // The banner takes room from the transcript: keep its end in view.
  const stick = nearBottom();
  banner.hidden = !text;
  if (text) {
    banner.dataset.kind = text[0];
    banner.textContent = text[1];
  }
  scrollDown(stick);
  // The list shows the open conversation's live status: redraw it when
  // that changes, not on every streamed word.
  const listKey = `${o.id}:${status}`;
  if (listKey !== lastListKey) renderList();
}


function renderList() {
  const open = state.open;
  lastListKey = open ? `${open.id}:${open.transcript.status || (open.summary && open.summary.status) || ''}` : '';
  const ul = $('conversations');
  ul.replaceChildren();
  const err = $('list-error');
  err.hidden = !state.listError;
  err.textContent = state.listError || '';
  const o = state.open;
  for (const s of state.list) {
    const li = h('li');
    li.dataset.id = s.id;
    if (o && o.id === s.id) li.classList.add('open');
    const status = o && o.id === s.id && o.transcript.status ? o.transcript.status : s.status;
    li.append(h('span', 'c-title', s.title || 'Untitled'));
    const badge = h('span', 'badge', STATUS_WORDS[status] || status);
    badge.dataset.status = status;
    li.append(badge);
    li.append(h('span', 'c-meta', `${s.id.slice(0, 12)}… · ${ago(s.last_activity_at)}`));
    li.addEventListener('click', () => {
      location.hash = `#open=${encodeURIComponent(s.id)}`;
    });
    ul.append(li);
  }
  if (state.list.length === 0 && !state.listError) {
    ul.append(h('li', 'c-meta', api.getToken() ? 'No conversations yet.' : 'Enter your token above.'));
  }
}

let refreshTimer = null;
function refreshSoon() {
  if (refreshTimer) return;
  refreshTimer = setTimeout(() => {
    refreshTimer = null;
    refreshList();
  }, 300);
}

async function refreshList() {
  if (!api.getToken()) return;
  try {
    state.list = await api.listConversations();
    state.listError = null;
  } catch (e) {
    state.listError = e.status === 401 ? 'The server refused this token.' : `Could not list conversations: ${e.message}`;
  }
  renderList();
  const o = state.open;
  if (o && o.mode === 'control' && !o.attached && !o.attaching && !o.gone && conn.connected) {
    const s = state.list.find((x) => x.id === o.id);
    // Another tab or client resumed it: follow along.
    if (s && s.status !== 'stopped' && o.transcript.status === 'stopped') sync();
  }
}

// ---- controls ----

$('token-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const token = $('token').value.trim();
  if (token !== api.getToken()) {
    Transcript.forgetAll();
    closeView();
    history.replaceState(null, '', location.pathname + location.search);
  }
  api.setToken(token);
  state.list = [];
  state.listError = null;
  if (token) {
    conn.restart();
    refreshList();
  } else {
    conn.stop();
    renderList();
  }
});

$('new-form').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  const title = $('new-title').value.trim();
  try {
    const summary = await api.createConversation(title);
    $('new-title').value = '';
    state.list = [summary, ...state.list.filter((s) => s.id !== summary.id)];
    renderList();
    location.hash = `#open=${encodeURIComponent(summary.id)}`;
  } catch (e) {
    state.listError =
      e.code === 'limit_reached'
        ? 'Too many conversations are active: close one first.'
        : `Could not create a conversation: ${e.message}`;
    renderList();
  }
});

$('observe-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const id = $('observe-id').value.trim();
  if (id) location.hash = `#observe=${encodeURIComponent(id)}`;
});

$('composer').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const text = $('message').value;
  if (!text.trim()) return;
  $('message').value = '';
  sendMessage(text);
});

$('message').addEventListener('keydown', (ev) => {
  if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $('composer').requestSubmit();
  }
});

$('stop').addEventListener('click', () => {
  const o = state.open;
  if (o && o.attached) conn.send({ type: 'stop', conversation_id: o.id, req: `stop:${o.id}` });
});

$('close').addEventListener('click', () => {
  const o = state.open;
  if (o && o.attached) conn.send({ type: 'close', conversation_id: o.id, req: `close:${o.id}` });
});

let deleteArmed = null;
$('delete').addEventListener('click', async () => {
  const o = state.open;
  if (!o) return;
  const button = $('delete');
  if (deleteArmed !== o.id) {
    // Two clicks: no modal dialog.
    deleteArmed = o.id;
    button.textContent = 'Really delete?';
    setTimeout(() => {
      if (deleteArmed === o.id) {
        deleteArmed = null;
        button.textContent = 'Delete';
      }
    }, 4000);
    return;
  }
  deleteArmed = null;
  button.textContent = 'Delete';
  try {
    await api.deleteConversation(o.id);
    Transcript.forget(o.id);
    state.list = state.list.filter((s) => s.id !== o.id);
    if (state.open === o) {
      o.transcript.view = null;
      state.open = null;
      history.replaceState(null, '', location.pathname + location.search);
      closeView();
    }
  } catch (e) {
    o.problem = `Could not delete: ${e.message}`;
    renderHead();
  }
});

window.addEventListener('hashchange', route);

// ---- start ----

$('token').value = api.getToken();
showConnection('idle');
renderList();
if (api.getToken()) {
  conn.start();
  refreshList();
}
route();
setInterval(() => {
  if (document.visibilityState === 'visible') refreshList();
}, 5000);
