//! `linger ps`: the conversations active on the server, as an operator
//! sees them (admins only).

use std::time::SystemTime;

use super::admin::{active_table, not_listed};
use super::Client;

/// Where, who, and `--json`: as `linger ls`.
pub type Args = super::ls::Args;

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.remote)?;
    if args.json {
        let (value, unanswered) = client.active_json().await?;
        println!("{value}");
        if let Some(missing) = not_listed(&unanswered) {
            eprintln!("[linger] {missing}");
        }
        return Ok(());
    }
    let list = client.active().await?;
    if let Some(missing) = list.missing() {
        eprintln!("[linger] {missing}");
    }
    if list.conversations.is_empty() {
        eprintln!("no active conversations");
        return Ok(());
    }
    print!("{}", active_table(&list.conversations, SystemTime::now()));
    Ok(())
}
