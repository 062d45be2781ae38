//! `linger ls`: the caller's conversations, most recently active first.

use super::{Client, Remote};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub remote: Remote,
    /// Print the REST answer as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.remote)?;
    let list = client.list().await?;
    if args.json {
        let rows: Vec<serde_json::Value> = list
            .iter()
            .map(|s| {
                serde_json::json!({
                    "id": s.id, "title": s.title, "status": s.status, "head_seq": s.head_seq,
                    "created_at": s.created_at, "last_activity_at": s.last_activity_at,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }
    if list.is_empty() {
        eprintln!("no conversations yet: `linger new` starts one");
        return Ok(());
    }
    let id_width = list.iter().map(|s| s.id.len()).max().unwrap_or(2).max(2);
    println!(
        "{:<id_width$}  {:<8}  {:>6}  {:<24}  TITLE",
        "ID", "STATUS", "SEQ", "LAST ACTIVITY"
    );
    for s in &list {
        println!(
            "{:<id_width$}  {:<8}  {:>6}  {:<24}  {}",
            s.id, s.status, s.head_seq, s.last_activity_at, s.title
        );
    }
    Ok(())
}
