// Listener sets by event name. A listener that throws does not stop the
// others: the error is reported once to the console, so one bad callback
// in an app never breaks the protocol state machine that called it.

export class Emitter {
  constructor() {
    this.listeners = new Map();
  }

  // Returns a function that removes the listener.
  on(name, fn) {
    if (typeof fn !== 'function') throw new TypeError(`on('${name}'): a function is needed`);
    let set = this.listeners.get(name);
    if (!set) {
      set = new Set();
      this.listeners.set(name, set);
    }
    set.add(fn);
    return () => set.delete(fn);
  }

  emit(name, ...args) {
    const set = this.listeners.get(name);
    if (!set) return;
    for (const fn of [...set]) {
      try {
        fn(...args);
      } catch (e) {
        console.error(`linger: a '${name}' listener threw`, e);
      }
    }
  }
}
