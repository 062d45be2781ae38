//! `linger new [--title T]`: creates a conversation and prints its id.

use super::{Client, Remote};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub remote: Remote,
    /// A title for the conversation.
    #[arg(long)]
    pub title: Option<String>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(&args.remote)?;
    let summary = client.create(args.title.as_deref()).await?;
    println!("{}", summary.id);
    Ok(())
}
