// Waiting for a condition that an event makes true: checked at once and
// after every event of the given emitters, never by sleeping. The bound
// only turns a hang into a failure that says what was awaited.

import { WAIT_MS } from './linger.js';

// until(what, check, [[emitter, 'event'], ...]) resolves with check()'s
// first truthy value.
export function until(what, check, sources) {
  return new Promise((resolve, reject) => {
    const offs = [];
    const done = (fn, value) => {
      clearTimeout(timer);
      offs.forEach((off) => off());
      fn(value);
    };
    const test = () => {
      let value;
      try {
        value = check();
      } catch (e) {
        done(reject, e);
        return;
      }
      if (value) done(resolve, value);
    };
    const timer = setTimeout(() => done(reject, new Error(`waited ${WAIT_MS} ms for ${what}`)), WAIT_MS);
    for (const [emitter, name] of sources) offs.push(emitter.on(name, test));
    test();
  });
}

// A promise with its resolve, for handlers the test releases.
export function gate() {
  let open;
  const promise = new Promise((resolve) => {
    open = resolve;
  });
  return { promise, open };
}

// A promise, bounded like until() so a hang fails and says what it was.
export function within(what, promise) {
  let timer;
  const bound = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`waited ${WAIT_MS} ms for ${what}`)), WAIT_MS);
  });
  return Promise.race([promise, bound]).finally(() => clearTimeout(timer));
}
