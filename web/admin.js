// The admin tab: shown only when the token is an admin's (the admin
// endpoints answer it; everyone else gets 404). It lists the conversations
// active now (GET /v1/admin/conversations) and the latest supervision
// decisions (GET /v1/admin/supervision?since=N), refreshed every 2 s while
// it is open. Apart from app.js: it only reads the token app.js keeps.

import { $, h, TOKEN_KEY } from './dom.js';

const REFRESH_MS = 2000;
const KEEP_DECISIONS = 50;


const admin = { token: '', head: 0, decisions: [], timer: null, error: null, probes: 0 };

// withHeaders: the answer as { body, headers } instead of the body alone.
async function call(path, withHeaders = false) {
  const response = await fetch(new URL(path, document.baseURI), {
    headers: { Authorization: `Bearer ${admin.token}` },
    cache: 'no-store',
  });
  if (!response.ok) {
    const error = new Error(`${response.status}`);
    error.status = response.status;
    throw error;
  }
  const body = await response.json();
  return withHeaders ? { body, headers: response.headers } : body;
}

function short(ms) {
  const s = Math.floor(ms / 1000);
  if (s < 1) return `${ms}ms`;
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

function since(iso) {
  const t = Date.parse(iso);
  return Number.isNaN(t) ? '' : short(Math.max(0, Date.now() - t));
}

function bytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1048576) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1048576).toFixed(1)} MiB`;
}

function renderConversations(list) {
  const body = $('admin-conversations').tBodies[0];
  body.replaceChildren();
  for (const c of list) {
    const tr = h('tr');
    tr.dataset.id = c.id;
    const status = c.stopping ? `stopping (${c.stopping})` : c.status;
    const cells = [
      c.id,
      c.user,
      status,
      String(c.attached),
      since(c.last_activity_at),
      c.turn ? short(c.turn.age_ms) : '–',
      String(c.queued),
      `${c.replay_buffer.events} ev, ${bytes(c.replay_buffer.bytes)}`,
      c.node || '–',
    ];
    cells.forEach((text, i) => tr.append(h('td', i === 0 ? 'mono' : '', text)));
    body.append(tr);
  }
  $('admin-empty').hidden = list.length > 0;
  $('admin-count').textContent = `${list.length} active`;
}

function inputs(values) {
  return Object.entries(values || {})
    .filter(([, v]) => v !== null)
    .map(([k, v]) => `${k}=${typeof v === 'string' ? v : JSON.stringify(v)}`)
    .join(' ');
}

function renderDecisions() {
  const ul = $('admin-decisions');
  ul.replaceChildren();
  for (const d of [...admin.decisions].reverse()) {
    const li = h('li');
    li.dataset.rule = d.rule;
    li.append(h('span', 'mono', d.at.slice(11, 19)), h('b', '', d.rule), h('span', 'outcome', d.outcome));
    const who = [d.conversation, d.user && `(${d.user})`].filter(Boolean).join(' ');
    if (who) li.append(h('span', 'mono', who));
    li.append(h('span', 'inputs', inputs(d.inputs)));
    ul.append(li);
  }
}

async function refresh() {
  try {
    const [{ body: list, headers }, page] = await Promise.all([
      call('v1/admin/conversations', true),
      call(`v1/admin/supervision?since=${admin.head}`),
    ]);
    admin.head = page.head;
    admin.decisions = admin.decisions.concat(page.decisions).slice(-KEEP_DECISIONS);
    // Cluster mode: nodes that did not answer the node this page asked.
    const missing = headers.get('Linger-Unanswered-Nodes');
    admin.error = missing
      ? `Not listed: the conversations of node ${missing.split(',').join(', ')} (did not answer in time).`
      : null;
    renderConversations(list);
    renderDecisions();
  } catch (e) {
    admin.error = e.status === 404 ? 'This token is no longer an admin’s.' : `Could not refresh: ${e.message}`;
  }
  $('admin-error').hidden = !admin.error;
  $('admin-error').textContent = admin.error || '';
}

function show(open) {
  $('admin').hidden = !open;
  document.querySelector('.layout').hidden = open;
  $('admin-tab').setAttribute('aria-pressed', String(open));
  $('admin-tab').textContent = open ? 'Chats' : 'Admin';
  clearInterval(admin.timer);
  admin.timer = null;
  if (open) {
    refresh();
    admin.timer = setInterval(() => {
      if (document.visibilityState === 'visible') refresh();
    }, REFRESH_MS);
  }
}

// Is the token an admin's? The tab is shown only then.
async function probe() {
  admin.token = localStorage.getItem(TOKEN_KEY) || '';
  admin.head = 0;
  admin.decisions = [];
  let yes = false;
  if (admin.token) {
    try {
      await call('v1/admin/conversations');
      yes = true;
    } catch {
      yes = false;
    }
  }
  $('admin-tab').hidden = !yes;
  // For the browser test: whether, and how many times, it was decided.
  admin.probes += 1;
  document.body.dataset.admin = yes ? 'yes' : 'no';
  document.body.dataset.adminProbes = String(admin.probes);
  if (!yes) show(false);
}

$('admin-tab').addEventListener('click', () => show($('admin').hidden));
// app.js stores the new token in its own submit handler: look after it.
$('token-form').addEventListener('submit', () => setTimeout(probe, 0));
probe();
