//! The read queries behind `get`, `list`, `events`, `snapshot` and
//! `unfinished`, each a function over one read-only connection.

use super::*;

/// One conversation's summary, in its own read transaction.
pub(super) fn meta(
    conn: &mut Connection,
    members: &JournalMembers,
    id: &str,
) -> Result<Option<ConversationMeta>, StoreError> {
    let (tx, journal) = journal::begin_read(conn, members, id)?;
    get_meta(&tx, id, journal)
}

/// One conversation's summary; `journal`: whether the journal may hold
/// runs of it (else it is not read).
pub(super) fn get_meta(
    conn: &Connection,
    id: &str,
    journal: bool,
) -> Result<Option<ConversationMeta>, StoreError> {
    let raw = conn
        .prepare_cached(&format!("{META_SELECT} WHERE c.id = ?1"))?
        .query_row([id], RawMeta::from_row)
        .optional()?;
    let Some(raw) = raw else {
        return Ok(None);
    };
    let raw = if journal {
        let newest = journal::runs_of(conn, id, raw.head_seq, false)?.pop();
        raw.with_journal_head(newest.map(|run| (run.last_seq, run.max_ts)))
    } else {
        raw
    };
    raw.into_meta().map(Some)
}

/// Summaries of one user's conversations (every user's for `None`), newest
/// activity first.
pub(super) fn list(
    conn: &Connection,
    user: Option<&str>,
) -> Result<Vec<ConversationMeta>, StoreError> {
    match user {
        Some(user) => summaries(conn, "WHERE c.user = ?1", [user]),
        None => summaries(conn, "", []),
    }
}

/// The summaries of the conversations `filter` (an SQL `WHERE` over `c`,
/// with `params`) selects, newest activity first, with the journal's
/// heads (read once for all of them).
fn summaries<P: rusqlite::Params>(
    conn: &Connection,
    filter: &str,
    params: P,
) -> Result<Vec<ConversationMeta>, StoreError> {
    let mut stmt = conn.prepare_cached(&format!("{META_SELECT} {filter}"))?;
    let rows = stmt.query_map(params, RawMeta::from_row)?;
    let rows = rows.collect::<Result<Vec<_>, _>>()?;
    let mut heads = journal::heads(conn)?;
    let mut metas = rows
        .into_iter()
        .map(|raw| {
            let head = heads.remove(&raw.id);
            raw.with_journal_head(head).into_meta()
        })
        .collect::<Result<Vec<_>, _>>()?;
    metas.sort_by(|a, b| {
        b.last_activity_at
            .cmp(&a.last_activity_at)
            .then_with(|| a.id.cmp(&b.id))
    });
    Ok(metas)
}

/// Stored events with seq > `after`, oldest first, at most `limit`.
pub(super) fn events(
    conn: &mut Connection,
    members: &JournalMembers,
    id: &str,
    after: u64,
    limit: usize,
) -> Result<Vec<Arc<EventRecord>>, StoreError> {
    // One read transaction: the runs and the journal of the same commit.
    let (tx, journal) = journal::begin_read(conn, members, id)?;
    events_after(&tx, id, after, limit, journal, |_| true)
}

/// Everything needed to reactivate a conversation, with its last `tail`
/// events and its newest `client_msg_ids` ids.
pub(super) fn snapshot(
    conn: &mut Connection,
    members: &JournalMembers,
    id: &str,
    tail: usize,
    client_msg_ids: usize,
) -> Result<Option<Snapshot>, StoreError> {
    // One read transaction, so that the row, the tail and the queue
    // are of the same commit.
    let (tx, journal) = journal::begin_read(conn, members, id)?;
    let Some(meta) = get_meta(&tx, id, journal)? else {
        return Ok(None);
    };
    let tail_events = runs::tail(&tx, id, tail, journal)?;
    let queued = events_after(
        &tx,
        id,
        meta.last_turn_message_seq,
        usize::MAX,
        journal,
        |ev| ev.kind() == "user_message",
    )?
    .into_iter()
    .map(|ev| {
        Ok(QueuedMessage {
            seq: ev.seq,
            text: message_text(ev.data()).ok_or_else(|| {
                StoreError::Backend(format!(
                    "conversation {id}: user_message {} has no text",
                    ev.seq
                ))
            })?,
        })
    })
    .collect::<Result<Vec<_>, StoreError>>()?;
    let client_msg_ids = {
        // The newest, from the (conversation_id, seq) index: a store that
        // holds more (written before the window existed) is read bounded.
        let mut stmt = tx.prepare_cached(
            "SELECT client_msg_id, seq FROM client_msgs \
                     WHERE conversation_id = ?1 ORDER BY seq DESC LIMIT ?2",
        )?;
        let newest = clamp_i64(client_msg_ids as u64);
        let rows = stmt.query_map(params![id, newest], |row| Ok((row.get(0)?, row.get(1)?)))?;
        let mut ids = rows.collect::<Result<Vec<(String, u64)>, _>>()?;
        ids.reverse();
        ids
    };
    Ok(Some(Snapshot {
        meta,
        tail: tail_events,
        queued,
        client_msg_ids,
    }))
}

/// Conversations not stored as `stopped`.
pub(super) fn unfinished(conn: &Connection) -> Result<Vec<ConversationMeta>, StoreError> {
    summaries(conn, "WHERE c.status != 'stopped'", [])
}
