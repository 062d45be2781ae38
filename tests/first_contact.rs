//! What a newcomer does first: the README's two set-up commands. `cargo run
//! --release` must pick the `linger` binary and start the server on its
//! embedded defaults, with nothing else installed. Running cargo from a test
//! would wait on the build lock the test command itself holds, so this
//! checks the two facts that make it work: cargo's own view of which binary
//! `cargo run` starts, and that binary, run with no arguments, serving.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::process::ServerProcess;

const README: &str = include_str!("../README.md");

/// The commands in the README's "Set up" section, in order.
fn setup_commands() -> Vec<String> {
    let section = README
        .split("\n## ")
        .find(|s| s.starts_with("Set up"))
        .expect("README has a \"Set up\" section");
    let mut commands = Vec::new();
    let mut in_block = false;
    for line in section.lines() {
        if line.starts_with("```") {
            in_block = !in_block;
        } else if in_block && !line.trim().is_empty() {
            commands.push(line.trim().to_owned());
        }
    }
    commands
}

#[test]
fn the_readme_has_exactly_the_two_setup_commands() {
    assert_eq!(
        setup_commands(),
        ["cargo run --release", "cargo test --release"]
    );
}

#[test]
fn cargo_run_starts_the_linger_binary() {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata failed");
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let root = format!("{}/Cargo.toml", meta["workspace_root"].as_str().unwrap());
    let package = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["manifest_path"] == root.as_str())
        .expect("the repository root is a package: `cargo run` runs from it");
    let bins: Vec<&str> = package["targets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["kind"].as_array().unwrap().iter().any(|k| k == "bin"))
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    let runs = match package["default_run"].as_str() {
        Some(name) => name,
        None if bins.len() == 1 => bins[0],
        None => panic!("`cargo run` cannot choose among {bins:?}: set default-run"),
    };
    assert_eq!(runs, "linger");
    // From the root, `cargo run` looks at every default member of the
    // workspace: with binaries in the root package only, it has nothing
    // else to choose from.
    let default_members = meta["workspace_default_members"]
        .as_array()
        .expect("cargo metadata lists the default members");
    for member in meta["packages"].as_array().unwrap() {
        if member["manifest_path"] == root.as_str() || !default_members.contains(&member["id"]) {
            continue;
        }
        let has_bin = member["targets"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["kind"].as_array().unwrap().iter().any(|k| k == "bin"));
        assert!(
            !has_bin,
            "{} is a default member with a binary: `cargo run` would have to choose",
            member["name"]
        );
    }
}

/// `linger` with no arguments, from a directory with no config file: the
/// embedded defaults (history in `./data`), serving until SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linger_alone_serves_on_embedded_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_linger"));
    command
        .current_dir(dir.path())
        .env_remove("LINGER_CONFIG")
        // The default port may be taken on a developer's machine.
        .env("LINGER__SERVER__LISTEN", "127.0.0.1:0")
        .env("LINGER_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let mut server = ServerProcess::start(command);
    let mut client = server.connect("alice").await;
    let id = client.create().await;
    assert!(
        dir.path()
            .join("data")
            .join("workspaces")
            .join(&id)
            .is_dir(),
        "history and workspaces default to ./data"
    );
    server.signal("TERM");
    assert_eq!(server.wait_exit(Duration::from_secs(15)).code(), Some(0));
}

/// `linger --config FILE` is `linger serve --config FILE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_without_serve_serves() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("linger.toml");
    let store = dir.path().join("store");
    std::fs::write(
        &file,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[store]\npath = {:?}\n",
            store.display().to_string()
        ),
    )
    .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_linger"));
    command
        .arg("--config")
        .arg(&file)
        .env("LINGER_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let mut server = ServerProcess::start(command);
    let mut client = server.connect("alice").await;
    client.create().await;
    assert!(
        store.join("linger.lock").exists(),
        "the given store is used"
    );
    server.signal("TERM");
    assert_eq!(server.wait_exit(Duration::from_secs(15)).code(), Some(0));
}
