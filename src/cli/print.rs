//! How the terminal shows a conversation's events: streamed text inline as
//! it arrives, the final reply only where it adds to what was streamed,
//! tool calls and stops on lines of their own.

use std::collections::{HashMap, HashSet};
use std::io::{IsTerminal, Write};

use serde_json::Value;

/// `agent_stopped` reasons in plain words.
pub fn stop_words(reason: &str) -> &str {
    match reason {
        "idle" => "it was idle for a while",
        "user_limit" => "too many conversations",
        "closed" => "it was closed",
        "shutdown" | "restart_recovery" => "server restart",
        "deleted" => "it was deleted",
        other => other,
    }
}

/// `detached` reasons in plain words.
pub fn detach_words(reason: &str) -> &str {
    match reason {
        "client" => "you detached",
        "user_limit" => "too many conversations",
        "closed" => "it was closed",
        "deleted" => "it was deleted",
        "shutdown" => "server restart",
        other => other,
    }
}

/// Writes events to stdout.
pub struct Printer {
    /// Text streamed so far, per turn.
    streamed: HashMap<String, String>,
    /// The cursor is after streamed text, not at the start of a line.
    mid_line: bool,
    /// Messages this terminal typed: the terminal already shows them.
    pub own_messages: HashSet<String>,
    /// Whether our own messages are echoed (not when a person types them).
    pub echo_own: bool,
    /// stdout is a terminal: end a streamed line before a note on stderr,
    /// so the two do not share a line on screen.
    tty: bool,
}

impl Printer {
    pub fn new(echo_own: bool) -> Printer {
        Printer {
            streamed: HashMap::new(),
            mid_line: false,
            own_messages: HashSet::new(),
            echo_own,
            tty: std::io::stdout().is_terminal(),
        }
    }

    /// Before a note on stderr: on a terminal, ends the streamed line. Piped
    /// output is left as the conversation wrote it.
    pub fn before_note(&mut self) {
        if self.tty {
            self.end_line();
        }
    }

    fn line(&mut self, text: &str) {
        let mut out = std::io::stdout().lock();
        if self.mid_line {
            let _ = writeln!(out);
            self.mid_line = false;
        }
        let _ = writeln!(out, "{text}");
        let _ = out.flush();
    }

    fn inline(&mut self, text: &str) {
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{text}");
        let _ = out.flush();
        self.mid_line = !text.ends_with('\n');
    }

    /// Ends a line of streamed text, if one is open.
    pub fn end_line(&mut self) {
        if self.mid_line {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out);
            let _ = out.flush();
            self.mid_line = false;
        }
    }

    pub fn event(&mut self, event: &Value) {
        let data = &event["data"];
        let text = |key: &str| data[key].as_str().unwrap_or("").to_owned();
        let turn = text("turn_id");
        match event["kind"].as_str().unwrap_or("") {
            "user_message" => {
                let own = data["client_msg_id"]
                    .as_str()
                    .is_some_and(|id| self.own_messages.contains(id));
                if !own || self.echo_own {
                    self.line(&format!("> {}", text("text")));
                }
            }
            "text_delta" => {
                let delta = text("text");
                self.streamed.entry(turn).or_default().push_str(&delta);
                self.inline(&delta);
            }
            "assistant_message" => {
                let full = text("text");
                let streamed = self.streamed.remove(&turn).unwrap_or_default();
                if streamed.is_empty() {
                    self.line(&full);
                } else if let Some(rest) = full.strip_prefix(&streamed) {
                    // What was streamed is already on screen: only the rest.
                    self.inline(rest);
                    self.end_line();
                } else {
                    self.end_line();
                    self.line(&full);
                }
            }
            "tool_call" => {
                let call = text("call_id");
                let args = data["args"].to_string();
                let hint = if data["target"] == "client" {
                    format!("  (answer: /result {call} JSON)")
                } else {
                    String::new()
                };
                self.line(&format!("[tool call {call}] {} {args}{hint}", text("name")));
            }
            "tool_result" => {
                let kind = if data["is_error"] == true {
                    "tool error"
                } else {
                    "tool result"
                };
                self.line(&format!("[{kind} {}] {}", text("call_id"), data["output"]));
            }
            "turn_finished" => {
                self.streamed.remove(&turn);
                let status = text("status");
                match status.as_str() {
                    "completed" => self.end_line(),
                    "failed" => self.line(&format!("[turn failed: {}]", text("error"))),
                    "stopped" => self.line("[turn stopped]"),
                    "abandoned" => self.line("[turn abandoned: nobody was attached]"),
                    "interrupted" => self.line("[turn interrupted by a server restart]"),
                    other => self.line(&format!("[turn {other}]")),
                }
            }
            "agent_started" => {
                let reason = text("reason");
                if reason == "attach" || reason == "message" {
                    self.line("[resumed]");
                }
            }
            "agent_stopped" => {
                let reason = text("reason");
                self.line(&format!("[stopped: {}]", stop_words(&reason)));
            }
            _ => {}
        }
    }
}
