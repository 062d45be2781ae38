// linger's JavaScript client: an ES module with no dependencies, for
// browsers and Node 20+. See clients/js/README.md.

export { LingerClient } from './client.js';
export { Conversation } from './conversation.js';
export { Transcript } from './transcript.js';
export { LingerError } from './errors.js';
export { memoryStore, localStorageStore } from './store.js';
export { backoffDelay } from './socket.js';
