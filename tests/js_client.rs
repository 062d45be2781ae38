//! The JavaScript client's own tests (`clients/js/test/*.test.js`, Node's
//! test runner) against this build's `linger` binary, so that
//! `cargo test --release` covers the client too. The Node tests start and
//! stop their own servers (port 0, a temporary store); this test only
//! runs `node --test` with the binary's path in `LINGER_BIN`.
//!
//! Node is not installed for this: without `node` on the PATH (or older
//! than 20) the test says it skipped and passes.

use std::path::Path;
use std::process::Command;

/// The major version of the `node` on the PATH, if any.
fn node_major() -> Option<u32> {
    let output = Command::new("node")
        .args(["-p", "process.versions.node"])
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .split('.')
        .next()?
        .parse()
        .ok()
}

#[test]
fn the_javascript_client_passes_its_node_tests() {
    let Some(major) = node_major() else {
        eprintln!("skipped: no `node` on the PATH (the JavaScript client's tests need Node 20+)");
        return;
    };
    if major < 20 {
        eprintln!("skipped: node {major} is older than 20, which the JavaScript client needs");
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/js");
    let mut files: Vec<String> = std::fs::read_dir(dir.join("test"))
        .expect("read clients/js/test")
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".test.js"))
        .map(|name| format!("test/{name}"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no clients/js/test/*.test.js");

    let mut command = Command::new("node");
    // Node 20 has its WebSocket behind a flag; 22 has it on by default.
    if major < 22 {
        command.arg("--experimental-websocket");
    }
    let output = command
        .arg("--test")
        .args(&files)
        .current_dir(&dir)
        .env("LINGER_BIN", env!("CARGO_BIN_EXE_linger"))
        .output()
        .expect("run node --test");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "node --test failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    println!("{stdout}");
}
