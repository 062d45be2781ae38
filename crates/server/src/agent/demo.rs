//! The deterministic demo agent of protocol §8: what users try linger with and
//! what the acceptance tests drive every scenario through.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use super::{Agent, AgentOutput, AgentSession, EventSink, SessionContext};

pub struct DemoAgent;

impl Agent for DemoAgent {
    fn open(&self, ctx: SessionContext) -> Box<dyn AgentSession> {
        Box::new(DemoSession {
            events: ctx.events,
            turn: None,
        })
    }
}

struct RunningTurn {
    abort: AbortHandle,
    tool_results: mpsc::UnboundedSender<ToolAnswer>,
}

struct ToolAnswer {
    call_id: String,
    output: Value,
}

struct DemoSession {
    events: EventSink,
    turn: Option<RunningTurn>,
}

impl AgentSession for DemoSession {
    fn start_turn(&mut self, turn: crate::agent::TurnRequest) {
        let crate::agent::TurnRequest { turn_id, text, .. } = turn;
        self.stop_turn();
        let (tx, rx) = mpsc::unbounded_channel();
        let events = self.events.clone();
        let task = tokio::spawn(run_turn(events.clone(), turn_id.clone(), text, rx));
        let abort = task.abort_handle();
        // The watchdog turns a panic into a failed turn; an abort (stop) is
        // silent because the conversation already ended the turn.
        tokio::spawn(async move {
            if let Err(e) = task.await {
                if e.is_panic() {
                    let why = panic_message(e.into_panic());
                    events.emit_now(
                        &turn_id,
                        AgentOutput::Finished {
                            failed: Some(format!("agent panicked: {why}")),
                        },
                    );
                }
            }
        });
        self.turn = Some(RunningTurn {
            abort,
            tool_results: tx,
        });
    }

    fn tool_result(&mut self, call_id: &str, output: Value, _is_error: bool) {
        if let Some(turn) = &self.turn {
            let _ = turn.tool_results.send(ToolAnswer {
                call_id: call_id.to_owned(),
                output,
            });
        }
    }

    fn stop_turn(&mut self) {
        if let Some(turn) = self.turn.take() {
            turn.abort.abort();
        }
    }

    fn close(&mut self) {
        self.stop_turn();
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// What a user message asks the demo agent to do.
#[derive(Debug, Clone, PartialEq)]
enum Script {
    Stream { count: u64, every: Duration },
    Ask { name: String, args: Value },
    Sleep { label: String, duration: Duration },
    Fail,
    Panic,
    Echo { words: Vec<String> },
}

impl Script {
    fn parse(text: &str) -> Script {
        let echo = || Script::Echo {
            words: text.split_whitespace().map(str::to_owned).collect(),
        };
        let trimmed = text.trim();
        let (command, rest) = trimmed
            .split_once(char::is_whitespace)
            .map(|(c, r)| (c, r.trim()))
            .unwrap_or((trimmed, ""));
        match command {
            "/stream" => {
                let mut parts = rest.split_whitespace();
                let count = parts.next().and_then(|n| n.parse::<u64>().ok());
                let ms = parts.next().and_then(|n| n.parse::<u64>().ok());
                match (count, ms, parts.next()) {
                    (Some(count), Some(ms), None) => Script::Stream {
                        count,
                        every: Duration::from_millis(ms),
                    },
                    _ => echo(),
                }
            }
            "/ask" if !rest.is_empty() => {
                let (name, json) = rest
                    .split_once(char::is_whitespace)
                    .map(|(n, j)| (n, j.trim()))
                    .unwrap_or((rest, ""));
                if json.is_empty() {
                    return Script::Ask {
                        name: name.to_owned(),
                        args: Value::Object(Default::default()),
                    };
                }
                match serde_json::from_str(json) {
                    Ok(args) => Script::Ask {
                        name: name.to_owned(),
                        args,
                    },
                    Err(_) => echo(),
                }
            }
            "/sleep" => match humantime::parse_duration(rest) {
                Ok(duration) => Script::Sleep {
                    label: rest.to_owned(),
                    duration,
                },
                Err(_) => echo(),
            },
            "/fail" if rest.is_empty() => Script::Fail,
            "/panic" if rest.is_empty() => Script::Panic,
            _ => echo(),
        }
    }
}

async fn run_turn(
    events: EventSink,
    turn_id: Arc<str>,
    text: String,
    mut tool_results: mpsc::UnboundedReceiver<ToolAnswer>,
) {
    let emit = |output| events.emit(&turn_id, output);
    let completed = AgentOutput::Finished { failed: None };
    match Script::parse(&text) {
        Script::Stream { count, every } => {
            let mut reply = String::new();
            for i in 1..=count {
                if i > 1 && !every.is_zero() {
                    tokio::time::sleep(every).await;
                }
                let token = format!("tok{i} ");
                reply.push_str(&token);
                if !emit(AgentOutput::TextDelta(token)).await {
                    return;
                }
            }
            emit(AgentOutput::AssistantMessage(reply)).await;
            emit(completed).await;
        }
        Script::Ask { name, args } => {
            let call_id = format!("call_{}", ulid::Ulid::new());
            let call = AgentOutput::ToolCall {
                call_id: call_id.clone(),
                name: name.clone(),
                args,
            };
            if !emit(call).await {
                return;
            }
            while let Some(answer) = tool_results.recv().await {
                if answer.call_id == call_id {
                    let output = serde_json::to_string(&answer.output).unwrap_or_default();
                    emit(AgentOutput::AssistantMessage(format!(
                        "{name} returned {output}"
                    )))
                    .await;
                    emit(completed).await;
                    return;
                }
            }
        }
        Script::Sleep { label, duration } => {
            tokio::time::sleep(duration).await;
            emit(AgentOutput::AssistantMessage(format!("slept {label}"))).await;
            emit(completed).await;
        }
        Script::Fail => {
            emit(AgentOutput::Finished {
                failed: Some("the demo agent failed on purpose (/fail)".into()),
            })
            .await;
        }
        Script::Panic => panic!("the demo agent panicked on purpose (/panic)"),
        Script::Echo { words } => {
            let last = words.len().saturating_sub(1);
            for (i, word) in words.iter().enumerate() {
                if i > 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let delta = if i == last {
                    word.clone()
                } else {
                    format!("{word} ")
                };
                if !emit(AgentOutput::TextDelta(delta)).await {
                    return;
                }
            }
            emit(AgentOutput::AssistantMessage(words.join(" "))).await;
            emit(completed).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_scripts() {
        assert_eq!(
            Script::parse("/stream 3 5"),
            Script::Stream {
                count: 3,
                every: Duration::from_millis(5)
            }
        );
        assert_eq!(
            Script::parse(r#"/ask get_time {"tz":"UTC"}"#),
            Script::Ask {
                name: "get_time".into(),
                args: serde_json::json!({"tz":"UTC"})
            }
        );
        assert_eq!(
            Script::parse("/ask confirm"),
            Script::Ask {
                name: "confirm".into(),
                args: serde_json::json!({})
            }
        );
        assert_eq!(
            Script::parse("/sleep 200ms"),
            Script::Sleep {
                label: "200ms".into(),
                duration: Duration::from_millis(200)
            }
        );
        assert_eq!(Script::parse("/fail"), Script::Fail);
        assert_eq!(Script::parse("/panic"), Script::Panic);
        assert_eq!(
            Script::parse("hello  there"),
            Script::Echo {
                words: vec!["hello".into(), "there".into()]
            }
        );
        assert!(matches!(Script::parse("/stream x 1"), Script::Echo { .. }));
    }
}
