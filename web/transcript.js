// A conversation's transcript, built from its events only, in seq order.
// An event whose seq is not above the last one applied is ignored, so a
// replay after a reconnect or a reload never shows anything twice.

const CACHE_PREFIX = 'linger.conv.';
// A transcript bigger than this is not cached: a reload replays it instead.
const MAX_CACHE_CHARS = 1_000_000;

// agent_stopped reasons (protocol §4) and detached reasons, in plain words.
const STOP_WORDS = {
  idle: 'it was idle for a while',
  user_limit: 'too many conversations',
  closed: 'it was closed',
  shutdown: 'server restart',
  restart_recovery: 'server restart',
  deleted: 'it was deleted',
};
const DETACH_WORDS = {
  client: 'you detached',
  user_limit: 'too many conversations',
  closed: 'it was closed',
  deleted: 'it was deleted',
  shutdown: 'server restart',
};

export function stopWords(reason) {
  return STOP_WORDS[reason] || (reason ? String(reason).replaceAll('_', ' ') : 'unknown reason');
}

export function detachWords(reason) {
  return DETACH_WORDS[reason] || (reason ? String(reason).replaceAll('_', ' ') : 'unknown reason');
}

const TURN_END_NOTES = {
  failed: 'The turn failed',
  stopped: 'Turn stopped.',
  abandoned: 'Turn abandoned: nobody was attached for too long.',
  interrupted: 'Turn interrupted by a server restart.',
};

export class Transcript {
  constructor(id) {
    this.id = id;
    this.lastSeq = 0;
    this.items = [];
    this.title = '';
    this.status = null;
    this.stopReason = null;
    // Seen agent_stopped and no agent_started since (from events only).
    this.wasStopped = false;
    // { add(item), update(item), remove(item), reset() }; set by the page.
    this.view = null;
  }

  static load(id) {
    const t = new Transcript(id);
    try {
      const raw = localStorage.getItem(CACHE_PREFIX + id);
      if (!raw) return t;
      const data = JSON.parse(raw);
      if (data.v !== 1 || data.id !== id || !Array.isArray(data.items) || !Number.isInteger(data.lastSeq)) return t;
      t.lastSeq = data.lastSeq;
      t.items = data.items;
      t.title = data.title || '';
      t.status = data.status || null;
      t.stopReason = data.stopReason || null;
      t.wasStopped = !!data.wasStopped;
    } catch {
      return new Transcript(id);
    }
    return t;
  }

  // Items and lastSeq go together in one key, so a reload resumes from a
  // seq that matches what it shows.
  save() {
    const key = CACHE_PREFIX + this.id;
    const data = JSON.stringify({
      v: 1,
      id: this.id,
      lastSeq: this.lastSeq,
      items: this.items,
      title: this.title,
      status: this.status,
      stopReason: this.stopReason,
      wasStopped: this.wasStopped,
    });
    try {
      if (data.length > MAX_CACHE_CHARS) localStorage.removeItem(key);
      else localStorage.setItem(key, data);
    } catch {
      localStorage.removeItem(key);
    }
  }

  static forget(id) {
    localStorage.removeItem(CACHE_PREFIX + id);
  }

  static forgetAll() {
    const keys = [];
    for (let i = 0; i < localStorage.length; i += 1) {
      const key = localStorage.key(i);
      if (key && key.startsWith(CACHE_PREFIX)) keys.push(key);
    }
    keys.forEach((key) => localStorage.removeItem(key));
  }

  add(item) {
    this.items.push(item);
    if (this.view) this.view.add(item);
    return item;
  }

  update(item) {
    if (this.view) this.view.update(item);
  }

  remove(item) {
    const i = this.items.indexOf(item);
    if (i >= 0) this.items.splice(i, 1);
    if (this.view) this.view.remove(item);
  }

  note(key, text, bad = false) {
    return this.add({ k: 'note', key, text, bad });
  }

  // Events after a gap the server could not replay (retention).
  gap(replayFrom) {
    if (replayFrom > this.lastSeq + 1) {
      this.note(`gap${replayFrom}`, 'Older history was deleted by retention.');
    }
  }

  tool(callId) {
    return this.items.find((i) => i.k === 'tool' && i.call_id === callId);
  }

  pendingCalls() {
    return this.items.filter((i) => i.k === 'tool' && i.target === 'client' && !i.answered && !i.expired);
  }

  // Applies one event; returns false for one already applied.
  apply(ev) {
    if (!ev || typeof ev.seq !== 'number' || ev.seq <= this.lastSeq) return false;
    this.lastSeq = ev.seq;
    const d = ev.data || {};
    switch (ev.kind) {
      case 'conversation_created':
        this.title = d.title || '';
        break;
      case 'agent_started':
        if (this.wasStopped) this.note(`n${ev.seq}`, 'Resumed.');
        this.wasStopped = false;
        this.status = 'idle';
        this.stopReason = null;
        break;
      case 'user_message':
        this.add({ k: 'user', key: `u${ev.seq}`, seq: ev.seq, text: String(d.text ?? ''), cmid: d.client_msg_id || null });
        break;
      case 'turn_started':
        this.status = 'running';
        break;
      case 'text_delta': {
        const last = this.items[this.items.length - 1];
        if (last && last.k === 'text' && last.turn === d.turn_id && !last.final) {
          last.text += String(d.text ?? '');
          this.update(last);
        } else {
          this.add({ k: 'text', key: `x${ev.seq}`, turn: d.turn_id, text: String(d.text ?? ''), final: false });
        }
        break;
      }
      case 'assistant_message': {
        // The whole reply replaces what was streamed, never adds to it.
        const streamed = this.items.filter((i) => i.k === 'text' && i.turn === d.turn_id && !i.final);
        const keep = streamed.pop();
        streamed.forEach((i) => this.remove(i));
        if (keep && keep === this.items[this.items.length - 1]) {
          keep.text = String(d.text ?? '');
          keep.final = true;
          this.update(keep);
        } else {
          if (keep) this.remove(keep);
          this.add({ k: 'text', key: `x${ev.seq}`, turn: d.turn_id, text: String(d.text ?? ''), final: true });
        }
        break;
      }
      case 'tool_call':
        this.add({
          k: 'tool',
          key: `t${d.call_id}`,
          turn: d.turn_id,
          call_id: d.call_id,
          name: d.name,
          args: d.args ?? {},
          target: d.target,
          answered: false,
        });
        if (d.target === 'client') this.status = 'waiting';
        break;
      case 'tool_result': {
        const card = this.tool(d.call_id);
        if (card) {
          card.answered = true;
          card.output = d.output;
          card.is_error = !!d.is_error;
          this.update(card);
        }
        if (this.status === 'waiting' && this.pendingCalls().length === 0) this.status = 'running';
        break;
      }
      case 'turn_finished': {
        this.status = 'idle';
        for (const i of this.items) {
          if (i.turn !== d.turn_id) continue;
          if (i.k === 'text' && !i.final) {
            i.final = true;
            this.update(i);
          } else if (i.k === 'tool' && !i.answered && !i.expired) {
            // Its turn is over: the call can no longer be answered.
            i.expired = true;
            this.update(i);
          }
        }
        const note = TURN_END_NOTES[d.status];
        if (note) {
          const text = d.status === 'failed' && d.error ? `${note}: ${d.error}` : note;
          this.note(`n${ev.seq}`, text, d.status === 'failed');
        }
        break;
      }
      case 'agent_stopped':
        this.status = 'stopped';
        this.wasStopped = true;
        this.stopReason = d.reason || null;
        this.note(`n${ev.seq}`, `Stopped: ${stopWords(d.reason)}.`);
        break;
      default:
        // A kind this page does not know yet: nothing to show.
        break;
    }
    return true;
  }
}
