//! The `relay` executable: the benchmark ceiling, whose code is the
//! `linger-relay` crate (crates/relay). It is built by this package, beside
//! `linger`, because `linger bench --spawn` runs it from the directory its
//! own executable is in.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    linger_relay::run(linger_relay::Args::parse()).await
}
