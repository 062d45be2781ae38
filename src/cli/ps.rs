//! `linger ps`: the conversations active on the server, as an operator
//! sees them (admins only).

use std::time::SystemTime;

use super::admin::active_table;
use super::Client;

/// Where, who, and `--json`: as `linger ls`.
pub type Args = super::ls::Args;

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.remote)?;
    if args.json {
        let value = client.active_json().await?;
        println!("{value}");
        return Ok(());
    }
    let list = client.active().await?;
    if list.is_empty() {
        eprintln!("no active conversations");
        return Ok(());
    }
    print!("{}", active_table(&list, SystemTime::now()));
    Ok(())
}
