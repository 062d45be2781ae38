//! `linger bench` runs end to end against a spawned linger and the relay:
//! small scenarios, checked for what the load generator itself guarantees
//! (every stream finished, no gap, no duplicate; the soak's samples and
//! chart written). Speed is not asserted here; BENCHMARKS.md reports it.

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
fn streaming_runs_turns_back_to_back_with_staggered_starts() {
    let report = bench(&[
        "streaming",
        "-c",
        "5",
        "-t",
        "10",
        "-r",
        "100",
        "--turns",
        "3",
    ]);
    assert_eq!(report["params"]["turns"], 3, "{report}");
    // Latency counts while all five stream: from one turn (10 × 10 ms),
    // when the last has started, to three, when the first finishes.
    assert_eq!(
        report["params"]["latency_window_s"],
        serde_json::json!([0.1, 0.3]),
        "{report}"
    );
    for server in ["linger", "relay"] {
        assert_eq!(figure(&report, "streams finished")[server], 5.0, "{report}");
        // Each turn: user_message, turn_started, 10 deltas,
        // assistant_message, turn_finished.
        assert_eq!(
            figure(&report, "events delivered")[server],
            (5 * 14 * 3) as f64,
            "{report}"
        );
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

/// 20 s of soak with churn, one SIGKILL and restart, and a full disk (as
/// root, where a tmpfs can be mounted; the bench says when it cannot and
/// runs the kill alone).
#[test]
fn soak_with_a_kill_and_a_full_disk_keeps_every_stream_whole() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("soak.json");
    let out_arg = out.to_str().expect("a UTF-8 temp path");
    let report = bench(&[
        "soak",
        "--seconds",
        "20",
        "-c",
        "20",
        "-t",
        "20",
        "--interval-ms",
        "50",
        "--churn-every",
        "2s",
        "--churn-fraction",
        "0.2",
        "--sample-every",
        "2s",
        "--faults",
        "--kill-every",
        "8s",
        "--disk-full-at",
        "11s",
        "--disk-full-hold",
        "2s",
        "--out",
        out_arg,
    ]);
    let value = |name: &str| figure(&report, name)["linger"].as_f64().unwrap_or(-1.0);
    for name in [
        "gaps",
        "duplicates",
        "renumbered",
        "seen but above head",
        "clients that could not go on",
    ] {
        assert_eq!(value(name), 0.0, "{name}: {report}");
    }
    assert_eq!(value("SIGKILLs"), 1.0, "{report}");
    assert_eq!(value("restarts serving"), 1.0, "{report}");
    assert!(value("resumes") >= 20.0, "every client came back: {report}");
    assert!(value("seqs sent again and compared") > 0.0, "{report}");
    assert!(value("turns finished") > 0.0, "{report}");

    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("the JSON file")).expect("JSON");
    let samples = file["samples"].as_array().expect("samples");
    assert!(samples.len() >= 5, "{file}");
    assert!(
        samples.iter().any(|s| s["rss_mib"].as_f64().is_some()),
        "{file}"
    );
    if let Some(skipped) = file["disk_full"]["skipped"].as_str() {
        eprintln!("the disk-full episode was skipped: {skipped}");
    } else {
        assert!(
            file["disk_full"]["healthz_503"].as_u64() >= Some(1),
            "{file}"
        );
        assert!(
            file["disk_full"]["appends_after_s"].as_f64().is_some(),
            "appends worked again: {file}"
        );
    }
    let svg = std::fs::read_to_string(out.with_extension("svg")).expect("the chart");
    assert!(svg.trim_start().starts_with("<svg"), "{svg}");
    assert!(svg.trim_end().ends_with("</svg>"), "{svg}");
    assert!(svg.contains("server RSS") && svg.contains("SIGKILL"));
}
