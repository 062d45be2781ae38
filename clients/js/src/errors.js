// The one error type of the client: a protocol error reply (`code` is the
// server's, protocol §4) or a local condition (`disconnected`, `detached`,
// `closed`, `http_NNN`, `network`).

export class LingerError extends Error {
  constructor(code, message, details = {}) {
    super(message || code);
    this.name = 'LingerError';
    this.code = code;
    Object.assign(this, details);
  }
}
