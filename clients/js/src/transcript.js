// A conversation's transcript, rebuilt from its events only, in seq order:
// user messages, assistant replies (streamed text replaced by the whole
// reply), tool calls with their results, and how turns and the agent
// ended. An event whose seq is not above the last one applied is ignored,
// so a replay after a reconnect or a reload never adds anything twice.
//
// Items (plain data, so a snapshot is JSON):
//   {kind:'user', key, seq, text, clientMsgId}
//   {kind:'assistant', key, turnId, text, final}
//   {kind:'tool', key, turnId, callId, name, args, target, answered,
//    output, isError, expired}
//   {kind:'turn_end', key, seq, turnId, status, error}   (not 'completed')
//   {kind:'stopped', key, seq, reason}
//   {kind:'resumed', key, seq}       (agent_started after agent_stopped)
//   {kind:'gap', key, from}          (history deleted by retention)
// Listeners: on('add'|'update'|'remove', item), on('change').

import { Emitter } from './emitter.js';

const SNAPSHOT_VERSION = 1;

export class Transcript extends Emitter {
  constructor() {
    super();
    this.lastSeq = 0;
    this.items = [];
    this.title = '';
    // running, waiting, idle or stopped, from events (and `attached`).
    this.status = null;
    this.stopReason = null;
    // Seen agent_stopped and no agent_started since.
    this.wasStopped = false;
    // The turn started and not finished yet, if any.
    this.turnId = null;
  }

  toJSON() {
    return {
      v: SNAPSHOT_VERSION,
      lastSeq: this.lastSeq,
      items: this.items,
      title: this.title,
      status: this.status,
      stopReason: this.stopReason,
      wasStopped: this.wasStopped,
      turnId: this.turnId,
    };
  }

  // A transcript from a snapshot; an empty one when it is not usable.
  static fromJSON(data) {
    const t = new Transcript();
    if (!data || data.v !== SNAPSHOT_VERSION || !Array.isArray(data.items) || !Number.isInteger(data.lastSeq)) {
      return t;
    }
    t.lastSeq = data.lastSeq;
    t.items = data.items;
    t.title = typeof data.title === 'string' ? data.title : '';
    t.status = data.status || null;
    t.stopReason = data.stopReason || null;
    t.wasStopped = !!data.wasStopped;
    t.turnId = typeof data.turnId === 'string' ? data.turnId : null;
    return t;
  }

  // Client tool calls still waiting for an answer.
  pendingCalls() {
    return this.items.filter((i) => i.kind === 'tool' && i.target === 'client' && !i.answered && !i.expired);
  }

  tool(callId) {
    return this.items.find((i) => i.kind === 'tool' && i.callId === callId);
  }

  // A jump the server could not replay (retention deleted the history
  // before `from`).
  gap(from) {
    if (from > this.lastSeq + 1) {
      this.add({ kind: 'gap', key: `g${from}`, from });
      this.lastSeq = from - 1;
      this.emit('change');
    }
  }

  add(item) {
    this.items.push(item);
    this.emit('add', item);
    return item;
  }

  update(item) {
    this.emit('update', item);
  }

  remove(item) {
    const i = this.items.indexOf(item);
    if (i >= 0) this.items.splice(i, 1);
    this.emit('remove', item);
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
        if (this.wasStopped) this.add({ kind: 'resumed', key: `n${ev.seq}`, seq: ev.seq });
        this.wasStopped = false;
        this.status = 'idle';
        this.stopReason = null;
        break;
      case 'user_message':
        this.add({
          kind: 'user',
          key: `u${ev.seq}`,
          seq: ev.seq,
          text: String(d.text ?? ''),
          clientMsgId: d.client_msg_id || null,
        });
        break;
      case 'turn_started':
        this.status = 'running';
        this.turnId = d.turn_id || null;
        break;
      case 'text_delta': {
        const last = this.items[this.items.length - 1];
        if (last && last.kind === 'assistant' && last.turnId === d.turn_id && !last.final) {
          last.text += String(d.text ?? '');
          this.update(last);
        } else {
          this.add({ kind: 'assistant', key: `x${ev.seq}`, turnId: d.turn_id, text: String(d.text ?? ''), final: false });
        }
        break;
      }
      case 'assistant_message':
        this.assistantMessage(ev.seq, d);
        break;
      case 'tool_call':
        this.add({
          kind: 'tool',
          key: `t${d.call_id}`,
          seq: ev.seq,
          turnId: d.turn_id,
          callId: d.call_id,
          name: d.name,
          args: d.args ?? {},
          target: d.target,
          answered: false,
          expired: false,
        });
        if (d.target === 'client') this.status = 'waiting';
        break;
      case 'tool_result': {
        const card = this.tool(d.call_id);
        if (card) {
          card.answered = true;
          card.output = d.output;
          card.isError = !!d.is_error;
          this.update(card);
        }
        if (this.status === 'waiting' && this.pendingCalls().length === 0) this.status = 'running';
        break;
      }
      case 'turn_finished':
        this.turnFinished(ev.seq, d);
        break;
      case 'agent_stopped':
        this.status = 'stopped';
        this.turnId = null;
        this.wasStopped = true;
        this.stopReason = d.reason || null;
        this.add({ kind: 'stopped', key: `n${ev.seq}`, seq: ev.seq, reason: d.reason || null });
        break;
      default:
        // A kind this client does not know yet: nothing to show.
        break;
    }
    this.emit('change');
    return true;
  }

  // The whole reply replaces what was streamed, never adds to it (and
  // stands alone after a compact replay that left the stream out).
  assistantMessage(seq, d) {
    const text = String(d.text ?? '');
    const streamed = this.items.filter((i) => i.kind === 'assistant' && i.turnId === d.turn_id && !i.final);
    const keep = streamed.pop();
    streamed.forEach((i) => this.remove(i));
    if (keep && keep === this.items[this.items.length - 1]) {
      keep.text = text;
      keep.final = true;
      this.update(keep);
    } else {
      if (keep) this.remove(keep);
      this.add({ kind: 'assistant', key: `x${seq}`, turnId: d.turn_id, text, final: true });
    }
  }

  turnFinished(seq, d) {
    this.status = 'idle';
    if (this.turnId === d.turn_id) this.turnId = null;
    for (const i of this.items) {
      if (i.turnId !== d.turn_id) continue;
      if (i.kind === 'assistant' && !i.final) {
        i.final = true;
        this.update(i);
      } else if (i.kind === 'tool' && !i.answered && !i.expired) {
        // Its turn is over: the call can no longer be answered.
        i.expired = true;
        this.update(i);
      }
    }
    if (d.status && d.status !== 'completed') {
      this.add({ kind: 'turn_end', key: `n${seq}`, seq, turnId: d.turn_id, status: d.status, error: d.error || null });
    }
  }
}
