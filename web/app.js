// The linger web page, on top of the JavaScript client (clients/js, served
// as ./linger/): conversations, a chat view that resumes by seq, client
// tool calls answered on cards, and the connection kept apart from the
// agent's status. The client does the protocol; this file draws it.

import { LingerClient, localStorageStore } from './linger/index.js';
import { renderMarkdown } from './markdown.js';
import { $, h, TOKEN_KEY } from './dom.js';

const getToken = () => localStorage.getItem(TOKEN_KEY) || '';
function setToken(token) {
  if (token) localStorage.setItem(TOKEN_KEY, token);
  else localStorage.removeItem(TOKEN_KEY);
}

// Each conversation's last seq and transcript, so a reload resumes.
const store = localStorageStore();


function ago(iso) {
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return '';
  const s = Math.max(0, Math.round((Date.now() - t) / 1000));
  if (s < 60) return `${s}s ago`;
  if (s < 3600) return `${Math.round(s / 60)}m ago`;
  if (s < 86400) return `${Math.round(s / 3600)}h ago`;
  return `${Math.round(s / 86400)}d ago`;
}

// ---- plain words ----

const STATUS_WORDS = { running: 'running', waiting: 'waiting for you', idle: 'idle', stopped: 'stopped' };
// agent_stopped reasons (protocol §4) and detached reasons.
const STOP_WORDS = {
  idle: 'it was idle for a while',
  user_limit: 'too many conversations',
  closed: 'it was closed',
  shutdown: 'server restart',
  restart_recovery: 'server restart',
  deleted: 'it was deleted',
  node_lost: 'server restart',
};
const DETACH_WORDS = {
  client: 'you detached',
  user_limit: 'too many conversations',
  closed: 'it was closed',
  deleted: 'it was deleted',
  shutdown: 'server restart',
  moved: 'it moved to another server',
};
const TURN_END_WORDS = {
  failed: 'The turn failed',
  stopped: 'Turn stopped.',
  abandoned: 'Turn abandoned: nobody was attached for too long.',
  interrupted: 'Turn interrupted by a server restart.',
};
const words = (table, reason) => table[reason] || (reason ? String(reason).replaceAll('_', ' ') : 'unknown reason');

function sendFailure(e) {
  if (e.code === 'queue_full') return 'not sent: too many messages are queued';
  if (e.code === 'limit_reached') return 'not sent: too many conversations are active';
  return `not sent: ${e.message}`;
}

// ---- state ----

const state = {
  client: null,
  list: [],
  listError: null,
  // The open conversation: { id, mode, conv, offs, failed, gone, problem,
  // summary }.
  open: null,
};
// A handle for debugging from the console (and for the browser test).
window.linger = state;

// The open conversation's status the list was last drawn with.
let lastListKey = '';

function startClient() {
  if (state.client) state.client.disconnect();
  state.client = null;
  if (!getToken()) {
    showConnection('idle');
    return;
  }
  const client = new LingerClient({ url: document.baseURI, token: getToken, store });
  client.on('state', (s, detail) => {
    if (client === state.client) showConnection(s, detail);
  });
  state.client = client;
  client.connect().catch(() => {
    // 'unauthorized' is shown by the state listener.
  });
}

// ---- connection indicator (never mixed up with the agent's status) ----

function showConnection(s, detail) {
  const node = $('conn');
  const text = {
    idle: getToken() ? 'offline' : 'not signed in',
    connecting: 'connecting…',
    connected: 'connected',
    reconnecting: 'reconnecting…',
    unauthorized: 'token refused',
  };
  node.dataset.state = s;
  node.textContent = text[s] || s;
  node.title = detail && detail.why && detail.retryInMs !== undefined ? `${detail.why}; retrying in ${Math.ceil(detail.retryInMs / 1000)}s` : '';
  if (s === 'unauthorized') {
    state.listError = 'The server refused this token.';
    renderList();
  }
  if (s === 'connected') refreshList();
  renderHead();
}

// ---- opening conversations ----

function route() {
  const m = /^#(open|observe)=(.+)$/.exec(location.hash);
  if (!m || !state.client) {
    closeView();
    return;
  }
  const mode = m[1] === 'observe' ? 'observe' : 'control';
  const id = decodeURIComponent(m[2]);
  if (state.open && state.open.id === id && state.open.mode === mode) return;
  openConversation(id, mode);
}

function leave() {
  const o = state.open;
  if (!o) return;
  o.offs.forEach((off) => off());
  // Detached and forgotten: opening it again (maybe in another mode)
  // makes a new handle from the stored seq and transcript.
  if (!o.gone) o.conv.detach();
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
  // Nothing kept for it (a first open, another browser): a compact replay,
  // whole replies without their streamed pieces. Resuming from a kept seq
  // gets everything missed, in full.
  const conv = state.client.conversation(id, { mode, compact: 'fresh' });
  const o = {
    id,
    mode,
    conv,
    offs: [],
    failed: [],
    gone: null,
    problem: null,
    summary: state.list.find((s) => s.id === id) || null,
  };
  state.open = o;
  bindTranscript(o);
  o.offs.push(
    conv.on('reset', () => bindTranscript(o)),
    conv.on('event', (ev) => {
      if (ev.kind === 'agent_stopped' && ev.data && ev.data.reason === 'deleted') o.gone = 'This conversation was deleted.';
      // A stop or a start here often goes with one elsewhere (user limit).
      if (ev.kind === 'agent_stopped' || ev.kind === 'agent_started') refreshSoon();
      renderHead();
    }),
    conv.on('attached', () => {
      o.problem = null;
      renderHead();
    }),
    conv.on('detached', ({ reason }) => {
      if (reason === 'deleted') o.gone = 'This conversation was deleted.';
      renderHead();
    }),
    conv.on('outbox', () => renderOutbox()),
    conv.on('connection', () => renderHead()),
    conv.on('error', (e) => {
      if (e.code === 'gap') return; // the client attaches again by itself
      if (e.code === 'not_found') {
        o.gone = 'This conversation does not exist (any more).';
        store.remove(o.id);
      } else if (e.code === 'limit_reached') {
        o.problem = 'Too many conversations are active; close one to resume this one.';
      } else {
        o.problem = e.message;
      }
      renderHead();
    }),
  );
  $('empty').hidden = true;
  $('conversation').hidden = false;
  renderOutbox();
  renderHead();
  renderList();
  if (mode === 'control') $('message').focus();
  sync(o);
}

// Attaches, or reads a stopped conversation's history over REST without
// starting it again.
async function sync(o) {
  if (o.gone) return;
  let summary = null;
  try {
    summary = await state.client.get(o.id);
  } catch (e) {
    if (state.open !== o) return;
    if (e.status === 404) {
      o.gone = 'This conversation does not exist (any more).';
      store.remove(o.id);
      renderHead();
      return;
    }
  }
  if (state.open !== o) return;
  if (summary) {
    o.summary = summary;
    if (summary.title) o.conv.transcript.title = summary.title;
  }
  if (summary && summary.status === 'stopped' && o.conv.outbox.length === 0) {
    try {
      await o.conv.loadHistory();
      o.conv.transcript.status = 'stopped';
    } catch (e) {
      o.problem = `Could not read the history: ${e.message}`;
    }
    renderHead();
    return;
  }
  o.conv.attach().catch(() => {
    // Reported by the 'error' listener.
  });
}

// ---- sending ----

function sendMessage(text) {
  const o = state.open;
  if (!o || o.mode !== 'control' || o.gone) return;
  o.problem = null;
  o.conv.send(text).catch((e) => {
    o.failed.push({ text, error: sendFailure(e) });
    renderOutbox();
  });
  renderOutbox();
}

// ---- rendering the transcript ----

function bindTranscript(o) {
  if (o.unbind) o.unbind();
  const t = o.conv.transcript;
  const offs = [t.on('add', (item) => view.add(item)), t.on('update', (item) => view.update(item)), t.on('remove', (item) => view.remove(item))];
  o.unbind = () => offs.forEach((off) => off());
  o.offs.push(o.unbind);
  view.reset(t);
}

// Streamed text is drawn at most once a frame: a long reply would
// otherwise be parsed as Markdown for every word.
const dirty = new Map();
let frame = 0;
function drawSoon(item, node) {
  dirty.set(node, item);
  if (!frame) frame = requestAnimationFrame(drawDirty);
}
function drawDirty() {
  frame = 0;
  const stick = nearBottom();
  for (const [node, item] of dirty) drawText(node, item);
  dirty.clear();
  scrollDown(stick);
}
function drawText(node, item) {
  renderMarkdown(node, item.text);
  node.dataset.final = String(item.final);
}

const view = {
  nodes: new Map(),
  reset(t) {
    this.nodes.clear();
    dirty.clear();
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
    renderOutbox();
  },
  update(item) {
    const old = this.nodes.get(item.key);
    if (!old) return this.add(item);
    if (item.kind === 'assistant') {
      // The final text at once; streamed words with the next frame.
      if (item.final) {
        dirty.delete(old);
        const stick = nearBottom();
        drawText(old, item);
        scrollDown(stick);
      } else {
        drawSoon(item, old);
      }
      return undefined;
    }
    const stick = nearBottom();
    const node = renderItem(item);
    old.replaceWith(node);
    this.nodes.set(item.key, node);
    scrollDown(stick);
    return undefined;
  },
  remove(item) {
    const node = this.nodes.get(item.key);
    if (node) {
      dirty.delete(node);
      node.remove();
    }
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
  switch (item.kind) {
    case 'user': {
      const node = h('div', 'msg user', item.text);
      node.dataset.seq = item.seq;
      return node;
    }
    case 'assistant': {
      const node = h('div', 'msg assistant');
      node.dataset.turn = item.turnId;
      drawText(node, item);
      return node;
    }
    case 'tool':
      return renderTool(item);
    case 'turn_end': {
      const base = TURN_END_WORDS[item.status] || `Turn ended: ${item.status}.`;
      const text = item.status === 'failed' && item.error ? `${base}: ${item.error}` : base;
      return h('div', item.status === 'failed' ? 'note bad' : 'note', text);
    }
    case 'stopped':
      return h('div', 'note', `Stopped: ${words(STOP_WORDS, item.reason)}.`);
    case 'resumed':
      return h('div', 'note', 'Resumed.');
    case 'gap':
      return h('div', 'note', 'Older history was deleted by retention.');
    default:
      return h('div', 'note', '');
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
  card.dataset.call = item.callId;
  card.dataset.state = item.answered ? 'answered' : item.expired ? 'expired' : 'pending';
  const head = h('div', 'tool-head', `Tool call: ${item.name}`);
  head.append(h('span', 'mono', item.callId));
  card.append(head);
  card.append(h('pre', 'mono', json(item.args)));
  if (item.answered) {
    card.append(h('div', 'tool-output', `${item.isError ? 'error' : 'result'}: ${JSON.stringify(item.output)}`));
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
    o.conv.answer(item.callId, output, { isError: isError.checked }).then(
      () => {
        card.dataset.sent = 'true';
      },
      (e) => {
        if (e.code === 'unknown_call') error.textContent = 'This call was already answered.';
        else if (e.code === 'not_attached' || e.code === 'disconnected') {
          error.textContent = 'Not connected: try again when the connection is back.';
        } else error.textContent = e.message;
      },
    );
  });
  card.append(form);
  return card;
}

// Messages not acknowledged yet (until their event is in the transcript),
// and those the server refused.
function renderOutbox() {
  const box = $('outbox');
  box.replaceChildren();
  const o = state.open;
  if (!o) return;
  const shown = new Set(o.conv.transcript.items.filter((i) => i.kind === 'user' && i.clientMsgId).map((i) => i.clientMsgId));
  for (const m of o.conv.outbox) {
    if (!shown.has(m.clientMsgId)) box.append(h('div', 'msg user pending', m.text));
  }
  for (const f of o.failed) {
    const node = h('div', 'msg user failed', f.text);
    node.append(h('span', 'why', `${f.error} (click to dismiss)`));
    node.addEventListener('click', () => {
      o.failed = o.failed.filter((x) => x !== f);
      renderOutbox();
    });
    box.append(node);
  }
}

function bannerText(o) {
  if (o.gone) return ['gone', o.gone];
  if (o.problem) return ['warn', o.problem];
  const t = o.conv.transcript;
  if (t.status === 'stopped') {
    const why = t.stopReason ? words(STOP_WORDS, t.stopReason) : words(DETACH_WORDS, o.conv.detachReason);
    if (o.mode === 'observe') return ['warn', `Stopped: ${why}. Only its owner can resume it.`];
    return ['warn', `Stopped: ${why}. Send a message to resume it.`];
  }
  if (o.mode === 'control' && !o.conv.attached && o.conv.detachReason) {
    return ['warn', `Detached: ${words(DETACH_WORDS, o.conv.detachReason)}. Send a message to resume it.`];
  }
  return null;
}

function renderHead() {
  const o = state.open;
  if (!o) return;
  const t = o.conv.transcript;
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
  $('stop').disabled = !(o.conv.attached && (status === 'running' || status === 'waiting'));
  $('close').disabled = !(o.conv.attached && status !== 'stopped');
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
  if (`${o.id}:${status}` !== lastListKey) renderList();
}

function renderList() {
  const o = state.open;
  const openStatus = o ? o.conv.transcript.status || (o.summary && o.summary.status) || '' : '';
  lastListKey = o ? `${o.id}:${openStatus}` : '';
  const ul = $('conversations');
  ul.replaceChildren();
  const err = $('list-error');
  err.hidden = !state.listError;
  err.textContent = state.listError || '';
  for (const s of state.list) {
    const li = h('li');
    li.dataset.id = s.id;
    if (o && o.id === s.id) li.classList.add('open');
    const status = o && o.id === s.id && o.conv.transcript.status ? o.conv.transcript.status : s.status;
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
    ul.append(h('li', 'c-meta', getToken() ? 'No conversations yet.' : 'Enter your token above.'));
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
  const client = state.client;
  if (!client) return;
  try {
    const list = await client.list();
    if (client !== state.client) return;
    state.list = list;
    state.listError = null;
  } catch (e) {
    if (client !== state.client) return;
    state.listError = e.status === 401 ? 'The server refused this token.' : `Could not list conversations: ${e.message}`;
  }
  renderList();
  const o = state.open;
  if (o && o.mode === 'control' && !o.conv.wanted && !o.gone && client.connected) {
    const s = state.list.find((x) => x.id === o.id);
    // Another tab or client resumed it: follow along.
    if (s && s.status !== 'stopped' && o.conv.transcript.status === 'stopped') sync(o);
  }
}

// ---- controls ----

$('token-form').addEventListener('submit', (ev) => {
  ev.preventDefault();
  const token = $('token').value.trim();
  // The open conversation's handle belongs to the client being replaced.
  closeView();
  if (token !== getToken()) {
    store.removeAll();
    history.replaceState(null, '', location.pathname + location.search);
  }
  setToken(token);
  state.list = [];
  state.listError = null;
  startClient();
  renderList();
  refreshList();
  route();
});

$('new-form').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  const title = $('new-title').value.trim();
  if (!state.client) return;
  try {
    const summary = await state.client.rest.create({ title });
    $('new-title').value = '';
    state.list = [summary, ...state.list.filter((s) => s.id !== summary.id)];
    renderList();
    location.hash = `#open=${encodeURIComponent(summary.id)}`;
  } catch (e) {
    state.listError =
      e.code === 'limit_reached' ? 'Too many conversations are active: close one first.' : `Could not create a conversation: ${e.message}`;
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

function control(action) {
  const o = state.open;
  if (!o) return;
  action(o.conv).catch((e) => {
    o.problem = e.message;
    renderHead();
  });
}

$('stop').addEventListener('click', () => control((conv) => conv.stop()));
$('close').addEventListener('click', () => control((conv) => conv.close()));

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
    await state.client.delete(o.id);
    state.list = state.list.filter((s) => s.id !== o.id);
    if (state.open === o) {
      o.gone = 'deleted';
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

$('token').value = getToken();
showConnection('idle');
renderList();
startClient();
refreshList();
route();
setInterval(() => {
  if (document.visibilityState === 'visible') refreshList();
}, 5000);
