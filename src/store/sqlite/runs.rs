//! Event runs: the events of one conversation committed together, stored as
//! one row of `event_runs` (a JSON array of `[seq, ts, kind, data]`, `data`
//! as the event's own JSON text). One row per conversation per commit
//! instead of one per event is what keeps a commit's B-tree and WAL work
//! per conversation rather than per event.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::*;

/// Most events in one run: a long burst becomes several runs, so that a
/// read by seq decodes at most this many events it does not need.
pub(super) const RUN_MAX_EVENTS: usize = 256;

/// One event as written into a run.
#[derive(Clone, Copy)]
pub(super) struct RunEvent<'e> {
    pub(super) seq: u64,
    pub(super) ts: &'e str,
    pub(super) kind: &'e str,
    /// The event's data, JSON text.
    pub(super) data: &'e str,
}

impl<'e> From<&'e EventRecord> for RunEvent<'e> {
    fn from(r: &'e EventRecord) -> Self {
        RunEvent {
            seq: r.seq,
            ts: &r.ts,
            kind: &r.kind,
            data: r.data(),
        }
    }
}

/// An encoded run and what its row says about it.
pub(super) struct EncodedRun {
    pub(super) first_seq: u64,
    pub(super) last_seq: u64,
    pub(super) n: usize,
    pub(super) min_ts: String,
    pub(super) max_ts: String,
    pub(super) json: String,
}

/// Encodes events (in seq order, at least one). `None` for none.
pub(super) fn encode<'e>(events: impl IntoIterator<Item = RunEvent<'e>>) -> Option<EncodedRun> {
    let mut json = String::with_capacity(256);
    json.push('[');
    let mut run: Option<EncodedRun> = None;
    let mut min_ts: &str = "";
    let mut max_ts: &str = "";
    for ev in events {
        match &mut run {
            None => {
                run = Some(EncodedRun {
                    first_seq: ev.seq,
                    last_seq: ev.seq,
                    n: 0,
                    min_ts: String::new(),
                    max_ts: String::new(),
                    json: String::new(),
                });
                (min_ts, max_ts) = (ev.ts, ev.ts);
            }
            Some(_) => {
                json.push(',');
                min_ts = min_ts.min(ev.ts);
                max_ts = max_ts.max(ev.ts);
            }
        }
        if let Some(run) = &mut run {
            run.last_seq = ev.seq;
            run.n += 1;
        }
        // Writing into a String cannot fail.
        let _ = write!(json, "[{},", ev.seq);
        push_json_str(&mut json, ev.ts);
        json.push(',');
        push_json_str(&mut json, ev.kind);
        json.push(',');
        json.push_str(ev.data);
        json.push(']');
    }
    json.push(']');
    run.map(|mut run| {
        run.min_ts = min_ts.to_owned();
        run.max_ts = max_ts.to_owned();
        run.json = json;
        run
    })
}

fn push_json_str(out: &mut String, s: &str) {
    // Serializing a str into a String cannot fail.
    if let Ok(quoted) = serde_json::to_string(s) {
        out.push_str(&quoted);
    }
}

/// Inserts one run (nothing for no events).
pub(super) fn insert_run<'e>(
    conn: &Connection,
    conversation_id: &str,
    events: impl IntoIterator<Item = RunEvent<'e>>,
) -> Result<(), StoreError> {
    let Some(run) = encode(events) else {
        return Ok(());
    };
    conn.prepare_cached(
        "INSERT INTO event_runs (conversation_id, first_seq, last_seq, n, min_ts, max_ts, events) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        conversation_id,
        clamp_i64(run.first_seq),
        clamp_i64(run.last_seq),
        run.n as i64,
        run.min_ts,
        run.max_ts,
        run.json,
    ])?;
    Ok(())
}

/// One event as read back from a run, borrowing the row's text.
#[derive(Deserialize)]
pub(super) struct StoredEvent<'a>(
    pub(super) u64,
    #[serde(borrow)] pub(super) Cow<'a, str>,
    #[serde(borrow)] pub(super) Cow<'a, str>,
    #[serde(borrow)] pub(super) &'a RawValue,
);

impl StoredEvent<'_> {
    pub(super) fn seq(&self) -> u64 {
        self.0
    }

    pub(super) fn kind(&self) -> &str {
        &self.2
    }

    pub(super) fn data(&self) -> &str {
        self.3.get()
    }

    pub(super) fn into_record(self, conversation_id: &str) -> Arc<EventRecord> {
        Arc::new(EventRecord::from_parts(
            conversation_id,
            self.0,
            self.1.into_owned(),
            intern_kind(&self.2),
            self.3.get().to_owned(),
        ))
    }
}

/// Decodes a run's `events` column.
pub(super) fn decode<'a>(
    conversation_id: &str,
    json: &'a str,
) -> Result<Vec<StoredEvent<'a>>, StoreError> {
    serde_json::from_str(json).map_err(|e| {
        StoreError::Backend(format!(
            "conversation {conversation_id}: bad event run: {e}"
        ))
    })
}

/// Events with seq > `after`, oldest first, at most `limit`, read run by run.
pub(super) fn events_after(
    conn: &Connection,
    id: &str,
    after: u64,
    limit: usize,
    mut keep: impl FnMut(&StoredEvent<'_>) -> bool,
) -> Result<Vec<Arc<EventRecord>>, StoreError> {
    let mut out = Vec::new();
    if limit == 0 {
        return Ok(out);
    }
    let mut stmt = conn.prepare_cached(
        "SELECT events FROM event_runs WHERE conversation_id = ?1 AND last_seq > ?2 \
         ORDER BY last_seq",
    )?;
    let mut rows = stmt.query(params![id, clamp_i64(after)])?;
    while let Some(row) = rows.next()? {
        let json = row.get_ref(0)?.as_str()?;
        for ev in decode(id, json)? {
            if ev.seq() > after && keep(&ev) {
                out.push(ev.into_record(id));
                if out.len() >= limit {
                    return Ok(out);
                }
            }
        }
    }
    Ok(out)
}

/// The last `n` events, oldest first.
pub(super) fn tail(
    conn: &Connection,
    id: &str,
    n: usize,
) -> Result<Vec<Arc<EventRecord>>, StoreError> {
    let mut out: Vec<Arc<EventRecord>> = Vec::new();
    if n == 0 {
        return Ok(out);
    }
    let mut stmt = conn.prepare_cached(
        "SELECT events FROM event_runs WHERE conversation_id = ?1 ORDER BY last_seq DESC",
    )?;
    let mut rows = stmt.query([id])?;
    while let Some(row) = rows.next()? {
        let json = row.get_ref(0)?.as_str()?;
        for ev in decode(id, json)?.into_iter().rev() {
            out.push(ev.into_record(id));
            if out.len() >= n {
                out.reverse();
                return Ok(out);
            }
        }
    }
    out.reverse();
    Ok(out)
}
