//! `linger bench` runs end to end against a spawned linger and the relay:
//! small scenarios, checked for what the load generator itself guarantees
//! (every stream finished, no gap, no duplicate). Speed is not asserted
//! here; BENCHMARKS.md reports it.

use std::process::Command;

use serde_json::Value;

fn bench(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_linger"))
        .args(["bench", "--spawn", "--json"])
        .args(args)
        .output()
        .expect("run linger bench");
    assert!(
        out.status.success(),
        "linger bench {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "linger bench {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn figure<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["figures"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["name"] == name))
        .unwrap_or_else(|| panic!("no figure {name:?} in {report}"))
}

#[test]
fn streaming_and_storm_deliver_everything_once_to_both_servers() {
    let report = bench(&["streaming", "-c", "5", "-t", "50", "-r", "100"]);
    for server in ["linger", "relay"] {
        assert_eq!(figure(&report, "streams finished")[server], 5.0, "{report}");
        assert_eq!(
            figure(&report, "events delivered")[server],
            270.0,
            "{report}"
        );
        assert_eq!(figure(&report, "gaps")[server], 0.0, "{report}");
        assert_eq!(figure(&report, "duplicates")[server], 0.0, "{report}");
    }
    let report = bench(&["storm", "-n", "10", "-t", "20", "--interval-ms", "20"]);
    for server in ["linger", "relay"] {
        assert_eq!(figure(&report, "gaps")[server], 0.0, "{report}");
        assert_eq!(figure(&report, "duplicates")[server], 0.0, "{report}");
    }
}

#[test]
fn replay_measures_buffer_and_store() {
    let report = bench(&["replay", "-e", "100", "-a", "3"]);
    for name in [
        "attach+100 events p99 (buffer)",
        "attach+100 events p99 (store)",
    ] {
        let ms = figure(&report, name)["linger"].as_f64();
        assert!(ms.is_some_and(|ms| ms > 0.0), "{name}: {report}");
    }
}

#[test]
fn compact_sends_a_fresh_client_less_than_full() {
    let report = bench(&["compact", "-n", "10", "-t", "50", "-o", "2"]);
    let value = |name: &str| figure(&report, name)["linger"].as_f64().unwrap_or(0.0);
    // Every finished turn's 50 deltas are left out of the compact replay.
    assert!(
        value("replay events (full)") >= value("replay events (compact)") + 500.0,
        "{report}"
    );
    assert!(value("replay bytes (compact)") > 0.0, "{report}");
    assert!(value("bytes full / compact") > 2.0, "{report}");
    for name in ["first text p50 (compact)", "whole history p50 (compact)"] {
        assert!(value(name) > 0.0, "{name}: {report}");
    }
}
