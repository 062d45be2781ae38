//! The binary refuses a bad configuration at start-up, naming the key, and
//! takes `LINGER__SECTION__KEY` overrides.

use std::process::{Command, Stdio};

fn linger() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_linger"));
    cmd.env_remove("LINGER_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, _) in std::env::vars() {
        if key.starts_with("LINGER__") {
            cmd.env_remove(key);
        }
    }
    cmd
}

fn refused(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run linger");
    assert!(!out.status.success(), "linger started with a bad config");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn unknown_key_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("linger.toml");
    std::fs::write(&file, "[conversations]\nclose_dealy = \"5m\"\n").unwrap();
    let err = refused(linger().args(["serve", "--config"]).arg(&file));
    assert!(err.contains("close_dealy"), "stderr: {err}");
    assert!(err.contains("conversations"), "stderr: {err}");
}

#[test]
fn unknown_section_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("linger.toml");
    std::fs::write(&file, "[storage]\npath = \"x\"\n").unwrap();
    let err = refused(linger().args(["serve", "--config"]).arg(&file));
    assert!(err.contains("storage"), "stderr: {err}");
}

#[test]
fn bad_duration_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("linger.toml");
    std::fs::write(&file, "[conversations]\nclose_delay = \"soon\"\n").unwrap();
    let err = refused(linger().args(["serve", "--config"]).arg(&file));
    assert!(err.contains("conversations.close_delay"), "stderr: {err}");
}

#[test]
fn bad_env_override_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = refused(
        linger()
            .current_dir(dir.path())
            .env("LINGER__CONVERSATIONS__MAX_PER_USER", "many")
            .arg("serve"),
    );
    assert!(err.contains("conversations.max_per_user"), "stderr: {err}");
}

#[test]
fn dev_auth_refuses_a_public_address() {
    let dir = tempfile::tempdir().unwrap();
    let err = refused(
        linger()
            .current_dir(dir.path())
            .env("LINGER__SERVER__LISTEN", "0.0.0.0:0")
            .arg("serve"),
    );
    assert!(err.contains("auth.mode"), "stderr: {err}");
}

#[test]
fn missing_config_file_is_an_error() {
    let err = refused(linger().args(["serve", "--config", "/nonexistent/linger.toml"]));
    assert!(err.contains("/nonexistent/linger.toml"), "stderr: {err}");
}

#[test]
fn shipped_config_matches_the_defaults() {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/linger.toml");
    let text = std::fs::read_to_string(shipped).unwrap();
    let parsed = linger::config::Config::from_toml(&text).unwrap();
    assert_eq!(parsed, linger::config::Config::default());
}

/// config/linger.toml marks each key that a reload changes live with
/// "(live)" in its comment, and only those (`config::keys::reloadability`).
#[test]
fn shipped_config_marks_the_live_keys() {
    use linger::config::keys::{reloadability, Reloadability};
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/linger.toml");
    let text = std::fs::read_to_string(shipped).unwrap();
    let mut section = String::new();
    let mut comment = String::new();
    let mut seen = 0;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_owned();
            comment.clear();
        } else if let Some(text) = line.strip_prefix('#') {
            comment.push_str(text);
        } else if let Some((key, _)) = line.split_once(" = ") {
            let key = format!("{section}.{key}");
            let marked = comment.contains("(live)");
            let live = reloadability(&key) == Reloadability::Live;
            assert_eq!(
                marked,
                live,
                "config/linger.toml: {key} is {}marked (live), but it is {}",
                if marked { "" } else { "not " },
                if live { "reloadable" } else { "not reloadable" }
            );
            seen += 1;
            comment.clear();
        } else if line.is_empty() {
            comment.clear();
        }
    }
    assert!(seen > 20, "read only {seen} keys");
}
