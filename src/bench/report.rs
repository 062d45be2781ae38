//! A scenario's figures for linger and the relay side by side, their ratio,
//! and the aim each is held to; as a table or as JSON.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::Server;

/// One figure of one run.
#[derive(Debug, Clone)]
pub struct Measure {
    pub name: String,
    pub unit: &'static str,
    pub value: f64,
    pub aim: Option<Aim>,
}

impl Measure {
    pub fn new(name: impl Into<String>, unit: &'static str, value: f64) -> Measure {
        Measure {
            name: name.into(),
            unit,
            value,
            aim: None,
        }
    }

    pub fn aim(mut self, aim: Aim) -> Measure {
        self.aim = Some(aim);
        self
    }
}

/// What a figure of linger is held to.
#[derive(Debug, Clone, Copy)]
pub enum Aim {
    AtMost(f64),
    AtLeast(f64),
    /// linger / relay at most this.
    RatioAtMost(f64),
    /// linger / relay at least this.
    RatioAtLeast(f64),
}

impl Aim {
    fn text(self, unit: &str) -> String {
        match self {
            Aim::AtMost(v) => format!("<= {} {unit}", num(v)),
            Aim::AtLeast(v) => format!(">= {} {unit}", num(v)),
            Aim::RatioAtMost(r) => format!("<= {r}x relay"),
            Aim::RatioAtLeast(r) => format!(">= {r}x relay"),
        }
    }

    fn met(self, value: f64, ratio: Option<f64>) -> Option<bool> {
        match self {
            Aim::AtMost(v) => Some(value <= v),
            Aim::AtLeast(v) => Some(value >= v),
            Aim::RatioAtMost(r) => ratio.map(|x| x <= r),
            Aim::RatioAtLeast(r) => ratio.map(|x| x >= r),
        }
    }
}

pub struct Report {
    pub scenario: String,
    pub params: Value,
    pub runs: Vec<(Server, Vec<Measure>)>,
}

struct Row<'a> {
    measure: &'a Measure,
    relay: Option<f64>,
    ratio: Option<f64>,
    met: Option<bool>,
}

impl Report {
    fn rows(&self) -> Vec<Row<'_>> {
        let linger = self
            .runs
            .iter()
            .find(|(s, _)| *s == Server::Linger)
            .map(|(_, m)| m.as_slice())
            .unwrap_or_default();
        let relay = self
            .runs
            .iter()
            .find(|(s, _)| *s == Server::Relay)
            .map(|(_, m)| m.as_slice());
        linger
            .iter()
            .map(|measure| {
                let relay =
                    relay.and_then(|r| r.iter().find(|m| m.name == measure.name).map(|m| m.value));
                let ratio = relay.filter(|r| *r != 0.0).map(|r| measure.value / r);
                let met = measure.aim.and_then(|a| a.met(measure.value, ratio));
                Row {
                    measure,
                    relay,
                    ratio,
                    met,
                }
            })
            .collect()
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "\n{}  {}", self.scenario, self.params);
        let _ = writeln!(
            out,
            "  {:<34} {:>12} {:>12} {:>8}  aim",
            "figure", "linger", "relay", "ratio"
        );
        for row in self.rows() {
            let m = row.measure;
            let unit = if m.unit.is_empty() {
                String::new()
            } else {
                format!(" ({})", m.unit)
            };
            let _ = writeln!(
                out,
                "  {:<34} {:>12} {:>12} {:>8}  {:<18} {}",
                format!("{}{unit}", m.name),
                num(m.value),
                row.relay.map(num).unwrap_or_else(|| "-".into()),
                row.ratio
                    .map(|r| format!("{r:.2}x"))
                    .unwrap_or_else(|| "-".into()),
                m.aim.map(|a| a.text(m.unit)).unwrap_or_default(),
                match row.met {
                    Some(true) => "met",
                    Some(false) => "MISSED",
                    None => "",
                }
            );
        }
        out
    }

    pub fn json(&self) -> Value {
        let figures: Vec<Value> = self
            .rows()
            .iter()
            .map(|row| {
                let m = row.measure;
                json!({
                    "name": m.name,
                    "unit": m.unit,
                    "linger": m.value,
                    "relay": row.relay,
                    "ratio": row.ratio,
                    "aim": m.aim.map(|a| a.text(m.unit)),
                    "met": row.met,
                })
            })
            .collect();
        json!({
            "scenario": self.scenario,
            "params": self.params,
            "figures": figures,
        })
    }
}

/// A number with as many decimals as it deserves.
fn num(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}
