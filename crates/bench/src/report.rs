//! A scenario's figures for linger (or a cluster of it) and the servers it
//! is compared with, side by side, the ratio to the relay's, and the aim
//! each is held to; as a table or as JSON.

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

/// One scenario's figures: the first run is the one the aims judge
/// (`linger`, or `cluster`), the others are printed beside it; the ratio is
/// the first run's value to the relay's.
pub struct Report {
    pub scenario: String,
    pub params: Value,
    pub runs: Vec<(Server, Vec<Measure>)>,
}

struct Row<'a> {
    measure: &'a Measure,
    /// The same figure of every other run, in order.
    others: Vec<Option<f64>>,
    ratio: Option<f64>,
    met: Option<bool>,
}

impl Report {
    fn others(&self) -> &[(Server, Vec<Measure>)] {
        self.runs.get(1..).unwrap_or_default()
    }

    fn rows(&self) -> Vec<Row<'_>> {
        let Some((subject, measures)) = self.runs.first() else {
            return Vec::new();
        };
        let relay = self
            .others()
            .iter()
            .position(|(s, _)| *s == Server::Relay && *subject != Server::Relay);
        measures
            .iter()
            .map(|measure| {
                let others: Vec<Option<f64>> = self
                    .others()
                    .iter()
                    .map(|(_, ms)| ms.iter().find(|m| m.name == measure.name).map(|m| m.value))
                    .collect();
                let ratio = relay
                    .and_then(|i| others[i])
                    .filter(|r| *r != 0.0)
                    .map(|r| measure.value / r);
                let met = measure.aim.and_then(|a| a.met(measure.value, ratio));
                Row {
                    measure,
                    others,
                    ratio,
                    met,
                }
            })
            .collect()
    }

    /// The columns: every run's server, and the relay's even when it did
    /// not run (`--no-relay`), so that tables keep one layout.
    fn columns(&self) -> Vec<&'static str> {
        let mut columns: Vec<&'static str> = self.runs.iter().map(|(s, _)| s.name()).collect();
        if self.runs.first().is_some_and(|(s, _)| *s == Server::Linger)
            && !columns.contains(&Server::Relay.name())
        {
            columns.push(Server::Relay.name());
        }
        columns
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "\n{}  {}", self.scenario, self.params);
        let _ = write!(out, "  {:<34}", "figure");
        for column in self.columns() {
            let _ = write!(out, " {column:>12}");
        }
        let _ = writeln!(out, " {:>8}  aim", "ratio");
        let width = self.columns().len();
        for row in self.rows() {
            let m = row.measure;
            let unit = if m.unit.is_empty() {
                String::new()
            } else {
                format!(" ({})", m.unit)
            };
            let _ = write!(
                out,
                "  {:<34} {:>12}",
                format!("{}{unit}", m.name),
                num(m.value)
            );
            for i in 0..width - 1 {
                let value = row.others.get(i).copied().flatten();
                let _ = write!(out, " {:>12}", value.map(num).unwrap_or_else(|| "-".into()));
            }
            let _ = writeln!(
                out,
                " {:>8}  {:<18} {}",
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
        let columns = self.columns();
        let figures: Vec<Value> = self
            .rows()
            .iter()
            .map(|row| {
                let m = row.measure;
                let mut figure = json!({ "name": m.name, "unit": m.unit });
                for (i, column) in columns.iter().enumerate() {
                    let value = if i == 0 {
                        Some(m.value)
                    } else {
                        row.others.get(i - 1).copied().flatten()
                    };
                    figure[*column] = json!(value);
                }
                figure["ratio"] = json!(row.ratio);
                figure["aim"] = json!(m.aim.map(|a| a.text(m.unit)));
                figure["met"] = json!(row.met);
                figure
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
