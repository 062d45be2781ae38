//! Compact attach (protocol §11): what a fresh client (last seq 0) is sent
//! when it opens a long conversation, in full and compact.
//!
//! One conversation gets N finished turns of T tokens (`/stream T 0`, one
//! after the other) and then a running one (`/stream 1000000 1000`: a token
//! a second, so that it runs through the whole measurement). Then a new
//! connection per open attaches with `last_seq = 0`, alternately without and
//! with `compact: true`, and reads the replay up to the `head_seq` its
//! `attached` announced. What it reports, per mode: the bytes of that
//! replay (websocket message payloads, `attached` included), its events,
//! and p50 times from sending `attach` to the first text a page can show
//! (the first `text_delta` or `assistant_message`) and to the whole
//! history (the event at `head_seq`: a page that shows the latest turns,
//! at the bottom of the chat, has them only then, the replay being oldest
//! first). The aim is on the ratio of the bytes, full to compact.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::json;

use super::client::{parse, Client, SeqCheck};
use super::{histogram, ms, Aim, Common, Measure, Report, Server, Target};

#[derive(Args, Debug, Clone)]
pub struct CompactArgs {
    /// Finished turns in the conversation.
    #[arg(long, short = 'n', default_value_t = 300)]
    pub turns: u64,
    /// Tokens (text_delta events) per finished turn.
    #[arg(long, short = 't', default_value_t = 500)]
    pub tokens: u64,
    /// Opens measured per mode (after one unmeasured open of each).
    #[arg(long, short = 'o', default_value_t = 10)]
    pub opens: usize,
}

impl CompactArgs {
    pub fn default_args() -> CompactArgs {
        CompactArgs {
            turns: 300,
            tokens: 500,
            opens: 10,
        }
    }
}

/// How long one turn of the set-up, or one open, may take.
const WAIT: Duration = Duration::from_secs(60);
/// Between two messages of the set-up: under the default
/// `limits.messages_per_second` of 20 per connection.
const MESSAGE_PACE: Duration = Duration::from_millis(55);
/// The running turn: a token a second, far more tokens than the bench lasts.
const RUNNING_TURN: &str = "/stream 1000000 1000";

/// One open of the conversation by a fresh client.
#[derive(Debug, Default, Clone, Copy)]
struct Open {
    bytes: u64,
    events: u64,
    first_text: Duration,
    whole: Duration,
}

pub async fn run(common: &Common, args: &CompactArgs) -> anyhow::Result<Report> {
    let params = json!({
        "finished_turns": args.turns,
        "tokens_per_turn": args.tokens,
        "running_turn": RUNNING_TURN,
        "opens": args.opens,
    });
    // The relay knows no compact attach: linger only.
    let target = if common.spawn {
        Target::spawn(Server::Linger, common, &[]).await?
    } else {
        Target::external(&common.url, common.server_pid)
    };
    eprintln!("── {} at {}", target.label(), target.url);
    let result = measure(&target, args).await;
    target.stop().await;
    Ok(Report {
        scenario: "compact".into(),
        params,
        runs: vec![(Server::Linger, result?)],
    })
}

async fn measure(target: &Target, args: &CompactArgs) -> anyhow::Result<Vec<Measure>> {
    let mut writer = Client::connect(&target.url, "k0").await?;
    let (id, _) = writer.create(WAIT).await?;
    let bar = super::progress(args.turns, "turns");
    let mut pace = tokio::time::interval(MESSAGE_PACE);
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for _ in 0..args.turns {
        pace.tick().await;
        writer
            .message(&id, &format!("/stream {} 0", args.tokens))
            .await?;
        read_until(&mut writer, "turn_finished", args.tokens + 32).await?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    pace.tick().await;
    writer.message(&id, RUNNING_TURN).await?;
    read_until(&mut writer, "text_delta", 32).await?;

    let mut full = Vec::with_capacity(args.opens);
    let mut compact = Vec::with_capacity(args.opens);
    let bar = super::progress(2 * args.opens as u64, "opens");
    for i in 0..=args.opens {
        for (compact_open, opens) in [(false, &mut full), (true, &mut compact)] {
            let open = open(&target.url, &id, compact_open)
                .await
                .with_context(|| format!("open {i}, compact {compact_open}"))?;
            // The first of each mode warms the store's page cache.
            if i > 0 {
                opens.push(open);
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    let _ = writer
        .send(json!({"type": "close", "conversation_id": id, "req": 5}))
        .await;
    writer.close().await;
    Ok(report(&full, &compact))
}

/// Reads the writer's frames until an event of `kind`, at most `frames`.
async fn read_until(writer: &mut Client, kind: &str, frames: u64) -> anyhow::Result<()> {
    for _ in 0..frames {
        let text = writer.recv(WAIT).await?;
        let frame = parse(text.as_str())?;
        match frame.ty.as_ref() {
            "event" if frame.kind_is(kind) => return Ok(()),
            "error" => bail!("the writer was refused: {}", text.as_str()),
            _ => {}
        }
    }
    bail!("no {kind} within {frames} frames")
}

/// A fresh connection attaches from seq 0 and reads the replay up to the
/// `head_seq` its `attached` announced.
async fn open(url: &str, id: &str, compact: bool) -> anyhow::Result<Open> {
    let mut reader = Client::connect(url, "k0").await?;
    let mut attach = json!({"type": "attach", "conversation_id": id, "last_seq": 0, "req": 3});
    if compact {
        attach["compact"] = json!(true);
    }
    let t0 = Instant::now();
    reader.send(attach).await?;
    let mut open = Open::default();
    let mut first_text = None;
    let mut head = None;
    let mut seq = SeqCheck::default();
    let deadline = tokio::time::Instant::now() + WAIT;
    // Bounded by the deadline: each step reads one frame or fails.
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let text = reader.recv(left).await?;
        let frame = parse(text.as_str())?;
        match frame.ty.as_ref() {
            "attached" => {
                if frame.compact != Some(true) && compact {
                    bail!("a compact attach not answered compact: {}", text.as_str());
                }
                head = frame.head_seq;
            }
            "event" => {
                open.events += 1;
                seq.see(frame.seq.unwrap_or(0));
                if first_text.is_none()
                    && (frame.kind_is("text_delta") || frame.kind_is("assistant_message"))
                {
                    first_text = Some(t0.elapsed());
                }
            }
            "error" => bail!("attach refused: {}", text.as_str()),
            _ => {}
        }
        open.bytes += text.len() as u64;
        // Past the head only if the head itself was a left-out delta (a
        // turn that finished as the attach came): the first live event
        // ends the replay then.
        if head.is_some_and(|h| seq.last >= h) {
            break;
        }
    }
    open.whole = t0.elapsed();
    open.first_text = first_text.unwrap_or(open.whole);
    // Only the compact replay may skip seqs (the deltas it leaves out).
    if seq.duplicates > 0 || (!compact && seq.gaps > 0) {
        bail!("the replay was not in seq order: {seq:?}");
    }
    reader.close().await;
    Ok(open)
}

fn report(full: &[Open], compact: &[Open]) -> Vec<Measure> {
    // Every open of a mode is sent the same history, but for the running
    // turn's newest tokens: the median stands for all.
    let median = |opens: &[Open], f: fn(&Open) -> u64| {
        let mut values: Vec<u64> = opens.iter().map(f).collect();
        values.sort_unstable();
        values.get(values.len() / 2).copied().unwrap_or(0)
    };
    let p50 = |opens: &[Open], f: fn(&Open) -> Duration| {
        let mut h = histogram();
        for open in opens {
            h.saturating_record((f(open).as_micros() as u64).max(1));
        }
        ms(&h, 0.5)
    };
    let (full_bytes, compact_bytes) = (median(full, |o| o.bytes), median(compact, |o| o.bytes));
    let mut measures = Vec::new();
    for (label, opens, bytes) in [
        ("full", full, full_bytes),
        ("compact", compact, compact_bytes),
    ] {
        measures.push(Measure::new(
            format!("replay bytes ({label})"),
            "KiB",
            bytes as f64 / 1024.0,
        ));
        measures.push(Measure::new(
            format!("replay events ({label})"),
            "",
            median(opens, |o| o.events) as f64,
        ));
        measures.push(Measure::new(
            format!("first text p50 ({label})"),
            "ms",
            p50(opens, |o| o.first_text),
        ));
        measures.push(Measure::new(
            format!("whole history p50 ({label})"),
            "ms",
            p50(opens, |o| o.whole),
        ));
    }
    let ratio = full_bytes as f64 / compact_bytes.max(1) as f64;
    measures.push(Measure::new("bytes full / compact", "x", ratio).aim(Aim::AtLeast(20.0)));
    measures
}
