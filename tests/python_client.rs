//! The Python client's own tests (`clients/python/tests`, pytest) against
//! the linger binary of this build: a socket dropped mid-turn, an unacked
//! message resent, client tool calls answered across a reconnect. The pytest
//! fixtures start and kill their own servers on free ports.
//!
//! Their dependencies (websockets, pytest, pytest-asyncio) are installed
//! under the target directory by `scripts/install-test-deps.sh python DIR`
//! when missing or when `clients/python/pyproject.toml` changed. Without
//! python3 (3.10 or later) the test says it skipped and passes; any other
//! failure to set up or run pytest fails it, "no tests collected" included.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The version of `python3`, or why the tests cannot run with it.
fn python3() -> Result<String, String> {
    let check = "import sys; print(sys.version.split()[0]); sys.exit(sys.version_info < (3, 10))";
    let output = Command::new("python3")
        .args(["-c", check])
        .output()
        .map_err(|e| format!("python3 is not installed ({e})"))?;
    let version = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if output.status.success() {
        Ok(version)
    } else {
        Err(format!(
            "python3 {version} is older than 3.10, which the client needs"
        ))
    }
}

fn show(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Installs the dependencies into `deps` unless the stamp says they match
/// the current pyproject.toml.
fn ensure_deps(root: &Path, deps: &Path) {
    let pyproject = std::fs::read_to_string(root.join("clients/python/pyproject.toml"))
        .expect("read clients/python/pyproject.toml");
    let stamp = deps.with_extension("stamp");
    if deps.is_dir() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&pyproject) {
        return;
    }
    let script = root.join("scripts/install-test-deps.sh");
    let output = Command::new("bash")
        .arg(&script)
        .arg("python")
        .arg(deps)
        .output()
        .expect("run scripts/install-test-deps.sh");
    assert!(
        output.status.success(),
        "installing the Python client's test dependencies with {} failed ({}):\n{}",
        script.display(),
        output.status,
        show(&output)
    );
    std::fs::write(&stamp, pyproject).expect("write the dependencies' stamp");
}

#[test]
fn python_client_tests_pass() {
    let version = match python3() {
        Ok(version) => version,
        Err(why) => {
            println!("skipped: {why}, so the Python client's tests did not run");
            return;
        }
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let deps: PathBuf = Path::new(env!("CARGO_TARGET_TMPDIR")).join("python-client-deps");
    ensure_deps(root, &deps);

    // The source tree first, so the tests import the client as it is now,
    // not the copy pip put among the dependencies.
    let path = std::env::join_paths([root.join("clients/python/src"), deps.clone()])
        .expect("a PYTHONPATH");
    let output = Command::new("python3")
        .args(["-m", "pytest", "-p", "no:cacheprovider", "-ra"])
        .arg(root.join("clients/python/tests"))
        .current_dir(root)
        .env("LINGER_BIN", env!("CARGO_BIN_EXE_linger"))
        .env("PYTHONPATH", path)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("run pytest");
    let text = show(&output);
    println!("python {version}\n{text}");
    // pytest: 0 all passed, 5 nothing collected (a failure here too).
    match output.status.code() {
        Some(0) => {}
        Some(5) => panic!("pytest collected no tests in clients/python/tests:\n{text}"),
        _ => panic!(
            "the Python client's tests failed ({}):\n{text}",
            output.status
        ),
    }
}
