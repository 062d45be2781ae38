//! `linger attach ID`: the conversation in the terminal. Streams its events
//! (text inline as it arrives, tool calls on lines of their own), sends each
//! typed line as a message, answers tool calls with `/result CALL_ID JSON`,
//! and detaches on Ctrl-D (end of input), leaving the turn running. A
//! dropped connection comes back by itself: reconnect with backoff, attach
//! with the last seq seen, so nothing is missed or shown twice. The first
//! attach of a whole conversation is compact (protocol §11): finished turns
//! come as their whole replies, which the printer shows as lines.

use std::io::{BufRead, IsTerminal};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use futures_util::stream::SplitSink;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use super::print::{detach_words, Printer};
use super::{backoff, message_id, note, Client, Remote, Unauthorized, Ws};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub remote: Remote,
    /// The conversation's id.
    pub id: String,
    /// Show only the events after this seq (default: the whole conversation).
    #[arg(long, default_value_t = 0)]
    pub from: u64,
    /// Attach read-only (observe mode).
    #[arg(long)]
    pub observe: bool,
}

const HELP: &str = "\
Type a line to send it as a message. Commands:
  /result CALL_ID JSON   answer a client tool call
  /error CALL_ID JSON    answer it as an error
  /stop                  abort the running turn
  /close                 stop the conversation now (a message resumes it)
  /detach, or Ctrl-D     leave; the turn keeps running
  //text                 send a message that starts with /
Other lines starting with / (like /stream 20 100) are sent as messages.";

/// Ping this often; a connection silent for `SILENCE` is taken as lost.
const PING_EVERY: Duration = Duration::from_secs(15);
const SILENCE: Duration = Duration::from_secs(40);

/// What one typed line asks for.
#[derive(Debug, PartialEq)]
pub enum Line {
    Empty,
    Help,
    Detach,
    Stop,
    Close,
    Message(String),
    ToolResult {
        call_id: String,
        output: Value,
        is_error: bool,
    },
    Bad(String),
}

pub fn parse_line(line: &str) -> Line {
    let line = line.trim_end_matches(['\r', '\n']);
    if line.trim().is_empty() {
        return Line::Empty;
    }
    if let Some(rest) = line.strip_prefix("//") {
        return Line::Message(format!("/{rest}"));
    }
    let (command, rest) = match line.split_once(char::is_whitespace) {
        Some((command, rest)) => (command, rest.trim()),
        None => (line, ""),
    };
    match command {
        "/help" => Line::Help,
        "/detach" | "/quit" => Line::Detach,
        "/stop" => Line::Stop,
        "/close" => Line::Close,
        "/result" | "/error" => {
            let usage = || Line::Bad(format!("usage: {command} CALL_ID JSON"));
            let Some((call_id, output)) = rest.split_once(char::is_whitespace) else {
                return usage();
            };
            match serde_json::from_str(output.trim()) {
                Ok(output) => Line::ToolResult {
                    call_id: call_id.to_owned(),
                    output,
                    is_error: command == "/error",
                },
                Err(e) => Line::Bad(format!("not valid JSON ({e}); {command} CALL_ID JSON")),
            }
        }
        _ => Line::Message(line.to_owned()),
    }
}

/// Something to send that must get through, across reconnects.
enum Pending {
    Message {
        cmid: String,
        text: String,
    },
    ToolResult {
        call_id: String,
        output: Value,
        is_error: bool,
    },
}

struct Outgoing {
    req: String,
    what: Pending,
    sent: bool,
}

/// Why a connection's session ended.
enum End {
    /// We detached (or had nothing to attach to) and are done.
    Done,
    Lost(String),
    Fatal(anyhow::Error),
}

type Sink = SplitSink<Ws, Message>;

struct Session {
    id: String,
    mode: &'static str,
    last_seq: u64,
    outbox: Vec<Outgoing>,
    next_req: u64,
    printer: Printer,
    /// Attach on (re)connect: false after the server stopped the
    /// conversation, until a message asks to resume it.
    want_attached: bool,
    attached: bool,
    attaching: bool,
    stdin_done: bool,
    attempt: u32,
    attached_once: bool,
}

async fn send(sink: &mut Sink, frame: Value) -> Result<(), End> {
    sink.send(Message::text(frame.to_string()))
        .await
        .map_err(|e| End::Lost(format!("sending failed: {e}")))
}

impl Session {
    /// A note on stderr, after ending a streamed line on a terminal.
    fn say(&mut self, text: impl std::fmt::Display) {
        self.printer.before_note();
        note(text);
    }

    fn attach_frame(&self) -> Value {
        let mut frame = json!({"type": "attach", "conversation_id": self.id,
            "last_seq": self.last_seq, "mode": self.mode, "req": "attach"});
        // Nothing shown yet: a compact replay (protocol §11) brings finished
        // turns as their whole replies, without their streamed pieces. A
        // resume from a seq already shown gets everything it missed.
        if self.last_seq == 0 {
            frame["compact"] = json!(true);
        }
        frame
    }

    async fn attach(&mut self, sink: &mut Sink) -> Result<(), End> {
        if self.attached || self.attaching {
            return Ok(());
        }
        self.attaching = true;
        self.want_attached = true;
        send(sink, self.attach_frame()).await
    }

    /// Ends the session: detaches (the turn keeps running) once everything
    /// typed has been acknowledged.
    async fn finish(&mut self, sink: &mut Sink) -> Result<(), End> {
        if !self.outbox.is_empty() {
            return Ok(());
        }
        if !self.attached && !self.attaching {
            return Err(End::Done);
        }
        let frame = json!({"type": "detach", "conversation_id": self.id, "req": "detach"});
        send(sink, frame).await
    }

    async fn flush(&mut self, sink: &mut Sink) -> Result<(), End> {
        if self.outbox.iter().all(|o| o.sent) {
            return Ok(());
        }
        if !self.attached {
            return self.attach(sink).await;
        }
        for out in self.outbox.iter_mut().filter(|o| !o.sent) {
            let frame = match &out.what {
                Pending::Message { cmid, text } => json!({
                    "type": "message", "conversation_id": self.id, "text": text,
                    "client_msg_id": cmid, "req": out.req}),
                Pending::ToolResult {
                    call_id,
                    output,
                    is_error,
                } => json!({
                    "type": "tool_result", "conversation_id": self.id, "call_id": call_id,
                    "output": output, "is_error": is_error, "req": out.req}),
            };
            send(sink, frame).await?;
            out.sent = true;
        }
        Ok(())
    }

    /// Queues what a typed line asks to send; returns the lines that ask
    /// for something else (detach, stop, close).
    fn queue(&mut self, line: &str) -> Option<Line> {
        match parse_line(line) {
            Line::Empty => None,
            Line::Help => {
                eprintln!("{HELP}");
                None
            }
            Line::Bad(why) => {
                self.say(why);
                None
            }
            Line::Message(_) | Line::ToolResult { .. } if self.mode == "observe" => {
                self.say("observing: this terminal is read-only");
                None
            }
            Line::Message(text) => {
                let cmid = message_id();
                self.printer.own_messages.insert(cmid.clone());
                self.push(Pending::Message { cmid, text });
                None
            }
            Line::ToolResult {
                call_id,
                output,
                is_error,
            } => {
                self.push(Pending::ToolResult {
                    call_id,
                    output,
                    is_error,
                });
                None
            }
            other => Some(other),
        }
    }

    fn push(&mut self, what: Pending) {
        self.next_req += 1;
        let req = format!("o{}", self.next_req);
        self.outbox.push(Outgoing {
            req,
            what,
            sent: false,
        });
    }

    /// A typed line while connected.
    async fn input(&mut self, line: Option<String>, sink: &mut Sink) -> Result<(), End> {
        let Some(line) = line else {
            self.stdin_done = true;
            return self.finish(sink).await;
        };
        match self.queue(&line) {
            None => self.flush(sink).await,
            Some(Line::Detach) => {
                self.stdin_done = true;
                self.finish(sink).await
            }
            Some(Line::Stop | Line::Close) if !self.attached => {
                self.say("not attached: nothing to stop");
                Ok(())
            }
            Some(Line::Stop) => {
                let frame = json!({"type": "stop", "conversation_id": self.id, "req": "stop"});
                send(sink, frame).await
            }
            Some(Line::Close) => {
                let frame = json!({"type": "close", "conversation_id": self.id, "req": "close"});
                send(sink, frame).await
            }
            Some(_) => Ok(()),
        }
    }

    /// A typed line while the connection is down.
    fn input_offline(&mut self, line: Option<String>) {
        let Some(line) = line else {
            self.stdin_done = true;
            return;
        };
        match self.queue(&line) {
            Some(Line::Detach) => self.stdin_done = true,
            Some(Line::Stop | Line::Close) => self.say("not connected: try again when it is back"),
            _ => {}
        }
    }

    async fn frame(&mut self, frame: Value, sink: &mut Sink) -> Result<(), End> {
        let mine = frame["conversation_id"] == self.id.as_str();
        match frame["type"].as_str().unwrap_or("") {
            "event" if mine => {
                let seq = frame["seq"].as_u64().unwrap_or(0);
                if seq > self.last_seq {
                    self.last_seq = seq;
                    self.printer.event(&frame);
                }
            }
            "attached" if mine => {
                self.attached = true;
                self.attaching = false;
                self.attempt = 0;
                let replay_from = frame["replay_from"].as_u64().unwrap_or(0);
                if frame["replay_incomplete"] == true && replay_from > self.last_seq + 1 {
                    self.say(format!(
                        "events {} to {} were deleted by retention",
                        self.last_seq + 1,
                        replay_from - 1
                    ));
                }
                let status = frame["status"].as_str().unwrap_or("?");
                if self.attached_once {
                    self.say(format!("reconnected; the agent is {status}"));
                } else {
                    self.say(format!(
                        "attached to {} (agent {status}); Ctrl-D detaches, /help for commands",
                        self.id
                    ));
                    self.attached_once = true;
                }
                if let Some(calls) = frame["pending_calls"].as_array() {
                    for call in calls.iter().filter_map(Value::as_str) {
                        self.say(format!(
                            "tool call {call} waits for your answer: /result {call} JSON"
                        ));
                    }
                }
                self.flush(sink).await?;
                if self.stdin_done {
                    self.finish(sink).await?;
                }
            }
            "detached" if mine => {
                self.attached = false;
                self.attaching = false;
                let reason = frame["reason"].as_str().unwrap_or("");
                self.printer.before_note();
                match reason {
                    "client" => return Err(End::Done),
                    "deleted" => {
                        return Err(End::Fatal(anyhow!("the conversation was deleted")));
                    }
                    _ => {
                        self.want_attached = false;
                        self.say(format!(
                            "detached: {}; type a message to resume it",
                            detach_words(reason)
                        ));
                        if self.stdin_done {
                            return Err(End::Done);
                        }
                    }
                }
            }
            "ack" => {
                let req = frame["req"].as_str().unwrap_or("");
                self.outbox.retain(|o| o.req != req);
                if self.stdin_done {
                    self.finish(sink).await?;
                }
            }
            "pong" => self.attempt = 0,
            "error" => self.error(&frame, sink).await?,
            _ => {}
        }
        Ok(())
    }

    async fn error(&mut self, frame: &Value, sink: &mut Sink) -> Result<(), End> {
        let req = frame["req"].as_str().unwrap_or("");
        let code = frame["code"].as_str().unwrap_or("error");
        let message = frame["message"].as_str().unwrap_or("");
        match req {
            "attach" => {
                self.attaching = false;
                match code {
                    "not_found" => {
                        return Err(End::Fatal(anyhow!("conversation {}: not found", self.id)))
                    }
                    "limit_reached" => {
                        self.want_attached = false;
                        self.say(format!("cannot resume it: {message}"));
                        let dropped = self.outbox.len();
                        self.outbox.clear();
                        if dropped > 0 {
                            self.say(format!("{dropped} unsent line(s) dropped"));
                        }
                        if self.stdin_done {
                            return Err(End::Done);
                        }
                    }
                    _ => return Err(End::Fatal(anyhow!("attach failed: {code}: {message}"))),
                }
            }
            "detach" => return Err(End::Done),
            _ => {
                if let Some(pos) = self.outbox.iter().position(|o| o.req == req) {
                    if code == "not_attached" {
                        self.attached = false;
                        self.outbox[pos].sent = false;
                        return self.flush(sink).await;
                    }
                    let out = self.outbox.remove(pos);
                    match (&out.what, code) {
                        (Pending::ToolResult { call_id, .. }, "unknown_call") => {
                            self.say(format!("call {call_id} is answered already (or unknown)"))
                        }
                        _ => self.say(format!("not sent ({code}): {message}")),
                    }
                    if self.stdin_done {
                        self.finish(sink).await?;
                    }
                } else {
                    self.say(format!("{code}: {message}"));
                }
            }
        }
        Ok(())
    }

    /// One connection, until it ends.
    async fn serve(&mut self, ws: Ws, input: &mut mpsc::Receiver<String>) -> End {
        let (mut sink, mut stream) = ws.split();
        match self.open(&mut sink).await {
            Ok(()) => {}
            Err(end) => return end,
        }
        let mut heartbeat = tokio::time::interval(PING_EVERY);
        heartbeat.tick().await;
        let mut heard = Instant::now();
        loop {
            let step = tokio::select! {
                next = stream.next() => match next {
                    Some(Ok(Message::Text(text))) => {
                        heard = Instant::now();
                        match serde_json::from_str::<Value>(text.as_str()) {
                            Ok(frame) => self.frame(frame, &mut sink).await,
                            Err(_) => Ok(()),
                        }
                    }
                    Some(Ok(Message::Close(frame))) => Err(End::Lost(match frame {
                        Some(f) => format!("closed by the server: {} {}", f.code, f.reason),
                        None => "closed by the server".into(),
                    })),
                    Some(Ok(_)) => {
                        heard = Instant::now();
                        Ok(())
                    }
                    Some(Err(e)) => Err(End::Lost(e.to_string())),
                    None => Err(End::Lost("the connection ended".into())),
                },
                line = input.recv(), if !self.stdin_done => self.input(line, &mut sink).await,
                _ = heartbeat.tick() => {
                    if heard.elapsed() > SILENCE {
                        Err(End::Lost(format!("nothing heard for {SILENCE:?}")))
                    } else {
                        send(&mut sink, json!({"type": "ping", "req": "heartbeat"})).await
                    }
                }
            };
            if let Err(end) = step {
                if matches!(end, End::Done) {
                    let _ = sink.close().await;
                }
                return end;
            }
        }
    }

    async fn open(&mut self, sink: &mut Sink) -> Result<(), End> {
        self.attached = false;
        self.attaching = false;
        for out in &mut self.outbox {
            out.sent = false;
        }
        send(sink, json!({"type": "ping", "req": "hello"})).await?;
        if self.want_attached || !self.outbox.is_empty() {
            self.attach(sink).await?;
        } else if self.stdin_done {
            return Err(End::Done);
        }
        Ok(())
    }
}

/// Lines typed on stdin; the channel closes at end of input. A plain thread:
/// a blocked read must not hold up the runtime when we exit.
fn read_stdin() -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel(64);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.blocking_send(line).is_err() {
                return;
            }
        }
    });
    rx
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.remote)?;
    // Fails early and clearly on a bad token or an unknown id.
    client.conversation(&args.id).await?;
    let mut input = read_stdin();
    let mut session = Session {
        id: args.id.clone(),
        mode: if args.observe { "observe" } else { "control" },
        last_seq: args.from,
        outbox: Vec::new(),
        next_req: 0,
        printer: Printer::new(!std::io::stdin().is_terminal()),
        want_attached: true,
        attached: false,
        attaching: false,
        stdin_done: false,
        attempt: 0,
        attached_once: false,
    };
    loop {
        match client.connect().await {
            Ok(ws) => match session.serve(ws, &mut input).await {
                End::Done => return Ok(()),
                End::Fatal(e) => return Err(e),
                End::Lost(why) => {
                    session.say(format!("connection lost ({why})"));
                }
            },
            Err(e) if e.is::<Unauthorized>() => return Err(e),
            Err(e) => session.say(format!("{e:#}")),
        }
        if session.stdin_done && session.outbox.is_empty() {
            // Nothing left to deliver; the server already detached us.
            return Ok(());
        }
        let delay = backoff(session.attempt);
        session.attempt = session.attempt.saturating_add(1);
        session.say(format!("reconnecting in {:.1}s", delay.as_secs_f64()));
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => break,
                line = input.recv(), if !session.stdin_done => {
                    session.input_offline(line);
                    if session.stdin_done && session.outbox.is_empty() {
                        return Ok(());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines() {
        assert_eq!(parse_line("  "), Line::Empty);
        assert_eq!(parse_line("hello"), Line::Message("hello".into()));
        assert_eq!(
            parse_line("/stream 5 10"),
            Line::Message("/stream 5 10".into())
        );
        assert_eq!(parse_line("//help"), Line::Message("/help".into()));
        assert_eq!(parse_line("/help"), Line::Help);
        assert_eq!(parse_line("/detach"), Line::Detach);
        assert_eq!(
            parse_line("/result call_1 {\"ok\": true}"),
            Line::ToolResult {
                call_id: "call_1".into(),
                output: json!({"ok": true}),
                is_error: false
            }
        );
        assert_eq!(
            parse_line("/error call_2 \"boom\""),
            Line::ToolResult {
                call_id: "call_2".into(),
                output: json!("boom"),
                is_error: true
            }
        );
        assert!(matches!(parse_line("/result call_1"), Line::Bad(_)));
        assert!(matches!(parse_line("/result call_1 {nope"), Line::Bad(_)));
    }
}
