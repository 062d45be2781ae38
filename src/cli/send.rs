//! `linger send ID TEXT [--wait]`: sends one message (resuming a stopped
//! conversation) and returns once the server has recorded it; with
//! `--wait`, prints the reply as it streams and returns when its turn ends.

use anyhow::{anyhow, bail};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use super::print::Printer;
use super::{message_id, note, Client, Remote, Ws};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub remote: Remote,
    /// The conversation's id.
    pub id: String,
    /// The message.
    pub text: String,
    /// Print the reply as it streams; return when its turn ends.
    #[arg(long)]
    pub wait: bool,
}

async fn send(ws: &mut Ws, frame: Value) -> anyhow::Result<()> {
    ws.send(Message::text(frame.to_string()))
        .await
        .map_err(|e| anyhow!("the connection failed: {e}"))
}

/// The next JSON frame; errors when the socket ends.
async fn next(ws: &mut Ws) -> anyhow::Result<Value> {
    loop {
        match ws.next().await {
            Some(Ok(Message::Text(text))) => {
                if let Ok(value) = serde_json::from_str(text.as_str()) {
                    return Ok(value);
                }
            }
            Some(Ok(Message::Close(frame))) => {
                let why = frame
                    .map(|f| format!(" ({} {})", f.code, f.reason))
                    .unwrap_or_default();
                bail!("the server closed the connection{why}")
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => bail!("the connection failed: {e}"),
            None => bail!("the connection ended"),
        }
    }
}

/// Reads until the reply to `req`, keeping the events read meanwhile.
async fn reply(ws: &mut Ws, req: &str, events: &mut Vec<Value>) -> anyhow::Result<Value> {
    loop {
        let frame = next(ws).await?;
        if frame["req"] == req {
            if frame["type"] == "error" {
                bail!(
                    "{}: {}",
                    frame["code"].as_str().unwrap_or("error"),
                    frame["message"].as_str().unwrap_or("")
                );
            }
            return Ok(frame);
        }
        if frame["type"] == "event" {
            events.push(frame);
        }
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.remote)?;
    let summary = client.conversation(&args.id).await?;
    let mut ws = client.connect().await?;
    let mut events = Vec::new();
    send(
        &mut ws,
        json!({"type": "attach", "conversation_id": args.id, "last_seq": summary.head_seq, "req": "attach"}),
    )
    .await?;
    reply(&mut ws, "attach", &mut events).await?;
    send(
        &mut ws,
        json!({"type": "message", "conversation_id": args.id, "text": args.text,
               "client_msg_id": message_id(), "req": "message"}),
    )
    .await?;
    let ack = reply(&mut ws, "message", &mut events).await?;
    let seq = ack["seq"].as_u64().unwrap_or(0);
    if args.wait {
        wait_for_turn(&mut ws, &args.id, seq, events).await?;
    } else {
        note(format!("sent: seq {seq}"));
    }
    let _ = send(
        &mut ws,
        json!({"type": "detach", "conversation_id": args.id, "req": "detach"}),
    )
    .await;
    let _ = reply(&mut ws, "detach", &mut Vec::new()).await;
    let _ = ws.close(None).await;
    Ok(())
}

/// Prints the turn that answers the message recorded at `message_seq`.
async fn wait_for_turn(
    ws: &mut Ws,
    id: &str,
    message_seq: u64,
    early: Vec<Value>,
) -> anyhow::Result<()> {
    let mut printer = Printer::new(false);
    let mut turn: Option<String> = None;
    let mut pending = early.into_iter();
    loop {
        let frame = match pending.next() {
            Some(frame) => frame,
            None => next(ws)
                .await
                .map_err(|e| anyhow!("{e}; `linger attach {id}` shows the rest of the reply"))?,
        };
        if frame["type"] != "event" || frame["conversation_id"] != id {
            continue;
        }
        let data = &frame["data"];
        match frame["kind"].as_str().unwrap_or("") {
            "turn_started" if data["message_seq"] == message_seq => {
                turn = data["turn_id"].as_str().map(str::to_owned);
                continue;
            }
            "agent_stopped" => {
                printer.event(&frame);
                bail!("the conversation stopped before the reply ended");
            }
            _ => {}
        }
        let Some(turn) = turn.as_deref() else {
            continue;
        };
        if data["turn_id"] != turn {
            continue;
        }
        printer.event(&frame);
        match frame["kind"].as_str().unwrap_or("") {
            "tool_call" if data["target"] == "client" => {
                note(format!(
                    "the agent waits for a tool result: `linger attach {id}` to answer it"
                ));
                return Ok(());
            }
            "turn_finished" => {
                return match data["status"].as_str().unwrap_or("") {
                    "completed" => Ok(()),
                    other => Err(anyhow!("the turn ended {other}")),
                };
            }
            _ => {}
        }
    }
}
