//! `linger reload`: the server re-reads its configuration file, as on
//! SIGHUP (admins only); prints what changed and what was refused.

use super::{Client, Remote};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub remote: Remote,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.remote)?;
    let outcome = client.reload().await?;
    if outcome.applied.is_empty() && outcome.refused.is_empty() {
        println!("nothing changed");
    }
    for a in &outcome.applied {
        println!("{}: {} -> {}", a.key, a.from, a.to);
    }
    for r in &outcome.refused {
        println!("refused {}: {}", r.key, r.message);
    }
    Ok(())
}
