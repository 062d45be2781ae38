// Type declarations of linger-client (the module itself is plain
// JavaScript: src/index.js).

export type ConnectionState = 'idle' | 'connecting' | 'connected' | 'reconnecting' | 'unauthorized';
export type AgentStatus = 'running' | 'waiting' | 'idle' | 'stopped';
export type Mode = 'control' | 'observe';
/** Compact attach (protocol §11): `true` on every attach, `'fresh'` only on one from nothing (last seq 0). */
export type Compact = boolean | 'fresh';
export type Unsubscribe = () => void;

/** A sequenced event (protocol §4). */
export interface LingerEvent {
  type: 'event';
  conversation_id: string;
  seq: number;
  ts: string;
  kind: string;
  data: Record<string, unknown>;
}

/** The server's `attached` reply. */
export interface Attached {
  type: 'attached';
  req?: string | number;
  conversation_id: string;
  status: AgentStatus;
  mode: Mode;
  head_seq: number;
  replay_from: number;
  replay_incomplete: boolean;
  pending_calls: string[];
  queued_messages: number;
  compact?: boolean;
}

export interface Ack {
  type: 'ack';
  req?: string | number;
  conversation_id: string;
  seq?: number;
  duplicate?: boolean;
}

export interface SendResult {
  /** seq of the `user_message` event. */
  seq: number;
  /** true when the server already had this client_msg_id (a resend). */
  duplicate: boolean;
  clientMsgId: string;
}

export interface ToolCall {
  callId: string;
  name: string;
  args: unknown;
  turnId: string;
  seq: number;
  conversation: Conversation;
}

export interface ConversationSummary {
  id: string;
  title: string;
  status: AgentStatus;
  head_seq: number;
  created_at: string;
  last_activity_at: string;
}

export type TranscriptItem =
  | { kind: 'user'; key: string; seq: number; text: string; clientMsgId: string | null }
  | { kind: 'assistant'; key: string; turnId: string; text: string; final: boolean }
  | {
      kind: 'tool';
      key: string;
      seq: number;
      turnId: string;
      callId: string;
      name: string;
      args: unknown;
      target: 'client' | 'agent' | string;
      answered: boolean;
      expired: boolean;
      output?: unknown;
      isError?: boolean;
    }
  | { kind: 'turn_end'; key: string; seq: number; turnId: string; status: string; error: string | null }
  | { kind: 'stopped'; key: string; seq: number; reason: string | null }
  | { kind: 'resumed'; key: string; seq: number }
  | { kind: 'gap'; key: string; from: number };

export interface TranscriptSnapshot {
  v: 1;
  lastSeq: number;
  items: TranscriptItem[];
  title: string;
  status: AgentStatus | null;
  stopReason: string | null;
  wasStopped: boolean;
  turnId: string | null;
}

/** A conversation rebuilt from its events, each seq applied once. */
export class Transcript {
  lastSeq: number;
  items: TranscriptItem[];
  title: string;
  status: AgentStatus | null;
  stopReason: string | null;
  apply(event: LingerEvent): boolean;
  pendingCalls(): TranscriptItem[];
  toJSON(): TranscriptSnapshot;
  static fromJSON(data: unknown): Transcript;
  on(name: 'add' | 'update' | 'remove', fn: (item: TranscriptItem) => void): Unsubscribe;
  on(name: 'change', fn: () => void): Unsubscribe;
}

export interface StoredConversation {
  lastSeq: number;
  transcript?: Transcript;
}

/** Where last seqs (and optionally transcripts) are kept. */
export interface SeqStore {
  load(id: string): StoredConversation | null | Promise<StoredConversation | null>;
  /** May read `state` later (a store may batch writes). */
  save(id: string, state: { readonly lastSeq: number; readonly transcript: Transcript }): void;
  remove(id: string): void;
}

export function memoryStore(): SeqStore;
export function localStorageStore(options?: {
  storage?: Storage;
  prefix?: string;
  transcript?: boolean;
  maxChars?: number;
  delayMs?: number;
}): SeqStore & { removeAll(): void; flush(): void };

export class LingerError extends Error {
  /** The server's error code, or disconnected, detached, closed, unauthorized, gap, read_only, not_attached, network, http_NNN. */
  code: string;
  status?: number;
  reason?: string;
}

export interface ClientOptions {
  /** The server's base URL, e.g. 'http://127.0.0.1:7420/' (in a page: document.baseURI). */
  url: string | URL;
  /** A token, or a function read at every connect. */
  token?: string | (() => string);
  /** A WebSocket constructor; default the global one. */
  WebSocket?: { new (url: string): WebSocket };
  fetch?: typeof fetch;
  store?: SeqStore;
  backoff?: { baseMs?: number; maxMs?: number };
  heartbeat?: { everyMs?: number; silenceMs?: number };
  connectTimeoutMs?: number;
}

/** linger's REST endpoints (protocol §2), with the client's token. */
export interface Rest {
  list(): Promise<ConversationSummary[]>;
  /** Creates and activates one without attaching (the websocket's create attaches). */
  create(options?: { title?: string }): Promise<ConversationSummary>;
  get(id: string): Promise<ConversationSummary>;
  delete(id: string): Promise<null>;
  addObserver(id: string, user: string): Promise<null>;
  events(id: string, after?: number): Promise<LingerEvent[]>;
}

export class LingerClient {
  constructor(options: ClientOptions);
  readonly rest: Rest;
  readonly state: ConnectionState;
  readonly connected: boolean;
  readonly store: SeqStore;
  connect(): Promise<void>;
  disconnect(): void;
  retryNow(): void;
  create(options?: { title?: string; closeDelay?: string }): Promise<Conversation>;
  /** `compact`: `true` asks every attach for a compact replay (protocol §11); `'fresh'` only an attach with nothing yet (last seq 0). */
  conversation(id: string, options?: { mode?: Mode; compact?: Compact }): Conversation;
  open(id: string, options?: { mode?: Mode; compact?: Compact }): Promise<Conversation>;
  list(): Promise<ConversationSummary[]>;
  get(id: string): Promise<ConversationSummary>;
  events(id: string, after?: number): Promise<LingerEvent[]>;
  delete(id: string): Promise<void>;
  on(name: 'state', fn: (state: ConnectionState, detail: { why?: string; code?: number; retryInMs?: number }) => void): Unsubscribe;
  on(name: 'error', fn: (error: LingerError) => void): Unsubscribe;
}

export interface OutboxEntry {
  clientMsgId: string;
  text: string;
}

export class Conversation {
  readonly id: string;
  readonly mode: Mode;
  readonly compact: Compact;
  readonly transcript: Transcript;
  readonly lastSeq: number;
  readonly status: AgentStatus | null;
  readonly attached: boolean;
  /** The server's reason when it detached this conversation (closed, user_limit, ...). */
  readonly detachReason: string | null;
  readonly outbox: readonly OutboxEntry[];
  attach(): Promise<Attached>;
  detach(): void;
  send(text: string, options?: { clientMsgId?: string }): Promise<SendResult>;
  stop(): Promise<Ack>;
  close(): Promise<Ack>;
  answer(callId: string, output: unknown, options?: { isError?: boolean }): Promise<Ack>;
  loadHistory(): Promise<number>;
  onEvent(fn: (event: LingerEvent, info: { replay: boolean; stored?: boolean }) => void): Unsubscribe;
  onToolCall(fn: (call: ToolCall) => unknown): Unsubscribe;
  on(name: 'event', fn: (event: LingerEvent, info: { replay: boolean; stored?: boolean }) => void): Unsubscribe;
  on(name: 'status', fn: (status: AgentStatus | null) => void): Unsubscribe;
  on(name: 'attached', fn: (reply: Attached) => void): Unsubscribe;
  on(name: 'detached', fn: (detail: { reason: string }) => void): Unsubscribe;
  on(name: 'outbox', fn: (outbox: readonly OutboxEntry[]) => void): Unsubscribe;
  on(name: 'connection', fn: (up: boolean) => void): Unsubscribe;
  on(name: 'reset', fn: (transcript: Transcript) => void): Unsubscribe;
  on(name: 'error', fn: (error: LingerError) => void): Unsubscribe;
}

export function backoffDelay(
  attempt: number,
  options: { baseMs: number; maxMs: number },
  random?: () => number,
): number;
