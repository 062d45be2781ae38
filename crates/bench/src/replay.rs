//! Replay: one conversation streams E events (`/stream E 0`); then a second
//! connection of the same user attaches with `last_seq = head - E` again and
//! again (detaching in between). What it reports: the time from sending
//! `attach` to receiving the last of the E events, p50/p99, once with the
//! range in the replay buffer and once from the store (a linger whose
//! `replay_buffer_events` is smaller than E).

use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use serde_json::json;

use super::client::{parse, Client, SeqCheck};
use super::{histogram, ms, Aim, Common, Measure, Report, Server, Target};

#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Events each attach replays.
    #[arg(long, short = 'e', default_value_t = 2000)]
    pub events: u64,
    /// Attaches measured (after 5 unmeasured ones).
    #[arg(long, short = 'a', default_value_t = 200)]
    pub attaches: usize,
    /// `conversations.replay_buffer_events` of the linger that replays from
    /// the store (with --spawn).
    #[arg(long, default_value_t = 100)]
    pub store_buffer: usize,
}

impl ReplayArgs {
    pub fn default_args() -> ReplayArgs {
        ReplayArgs {
            events: 2000,
            attaches: 200,
            store_buffer: 100,
        }
    }
}

const WAIT: Duration = Duration::from_secs(30);

pub async fn run(common: &Common, args: &ReplayArgs) -> anyhow::Result<Report> {
    let params = json!({
        "events": args.events,
        "attaches": args.attaches,
        "store_run_replay_buffer_events": args.store_buffer,
    });
    let mut runs = Vec::new();
    if !common.spawn {
        let target = Target::external(&common.url, common.server_pid);
        let measures = measure(&target, args, "server").await?;
        runs.push((Server::Linger, measures));
    } else {
        let mut linger = Vec::new();
        let buffer = vec![(
            "conversations.replay_buffer_events",
            args.events.max(2000).to_string(),
        )];
        let store = vec![(
            "conversations.replay_buffer_events",
            args.store_buffer.to_string(),
        )];
        for (label, overrides) in [("buffer", buffer), ("store", store)] {
            let target = Target::spawn(Server::Linger, common, &overrides).await?;
            eprintln!("── linger ({label}) at {}", target.url);
            let result = measure(&target, args, label).await;
            target.stop().await;
            linger.extend(result?);
        }
        runs.push((Server::Linger, linger));
        if !common.no_relay {
            let target = Target::spawn(Server::Relay, common, &[]).await?;
            eprintln!("── relay at {}", target.url);
            let result = measure(&target, args, "memory").await;
            target.stop().await;
            // The relay's one in-memory log is the ceiling of both.
            let mut relay = Vec::new();
            for m in result? {
                for label in ["buffer", "store"] {
                    let mut m = m.clone();
                    m.name = m.name.replace("(memory)", &format!("({label})"));
                    relay.push(m);
                }
            }
            runs.push((Server::Relay, relay));
        }
    }
    Ok(Report {
        scenario: "replay".into(),
        params,
        runs,
    })
}

async fn measure(target: &Target, args: &ReplayArgs, label: &str) -> anyhow::Result<Vec<Measure>> {
    let e = args.events;
    let mut writer = Client::connect(&target.url, "r0").await?;
    let (id, mut head) = writer.create(WAIT).await?;
    writer.message(&id, &format!("/stream {e} 0")).await?;
    for _ in 0..e + 64 {
        let text = writer.recv(WAIT).await?;
        let frame = parse(text.as_str())?;
        if let (true, Some(seq)) = (frame.is_event(), frame.seq) {
            head = seq;
            if frame.kind_is("turn_finished") {
                break;
            }
        }
    }
    if head < e {
        bail!("the conversation has {head} events, fewer than {e}");
    }
    let last_seq = head - e;
    let mut reader = Client::connect(&target.url, "r0").await?;
    let mut h = histogram();
    let bar = super::progress(args.attaches as u64, &format!("replay {label}"));
    // Two frames (attach, detach) per round, under the default
    // `limits.messages_per_second` of 20 per connection.
    let mut pace = tokio::time::interval(Duration::from_millis(120));
    for i in 0..args.attaches + 5 {
        pace.tick().await;
        let t0 = Instant::now();
        reader.attach(&id, last_seq).await?;
        let mut seq = SeqCheck::starting_after(last_seq);
        let mut attached = false;
        for _ in 0..e + 16 {
            let text = reader.recv(WAIT).await?;
            let frame = parse(text.as_str())?;
            match frame.ty.as_ref() {
                "attached" => attached = true,
                "event" => seq.see(frame.seq.unwrap_or(0)),
                "error" => bail!("attach refused: {}", text.as_str()),
                _ => {}
            }
            if seq.last >= head {
                break;
            }
        }
        let took = t0.elapsed();
        if !attached || seq.last < head || seq.gaps + seq.duplicates > 0 {
            bail!("replay {i} was not `attached` then {e} contiguous events: {seq:?}");
        }
        if i >= 5 {
            h.saturating_record((took.as_micros() as u64).max(1));
            bar.inc(1);
        }
        reader
            .send(json!({"type":"detach","conversation_id":id,"req":4}))
            .await?;
        for _ in 0..16 {
            let text = reader.recv(WAIT).await?;
            if parse(text.as_str())?.ty == "detached" {
                break;
            }
        }
    }
    bar.finish_and_clear();
    reader.close().await;
    writer.close().await;
    let p99 = Measure::new(
        format!("attach+{e} events p99 ({label})"),
        "ms",
        ms(&h, 0.99),
    );
    Ok(vec![
        Measure::new(
            format!("attach+{e} events p50 ({label})"),
            "ms",
            ms(&h, 0.5),
        ),
        if label == "buffer" {
            p99.aim(Aim::AtMost(20.0))
        } else {
            p99
        },
        Measure::new(
            format!("attach+{e} events max ({label})"),
            "ms",
            ms(&h, 1.0),
        ),
    ])
}
