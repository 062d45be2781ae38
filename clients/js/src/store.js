// Where a conversation's last seq (and, optionally, its transcript) is
// kept between connections, so that a reconnect or a reload resumes where
// it left off. A store has three methods:
//   load(id)  -> {lastSeq, transcript?} or null (or a promise of it)
//   save(id, {lastSeq, transcript})     (read now or later: a store may
//                                        batch writes)
//   remove(id)
// memoryStore() is the default; localStorageStore() keeps them in a
// browser's localStorage.

import { Transcript } from './transcript.js';

export function memoryStore() {
  const saved = new Map();
  return {
    load: (id) => saved.get(id) || null,
    save: (id, state) => {
      saved.set(id, { lastSeq: state.lastSeq, transcript: state.transcript });
    },
    remove: (id) => {
      saved.delete(id);
    },
  };
}

// Options: storage (default globalThis.localStorage), prefix, transcript
// (also keep the transcript, default true: the seq and the items are
// written together under one key, so what a reload shows matches the seq
// it resumes from), maxChars (a bigger snapshot is not kept: a reload
// replays it instead), delayMs (writes are batched).
export function localStorageStore({
  storage = globalThis.localStorage,
  prefix = 'linger.conv.',
  transcript: keepTranscript = true,
  maxChars = 1_000_000,
  delayMs = 200,
} = {}) {
  if (!storage) throw new TypeError('localStorageStore: no localStorage here');
  const pending = new Map();
  let timer = null;

  const write = (id, state) => {
    const key = prefix + id;
    // Read at write time: the seq and the items of the same moment.
    const snapshot = keepTranscript && state.transcript ? state.transcript.toJSON() : null;
    const data = { v: 1, lastSeq: snapshot ? snapshot.lastSeq : state.lastSeq };
    if (snapshot) data.transcript = snapshot;
    const text = JSON.stringify(data);
    try {
      if (text.length > maxChars) storage.removeItem(key);
      else storage.setItem(key, text);
    } catch {
      // Quota: better no cache than a stale one.
      try {
        storage.removeItem(key);
      } catch {
        // Nothing more to do.
      }
    }
  };

  const flush = () => {
    clearTimeout(timer);
    timer = null;
    for (const [id, state] of pending) write(id, state);
    pending.clear();
  };

  if (typeof globalThis.addEventListener === 'function') globalThis.addEventListener('pagehide', flush);

  return {
    load(id) {
      const state = pending.get(id);
      if (state) return state;
      try {
        const raw = storage.getItem(prefix + id);
        if (!raw) return null;
        const data = JSON.parse(raw);
        if (!data || data.v !== 1 || !Number.isInteger(data.lastSeq) || data.lastSeq < 0) return null;
        if (!keepTranscript) return { lastSeq: data.lastSeq };
        const t = Transcript.fromJSON(data.transcript);
        // Only a transcript that matches the seq is worth resuming from.
        if (t.lastSeq !== data.lastSeq) return null;
        return { lastSeq: data.lastSeq, transcript: t };
      } catch {
        return null;
      }
    },
    save(id, state) {
      pending.set(id, state);
      if (!timer) timer = setTimeout(flush, delayMs);
    },
    remove(id) {
      pending.delete(id);
      storage.removeItem(prefix + id);
    },
    // Forgets every conversation this store kept (another user signs in).
    removeAll() {
      pending.clear();
      const keys = [];
      for (let i = 0; i < storage.length; i += 1) {
        const key = storage.key(i);
        if (key && key.startsWith(prefix)) keys.push(key);
      }
      keys.forEach((key) => storage.removeItem(key));
    },
    flush,
  };
}
