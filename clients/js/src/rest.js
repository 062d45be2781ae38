// linger's REST endpoints (protocol §2), with the bearer token. Reading
// history here never activates a conversation.

import { LingerError } from './errors.js';

export class Rest {
  // base: the server's base URL (http or https); token(): the token now.
  constructor({ base, token, fetch }) {
    this.base = base;
    this.token = token;
    this.fetch = fetch;
  }

  url(path) {
    return new URL(path, this.base).toString();
  }

  async call(method, path, body) {
    const headers = { Authorization: `Bearer ${this.token()}` };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    let response;
    try {
      response = await this.fetch(this.url(path), {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: 'no-store',
      });
    } catch (e) {
      throw new LingerError('network', `the server cannot be reached (${e.message})`, { status: 0 });
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
      throw new LingerError(err.code || `http_${response.status}`, err.message || response.statusText, {
        status: response.status,
      });
    }
    return data;
  }

  list() {
    return this.call('GET', 'v1/conversations');
  }

  create({ title } = {}) {
    return this.call('POST', 'v1/conversations', title ? { title } : {});
  }

  get(id) {
    return this.call('GET', conv(id));
  }

  delete(id) {
    return this.call('DELETE', conv(id));
  }

  addObserver(id, user) {
    return this.call('POST', `${conv(id)}/observers`, { user });
  }

  // Every stored event with seq > after, oldest first, page by page.
  async events(id, after = 0) {
    const all = [];
    let cursor = after;
    for (;;) {
      const page = await this.call('GET', `${conv(id)}/events?after=${cursor}&limit=1000`);
      const events = (page && page.events) || [];
      all.push(...events);
      if (events.length === 0) break;
      cursor = events[events.length - 1].seq;
      if (cursor >= page.head_seq) break;
    }
    return all;
  }

  // 'ok', 'unauthorized' or 'unreachable': asked before a retry when a
  // socket could not even open.
  async probe() {
    try {
      await this.list();
      return 'ok';
    } catch (e) {
      if (e.status === 401) return 'unauthorized';
      return e.status === 0 ? 'unreachable' : 'ok';
    }
  }
}

const conv = (id) => `v1/conversations/${encodeURIComponent(id)}`;
