// REST calls (protocol §2) and the token they carry.

const TOKEN_KEY = 'linger.token';

export function getToken() {
  return localStorage.getItem(TOKEN_KEY) || '';
}

export function setToken(token) {
  if (token) localStorage.setItem(TOKEN_KEY, token);
  else localStorage.removeItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// Paths are relative to the page, so linger may sit behind a path prefix.
function url(path) {
  return new URL(path, document.baseURI).toString();
}

async function call(method, path, body) {
  const headers = { Authorization: `Bearer ${getToken()}` };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let response;
  try {
    response = await fetch(url(path), {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
    });
  } catch (e) {
    throw new ApiError(0, 'network', `the server cannot be reached (${e.message})`);
  }
  if (response.status === 204) return null;
  let data = null;
  try {
    data = await response.json();
  } catch {
    data = null;
  }
  if (!response.ok) {
    const err = (data && data.error) || {};
    throw new ApiError(response.status, err.code || `http_${response.status}`, err.message || response.statusText);
  }
  return data;
}

const conv = (id) => `v1/conversations/${encodeURIComponent(id)}`;

export const listConversations = () => call('GET', 'v1/conversations');
export const createConversation = (title) => call('POST', 'v1/conversations', title ? { title } : {});
export const getConversation = (id) => call('GET', conv(id));
export const deleteConversation = (id) => call('DELETE', conv(id));

// Every stored event after `after`, oldest first, page by page. Never
// activates the conversation.
export async function eventsAfter(id, after) {
  const all = [];
  let cursor = after;
  for (;;) {
    const page = await call('GET', `${conv(id)}/events?after=${cursor}&limit=1000`);
    const events = (page && page.events) || [];
    all.push(...events);
    if (events.length === 0) break;
    cursor = events[events.length - 1].seq;
    if (cursor >= page.head_seq) break;
  }
  return all;
}

// The websocket URL; browsers cannot set headers on a websocket, so the
// token goes in the query string.
export function socketUrl() {
  const u = new URL('v1/ws', document.baseURI);
  u.protocol = u.protocol === 'https:' ? 'wss:' : 'ws:';
  u.searchParams.set('token', getToken());
  return u.toString();
}
