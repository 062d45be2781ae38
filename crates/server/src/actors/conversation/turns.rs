//! Turns: user messages and their queue, idempotency by `client_msg_id`,
//! starting and ending turns, client tool calls and what the agent reports.
//! A client's request reaches these handlers only from a controller: its
//! rights are judged before (`control.rs`).

use super::*;

impl State {
    pub(super) fn user_message(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        conn: ConnId,
        text: String,
        client_msg_id: Option<String>,
        req: Option<ReqId>,
    ) {
        if let Some(seq) = client_msg_id
            .as_ref()
            .and_then(|id| self.seen_msg_ids.get(id))
        {
            self.ack_when_committed(conn, req, seq, Some(true));
            return;
        }
        let max_queued = self.config.get().conversations.max_queued_messages;
        if self.turn.is_some() && self.queue.len() >= max_queued {
            self.refuse(
                conn,
                req,
                ErrorCode::QueueFull,
                format!(
                    "{max_queued} messages are already queued (conversations.max_queued_messages)"
                ),
            );
            return;
        }
        let seq = self.append(EventData::UserMessage {
            text: text.clone(),
            client_msg_id: client_msg_id.clone(),
        });
        if let Some(id) = client_msg_id {
            let window = self.config.get().conversations.client_msg_id_window;
            let forget_before = self.seen_msg_ids.insert(id.clone(), seq, window);
            self.log.add_client_msg_id(id, seq, forget_before);
        }
        self.ack_when_committed(conn, req, seq, Some(false));
        self.queue.push_back(QueuedMessage { seq, text });
        self.start_next_turn(myself);
    }

    pub(super) fn start_next_turn(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.turn.is_some() || self.stopping.is_some() {
            return;
        }
        let Some(message) = self.queue.pop_front() else {
            return;
        };
        let turn_id: Arc<str> = Arc::from(format!("t_{}", ulid::Ulid::new()));
        self.last_turn_message_seq = message.seq;
        let resumed_from = self
            .resume
            .take_if(|r| r.message_seq == message.seq)
            .map(|r| r.turn_id);
        if let Some(old) = &resumed_from {
            info!(conversation = %self.id, user = %self.user, turn = %turn_id, resumed_from = %old,
                "running an interrupted turn again (agent.resume_interrupted)");
        }
        self.append(EventData::TurnStarted {
            turn_id: turn_id.clone(),
            message_seq: message.seq,
            resumed_from: resumed_from.clone(),
        });
        // Taken before the timer is armed: when it fires, the turn has run
        // at least `agent.turn_timeout` by this clock.
        let started = Instant::now();
        let timeout =
            ractor::time::send_after(self.config.get().agent.turn_timeout, myself.get_cell(), {
                let turn_id = turn_id.clone();
                move || ConversationMsg::TurnTimeout { turn_id }
            });
        info!(conversation = %self.id, user = %self.user, turn = %turn_id,
            message_seq = message.seq, queued = self.queue.len(), "turn started");
        m::turn_started();
        self.turn = Some(Box::new(Turn {
            id: turn_id.clone(),
            started,
            started_at: std::time::SystemTime::now(),
            pending_calls: Vec::new(),
            timeout,
        }));
        self.session.start_turn(TurnRequest {
            turn_id,
            text: message.text,
            resumed: resumed_from.is_some(),
        });
    }

    pub(super) fn end_turn(
        &mut self,
        myself: &ActorRef<ConversationMsg>,
        status: TurnStatus,
        error: Option<String>,
    ) {
        let Some(turn) = self.turn.take() else {
            return;
        };
        turn.timeout.abort();
        info!(conversation = %self.id, user = %self.user, turn = %turn.id,
            status = status.as_str(), error = error.as_deref(), "turn finished");
        m::turn_finished(status);
        m::turn_duration(turn.started.elapsed());
        self.append(EventData::TurnFinished {
            turn_id: turn.id.clone(),
            status,
            error,
        });
        self.start_next_turn(myself);
    }

    pub(super) fn stop_turn(&mut self, myself: &ActorRef<ConversationMsg>) {
        if self.turn.is_some() {
            self.session.stop_turn();
            self.end_turn(myself, TurnStatus::Stopped, None);
        }
    }

    pub(super) fn tool_result(
        &mut self,
        conn: ConnId,
        call_id: String,
        output: Value,
        is_error: bool,
        req: Option<ReqId>,
    ) {
        let pending = self.turn.as_mut().and_then(|t| {
            let index = t.pending_calls.iter().position(|c| *c == call_id)?;
            t.pending_calls.remove(index);
            Some(t.id.clone())
        });
        let Some(turn_id) = pending else {
            self.refuse(
                conn,
                req,
                ErrorCode::UnknownCall,
                format!("no pending client tool call {call_id}"),
            );
            return;
        };
        let seq = self.append(EventData::ToolResult {
            turn_id: turn_id.clone(),
            call_id: call_id.clone(),
            output: output.clone(),
            is_error,
        });
        self.session.tool_result(&call_id, output, is_error);
        self.ack_when_committed(conn, req, seq, None);
    }

    /// Takes in everything the agent reported since the last doorbell, as
    /// if each event were its own message: the fanout is settled after each
    /// (an event may end the turn) and a full batch goes to the store at
    /// once.
    pub(super) fn agent_events(&mut self, myself: &ActorRef<ConversationMsg>) {
        for event in self.agent_inbox.take() {
            self.agent_event(myself, event);
            self.settle_fanout(myself);
            if self.log.batch_len() >= MAX_BATCH_EVENTS {
                self.flush(myself);
            }
        }
    }

    fn agent_event(&mut self, myself: &ActorRef<ConversationMsg>, event: AgentEvent) {
        let current = self.turn.as_ref().is_some_and(|t| t.id == event.turn_id);
        if !current || self.stopping.is_some() {
            // A stopped turn's runner may still report; its credit is free.
            if event.credited {
                self.credits.add_permits(1);
            }
            return;
        }
        if event.credited {
            self.log.add_credit();
        }
        let turn_id = event.turn_id;
        match event.output {
            AgentOutput::TextDelta(text) => {
                self.append(EventData::TextDelta { turn_id, text });
            }
            AgentOutput::AssistantMessage(text) => {
                self.append(EventData::AssistantMessage { turn_id, text });
            }
            AgentOutput::ToolCall {
                call_id,
                name,
                args,
            } => {
                self.append(EventData::ToolCall {
                    turn_id,
                    call_id: call_id.clone(),
                    name,
                    args,
                    target: ToolTarget::Client,
                });
                if let Some(turn) = self.turn.as_mut() {
                    turn.pending_calls.push(call_id);
                }
            }
            AgentOutput::Finished { failed } => {
                let status = if failed.is_some() {
                    TurnStatus::Failed
                } else {
                    TurnStatus::Completed
                };
                self.end_turn(myself, status, failed);
            }
        }
    }
}
