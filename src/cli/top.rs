//! `linger top`: what `linger ps` shows and the newest supervision
//! decisions, redrawn every `--interval` like `top`, until `q` or Ctrl-C
//! (admins only). Any other key redraws at once.

use std::io::{IsTerminal, Read, Write};
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;

use super::admin::{active_table, ActiveList, RecentDecisions};
use super::{Client, Remote};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub remote: Remote,
    /// How often to refresh (a humantime duration).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    /// How many recent supervision decisions to show.
    #[arg(long, default_value_t = 12)]
    pub decisions: usize,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.remote)?;
    // The first reads fail the command (no server, a refused token, not
    // an admin); later failures are shown and retried.
    let mut list = client.active().await?;
    let mut recent = RecentDecisions::default();
    recent.add(client.decisions(0).await?, args.decisions);
    let _keys_mode = KeysMode::enable();
    let mut keys = keys();
    let mut keys_open = true;
    let mut problem: Option<String> = None;
    loop {
        draw(&client.base, &list, &recent, problem.as_deref())?;
        tokio::select! {
            _ = tokio::time::sleep(args.interval) => {}
            key = keys.recv(), if keys_open => match key {
                Some(b'q' | b'Q') => break,
                Some(_) => {}
                // Input closed (not a terminal, or gone): only Ctrl-C ends.
                None => keys_open = false,
            },
            _ = tokio::signal::ctrl_c() => break,
        }
        match refresh(&client, &mut recent, args.decisions).await {
            Ok(fresh) => {
                list = fresh;
                problem = None;
            }
            Err(e) => problem = Some(format!("cannot refresh: {e:#}")),
        }
    }
    println!();
    Ok(())
}

async fn refresh(
    client: &Client,
    recent: &mut RecentDecisions,
    keep: usize,
) -> anyhow::Result<ActiveList> {
    let list = client.active().await?;
    recent.add(client.decisions(recent.head).await?, keep);
    Ok(list)
}

/// Clears the screen and draws the header, the table and the decisions.
fn draw(
    url: &str,
    listed: &ActiveList,
    recent: &RecentDecisions,
    problem: Option<&str>,
) -> std::io::Result<()> {
    let now = SystemTime::now();
    let list = &listed.conversations;
    let mut out = String::from("\x1b[H\x1b[2J");
    out.push_str(&format!(
        "linger top  {url}  {} active  {}  (q quits)\n",
        list.len(),
        humantime::format_rfc3339_seconds(now)
    ));
    for line in problem
        .into_iter()
        .map(str::to_owned)
        .chain(listed.missing())
    {
        out.push_str(&format!("[linger] {line}\n"));
    }
    out.push('\n');
    if list.is_empty() {
        out.push_str("no active conversations\n");
    } else {
        out.push_str(&active_table(list, now));
    }
    out.push_str("\nRECENT DECISIONS\n");
    for line in recent.lines() {
        out.push_str(&line);
        out.push('\n');
    }
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()
}

/// Bytes typed on stdin, read by a thread of their own (a blocking read
/// that the process's exit ends).
fn keys() -> mpsc::Receiver<u8> {
    let (tx, rx) = mpsc::channel(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut byte = [0u8; 1];
        while let Ok(1) = stdin.read(&mut byte) {
            if tx.blocking_send(byte[0]).is_err() {
                return;
            }
        }
    });
    rx
}

/// On a terminal: keys arrive as typed (no Enter) and are not echoed;
/// Ctrl-C still interrupts. The terminal's mode comes back on drop.
struct KeysMode {
    #[cfg(unix)]
    saved: Option<nix::sys::termios::Termios>,
}

impl KeysMode {
    fn enable() -> KeysMode {
        #[cfg(unix)]
        {
            use nix::sys::termios::{tcgetattr, tcsetattr, LocalFlags, SetArg};
            let stdin = std::io::stdin();
            if !stdin.is_terminal() {
                return KeysMode { saved: None };
            }
            let Ok(saved) = tcgetattr(&stdin) else {
                return KeysMode { saved: None };
            };
            let mut keys = saved.clone();
            keys.local_flags
                .remove(LocalFlags::ICANON | LocalFlags::ECHO);
            if tcsetattr(&stdin, SetArg::TCSANOW, &keys).is_err() {
                return KeysMode { saved: None };
            }
            KeysMode { saved: Some(saved) }
        }
        #[cfg(not(unix))]
        KeysMode {}
    }
}

impl Drop for KeysMode {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Some(saved) = &self.saved {
            let _ = nix::sys::termios::tcsetattr(
                std::io::stdin(),
                nix::sys::termios::SetArg::TCSANOW,
                saved,
            );
        }
    }
}
