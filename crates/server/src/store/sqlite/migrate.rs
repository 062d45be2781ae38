//! The database's format version (`PRAGMA user_version`) and the steps that
//! bring a store written by an earlier release up to it, run by the writer
//! connection at open, each in its own transaction with the version it
//! reaches, so that a store is either before or after a step.
//!
//! - 0: the release before versions (and a new, empty database).
//! - 1: `client_msgs` has an index on `(conversation_id, seq)`: the
//!   `client_msg_id` window is read newest first and pruned below its first
//!   seq without scanning a conversation's ids.

use super::*;

/// The version this release writes.
pub(super) const VERSION: i64 = 1;

/// The steps, each from the version before it to its number.
const STEPS: [&str; VERSION as usize] =
    ["CREATE INDEX IF NOT EXISTS client_msgs_by_seq ON client_msgs (conversation_id, seq);"];

/// Brings the database at `conn` (its tables created) to [`VERSION`];
/// refuses one written by a newer release, which this one cannot read.
pub(super) fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let found: i64 = conn.pragma_query_value(None, "user_version", |row| row.get(0))?;
    if found > VERSION {
        return Err(StoreError::Backend(format!(
            "the store's format is version {found}, written by a newer linger; \
             this one reads up to version {VERSION}"
        )));
    }
    for (to, step) in (1..).zip(STEPS).skip(usize::try_from(found).unwrap_or(0)) {
        let tx = conn.transaction()?;
        tx.execute_batch(step)?;
        tx.pragma_update(None, "user_version", to)?;
        tx.commit()?;
    }
    Ok(())
}

/// The store's format version.
#[cfg(test)]
pub(super) fn version(conn: &Connection) -> i64 {
    conn.pragma_query_value(None, "user_version", |row| row.get(0))
        .unwrap_or(-1)
}
