//! The writer thread: the only write connection, commands applied in queue
//! order, group commit, and each group's outcomes handed out after its
//! commit (`answers.rs`).

use std::borrow::Cow;
use std::time::Instant;

use smallvec::SmallVec;

use super::*;

pub(super) enum Command {
    Append {
        batch: AppendBatch,
        done: CommitCallback,
    },
    Delete {
        id: String,
        reply: oneshot::Sender<Result<bool, StoreError>>,
    },
    AddObserver {
        id: String,
        user: String,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Flush {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    /// One small real write, to learn whether writes work again.
    Probe {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Prune {
        cutoff: String,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
    /// Tests: the writer waits here, when it takes this command, until
    /// `until` is sent to or dropped, so that what is queued meanwhile
    /// goes as one group whatever the threads' timing.
    #[cfg(test)]
    Hold {
        until: std::sync::mpsc::Receiver<()>,
    },
}

/// What a command produced inside the transaction, handed out after commit.
pub(super) enum Done {
    Unit,
    Existed(bool),
}

impl Command {
    pub(super) fn fail(self, e: StoreError) {
        self.finish(Err(e));
    }

    /// Hands the result to whoever waits. Callbacks are the caller's code:
    /// one that panics must not take down what answers every other
    /// conversation's appends (the answering task, or the writer itself).
    pub(super) fn finish(self, result: Result<Done, StoreError>) {
        match self {
            Command::Append { done, batch } => {
                let r = result.map(|_| ());
                if catch_unwind(AssertUnwindSafe(|| done(r, &batch.events))).is_err() {
                    tracing::error!("store: an append callback panicked");
                }
            }
            Command::Delete { reply, .. } => {
                let _ = reply.send(result.map(|d| matches!(d, Done::Existed(true))));
            }
            Command::AddObserver { reply, .. }
            | Command::Flush { reply }
            | Command::Probe { reply } => {
                let _ = reply.send(result.map(|_| ()));
            }
            Command::Prune { reply, .. } => {
                let _ = reply.send(result.map(|_| 0));
            }
            #[cfg(test)]
            Command::Hold { .. } => {}
        }
    }
}

/// A prune in progress: it deletes one chunk per transaction until a chunk
/// comes back short.
pub(super) struct PruneJob {
    pub(super) cutoff: String,
    /// The last run looked at (its rowid): where the next chunk starts.
    pub(super) cursor: i64,
    pub(super) deleted: u64,
    /// The journal was folded once the scan reached the end, so that the
    /// events it held are looked at too.
    pub(super) journal_folded: bool,
    pub(super) reply: oneshot::Sender<Result<u64, StoreError>>,
}

pub(super) struct Writer {
    pub(super) conn: Connection,
    pub(super) rx: Receiver<Box<Command>>,
    pub(super) commits: Arc<AtomicU64>,
    pub(super) prunes: VecDeque<PruneJob>,
    /// Set by the checkpointer, see [`Writer::restart_wal`].
    pub(super) restart_wanted: Arc<AtomicBool>,
    /// Groups run since a restart was wanted without an idle moment.
    pub(super) busy_groups: u32,
    /// Whether writes work, from every transaction's outcome.
    pub(super) health: Arc<StoreHealth>,
    /// The heads and row fields of the conversations written lately.
    pub(super) known: KnownRows,
    /// How much the journal holds, and since when.
    pub(super) journal: JournalFill,
    /// The fold in progress, one step after each group.
    pub(super) fold: Option<Fold>,
    /// A fold failed half way: the next one skips what it had moved.
    pub(super) fold_left_overlap: bool,
    /// Which conversations readers must look for in the journal.
    pub(super) members: Arc<JournalMembers>,
    /// The buffers each group's journal row is built in, kept from one
    /// group to the next: growing new ones was a tenth of this thread's
    /// time under paced load.
    pub(super) journal_row: JournalRow,
    /// When the last group started: the next starts [`GROUP_SPACING`]
    /// after it at the earliest.
    pub(super) last_group_at: Option<Instant>,
    /// A group or a fold ran since the heaps last gave their free pages
    /// back (see [`QUIET_BEFORE_RELEASE`]).
    pub(super) wrote_since_release: bool,
    /// Where each group's commands are answered once it is committed (or
    /// failed): `answers.rs`.
    pub(super) answers: Answers,
}

/// How long the writer waits with nothing to do, after it wrote, before
/// it frees SQLite's page cache (the readers' pages too) and the
/// process's heaps give their free pages back
/// ([`crate::heap::release_freed`]). Every event passes through here, so
/// a quiet writer is a quiet server: what the traffic freed (evicted
/// events, sockets' buffers, a fold's working set, which this thread
/// allocates among the rows its caches keep) otherwise stays resident,
/// and a server's memory stayed at its busiest (BENCHMARKS.md, item 23).
/// Only when quiet: under load the pages are about to be used again, and
/// giving them back would cost a page fault each. Once per quiet spell,
/// so at most twice a second: under a millisecond at 10,000 idle
/// conversations here, 59 ms after 10 million events had left 370 MiB
/// free (the kernel unmapping the pages); an append that comes meanwhile
/// waits that long.
const QUIET_BEFORE_RELEASE: std::time::Duration = std::time::Duration::from_millis(500);

/// The least time from one group's start to the next's. Under paced load
/// appends come one by one, and a writer that took each as it came woke,
/// and committed, once or twice per event (2,300 commits a second at
/// 20,000 events/s): sleeping out the rest of this spacing lets the appends
/// of that millisecond queue without waking it, and go as one commit. A
/// write waits at most this long more; a group that took longer than it
/// (a saturated store) is followed at once.
const GROUP_SPACING: std::time::Duration = std::time::Duration::from_millis(1);

impl Writer {
    pub(super) fn run(mut self) {
        let mut group: Vec<Command> = Vec::with_capacity(MAX_GROUP);
        loop {
            let first = match self.rx.try_recv() {
                Ok(cmd) => Some(cmd),
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {
                    // Idle: the moment for housekeeping that would otherwise
                    // delay a waiting append.
                    if self.restart_wanted.load(Ordering::Relaxed) {
                        self.restart_wal();
                    }
                    // With a prune pending (and no fold in progress, which
                    // it waits for) there is work to do even when nothing is
                    // queued, so only block when there is none; and only
                    // until the fold's next step, or the next fold, is due.
                    if !self.prunes.is_empty() && self.fold.is_none() {
                        None
                    } else if let Some(at) = self.next_fold_step_at() {
                        let wait = at.saturating_duration_since(Instant::now());
                        if wait.is_zero() {
                            self.fold_work();
                            continue;
                        }
                        match self.rx.recv_timeout(wait) {
                            Ok(cmd) => Some(cmd),
                            Err(RecvTimeoutError::Timeout) => {
                                self.fold_work();
                                continue;
                            }
                            Err(RecvTimeoutError::Disconnected) => break,
                        }
                    } else if self.wrote_since_release {
                        match self.rx.recv_timeout(QUIET_BEFORE_RELEASE) {
                            Ok(cmd) => Some(cmd),
                            Err(RecvTimeoutError::Timeout) => {
                                self.wrote_since_release = false;
                                let started = Instant::now();
                                connections::release_page_cache(&self.conn);
                                let released = crate::heap::release_freed();
                                tracing::debug!(
                                    released,
                                    took_us = started.elapsed().as_micros() as u64,
                                    "store: quiet after writes, the heaps gave their free pages back"
                                );
                                continue;
                            }
                            Err(RecvTimeoutError::Disconnected) => break,
                        }
                    } else {
                        match self.rx.recv() {
                            Ok(cmd) => Some(cmd),
                            Err(_) => break,
                        }
                    }
                }
            };
            if let Some(cmd) = first {
                self.take(*cmd, &mut group);
            }
            if let Some(last) = self.last_group_at {
                let wait = (last + GROUP_SPACING).saturating_duration_since(Instant::now());
                if !wait.is_zero() {
                    std::thread::sleep(wait);
                }
            }
            while group.len() < MAX_GROUP {
                match self.rx.try_recv() {
                    Ok(cmd) => self.take(*cmd, &mut group),
                    Err(_) => break,
                }
            }
            if group.is_empty() && (self.prunes.is_empty() || self.fold.is_some()) {
                // A prune waits for the fold in progress (see `run_group`).
                self.fold_work();
                continue;
            }
            self.last_group_at = Some(Instant::now());
            self.run_group(&mut group);
            self.wrote_since_release = true;
            self.fold_work();
            if self.restart_wanted.load(Ordering::Relaxed) {
                self.busy_groups += 1;
                if self.busy_groups >= RESTART_WITHIN_GROUPS {
                    self.restart_wal();
                }
            }
        }
        // Every sender is gone and the queue is empty; nobody is left to
        // await a pending prune, but answer anyway.
        for job in self.prunes.drain(..) {
            let _ = job.reply.send(Err(StoreError::Closed));
        }
        // Not needed for the data (opening folds what is left), but a store
        // closed cleanly reopens without the work.
        self.fold = None;
        if let Err(e) = journal::fold_now(&self.conn) {
            tracing::warn!(error = %e, "store: folding the journal at close failed");
        }
    }

    /// When the fold in progress may take its next step, or else when the
    /// next fold is due; `None`: no fold work until something is appended.
    fn next_fold_step_at(&self) -> Option<Instant> {
        match &self.fold {
            Some(_) if self.journal.is_behind() => Some(Instant::now()),
            Some(fold) => Some(fold.resume_at()),
            None => self.journal.due_at(),
        }
    }

    /// The fold's next step if one is in progress and its pace allows it
    /// (see [`journal::FOLD_REST_PER_BUSY`]), else a new fold if the journal
    /// is due (see `journal.rs`).
    pub(super) fn fold_work(&mut self) {
        if self
            .next_fold_step_at()
            .is_none_or(|at| at > Instant::now())
        {
            return;
        }
        let fold = match self.fold.take() {
            Some(fold) => Ok(fold),
            None => {
                self.journal.fold_started();
                match Fold::start(&self.conn, self.fold_left_overlap) {
                    Ok(Some(fold)) => Ok(fold),
                    Ok(None) => {
                        self.journal.fold_finished();
                        self.members.narrow_to(self.journal.written());
                        return;
                    }
                    Err(e) => Err(e),
                }
            }
        };
        let done = fold.and_then(|mut fold| fold.step(&self.conn).map(|done| (fold, done)));
        match done {
            Ok((fold, true)) => {
                self.fold_left_overlap = false;
                self.journal.fold_finished();
                self.members.narrow_to(self.journal.written());
                crate::metrics::store_fold(fold.busy, fold.events);
                self.wrote_since_release = true;
            }
            Ok((fold, false)) => self.fold = Some(fold),
            Err(e) => {
                // A fold that fails for want of space is an outage like an
                // append's. What it moved stays in the journal as well, and
                // the next fold, after the usual delay, skips it.
                if e.is_unavailable() {
                    self.health.record(Err(&e));
                }
                tracing::error!(error = %e, "store: folding the journal failed");
                self.fold_left_overlap = true;
                self.journal.fold_failed(Instant::now());
            }
        }
    }

    pub(super) fn take(&mut self, cmd: Command, group: &mut Vec<Command>) {
        match cmd {
            // Prunes do not join the group: they run as chunks, one per
            // transaction, alongside whatever else is queued.
            Command::Prune { cutoff, reply } => self.prunes.push_back(PruneJob {
                cutoff,
                cursor: 0,
                deleted: 0,
                journal_folded: false,
                reply,
            }),
            #[cfg(test)]
            Command::Hold { until } => {
                let _ = until.recv();
            }
            cmd => group.push(cmd),
        }
    }

    /// Runs one group in one transaction and then answers every command in
    /// it. Fast path: no savepoints. If any command fails, the transaction is
    /// rolled back and replayed with a savepoint per command, so that one bad
    /// append fails alone.
    pub(super) fn run_group(&mut self, group: &mut Vec<Command>) {
        // Not while a fold is in progress: the runs it has copied are in
        // the journal too, and a prune must not delete one copy only.
        let prune_cutoff = self
            .prunes
            .front()
            .filter(|_| self.fold.is_none())
            .map(|j| (j.cutoff.clone(), j.cursor));
        let mut results: Vec<Result<Done, StoreError>> = Vec::with_capacity(group.len());
        let mut pruned: Option<Result<PruneStep, StoreError>> = None;
        let started = std::time::Instant::now();

        let outcome = self.transaction(
            group,
            prune_cutoff.as_ref(),
            false,
            &mut results,
            &mut pruned,
        );
        let outcome = match outcome {
            Ok(true) => Ok(()),
            Ok(false) => {
                results.clear();
                pruned = None;
                self.transaction(
                    group,
                    prune_cutoff.as_ref(),
                    true,
                    &mut results,
                    &mut pruned,
                )
                .map(|_| ())
            }
            Err(e) => Err(e),
        };

        // A command that failed alone because the disk is full (SQLite
        // may undo just that statement) is an outage too, not a bad request.
        let unavailable = results
            .iter()
            .find_map(|r| r.as_ref().err().filter(|e| e.is_unavailable()));
        match (&outcome, unavailable) {
            (Err(e), _) | (Ok(()), Some(e)) => self.health.record(Err(e)),
            (Ok(()), None) => self.health.record(Ok(())),
        }
        match outcome {
            Ok(()) => {
                self.commits.fetch_add(1, Ordering::Relaxed);
                crate::metrics::store_commit(started.elapsed(), group.len());
                self.answers.send(group.drain(..).zip(results).collect());
                if let Some(result) = pruned {
                    self.prune_progress(result);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, commands = group.len(), "store: commit failed");
                self.answers
                    .send(group.drain(..).map(|cmd| (cmd, Err(e.clone()))).collect());
                if prune_cutoff.is_some() {
                    self.prune_progress(Err(e));
                }
            }
        }
    }

    /// One attempt at the group's transaction. `Ok(false)`: some command
    /// failed on the fast path and the transaction was rolled back.
    pub(super) fn transaction(
        &mut self,
        group: &[Command],
        prune_cutoff: Option<&(String, i64)>,
        savepoints: bool,
        results: &mut Vec<Result<Done, StoreError>>,
        pruned: &mut Option<Result<PruneStep, StoreError>>,
    ) -> Result<bool, StoreError> {
        let conn = &self.conn;
        let mut touched = Touched::new(&self.known, &self.journal, group.len());
        // `?` below: the transaction is lost, every command of the group fails.
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        for cmd in group {
            let result = if savepoints {
                isolated(conn, |conn| apply(conn, cmd, &mut touched))
                    .inspect_err(|_| rollback(conn))?
            } else {
                apply(conn, cmd, &mut touched)
            };
            if result.is_err() && !savepoints {
                rollback(conn);
                return Ok(false);
            }
            results.push(result);
        }
        // The group's runs and rows first, so that a prune sees them.
        let journaled =
            match touched.write(conn, &self.journal, &self.members, &mut self.journal_row) {
                Ok(journaled) => journaled,
                Err(e) => {
                    rollback(conn);
                    return if savepoints { Err(e) } else { Ok(false) };
                }
            };
        if let Some((cutoff, cursor)) = prune_cutoff {
            let result = if savepoints {
                isolated(conn, |conn| prune_chunk(conn, cutoff, *cursor))
                    .inspect_err(|_| rollback(conn))?
            } else {
                prune_chunk(conn, cutoff, *cursor)
            };
            if result.is_err() && !savepoints {
                rollback(conn);
                return Ok(false);
            }
            *pruned = Some(result);
        }
        let committed = conn
            .prepare_cached("COMMIT")
            .and_then(|mut commit| commit.execute([]))
            .map_err(StoreError::from);
        if let Err(e) = committed {
            rollback(conn);
            return if savepoints { Err(e) } else { Ok(false) };
        }
        let settled: Vec<Settled> = touched.settled().collect();
        let deleted = std::mem::take(&mut touched.deleted);
        for id in &deleted {
            self.journal.forget(id);
            if let Some(fold) = &mut self.fold {
                fold.forget(id);
            }
        }
        self.known.settle(deleted, settled);
        let now = Instant::now();
        for Journaled { id, events, bytes } in journaled {
            self.journal.added(id, events, bytes, now);
        }
        Ok(true)
    }

    /// The checkpointer copies the WAL into the database in the background,
    /// but SQLite only starts the WAL over from its beginning when a write
    /// transaction begins with every frame copied, which never happens while
    /// appends keep coming. So once the WAL is large, the writer copies the
    /// few frames left itself (two short fsyncs) at an idle moment, and its
    /// next transaction restarts the WAL.
    pub(super) fn restart_wal(&mut self) {
        self.restart_wanted.store(false, Ordering::Relaxed);
        self.busy_groups = 0;
        let started = std::time::Instant::now();
        if let Err(e) = checkpoint(&self.conn) {
            tracing::warn!(error = %e, "store: checkpoint failed");
        }
        crate::metrics::store_wal_restart(started.elapsed());
    }

    pub(super) fn prune_progress(&mut self, result: Result<PruneStep, StoreError>) {
        let Some(job) = self.prunes.front_mut() else {
            return;
        };
        match result {
            Ok(step) => {
                job.deleted += step.deleted;
                job.cursor = step.cursor;
                if step.scanned < PRUNE_CHUNK {
                    if !job.journal_folded {
                        // The journal's events may be older than the cutoff
                        // too: fold them into runs, and go on scanning from
                        // before the runs the fold adds (a run deleted at the
                        // end can give its rowid to a new one).
                        job.journal_folded = true;
                        // (No fold is in progress: prunes wait for it.)
                        let scanned_upto = max_run_rowid(&self.conn);
                        match journal::fold_now(&self.conn) {
                            Ok(_) => {
                                self.journal.all_folded();
                                self.members.narrow_to([]);
                                self.fold_left_overlap = false;
                                if let Ok(upto) = scanned_upto {
                                    job.cursor = job.cursor.min(upto);
                                }
                                return;
                            }
                            Err(e) => {
                                self.fold_left_overlap = true;
                                self.journal.fold_failed(Instant::now());
                                tracing::warn!(error = %e, "store: folding the journal for a prune failed");
                            }
                        }
                    }
                    if let Some(job) = self.prunes.pop_front() {
                        let _ = job.reply.send(Ok(job.deleted));
                    }
                }
            }
            Err(e) => {
                if let Some(job) = self.prunes.pop_front() {
                    let _ = job.reply.send(Err(e));
                }
            }
        }
    }
}

pub(super) fn rollback(conn: &Connection) {
    if !conn.is_autocommit() {
        if let Err(e) = conn.execute_batch("ROLLBACK") {
            tracing::error!(error = %e, "store: rollback failed");
        }
    }
}

/// Runs `f` inside a savepoint, undoing its partial work if it fails. The
/// outer error means the whole transaction is lost: some errors (I/O, disk
/// full) make SQLite roll it all back, and the commands after this one must
/// not then run, each committing on its own.
pub(super) fn isolated<T>(
    conn: &Connection,
    f: impl FnOnce(&Connection) -> Result<T, StoreError>,
) -> Result<Result<T, StoreError>, StoreError> {
    conn.prepare_cached("SAVEPOINT cmd")?.execute([])?;
    let result = f(conn);
    if conn.is_autocommit() {
        return Err(match result {
            Err(e) => e,
            Ok(_) => StoreError::Backend("the transaction was rolled back".into()),
        });
    }
    if result.is_err() {
        conn.prepare_cached("ROLLBACK TO cmd")?.execute([])?;
    }
    conn.prepare_cached("RELEASE cmd")?.execute([])?;
    Ok(result)
}

/// The conversations a group has appended to, with what the group writes
/// for each at its end: one run of the events of all its appends (not a row
/// per event, nor per append: under a burst most of a group's appends are
/// to the same few conversations), and the conversations row only when a
/// field only the row records changed (the head and the last activity the
/// runs carry, see [`META_SELECT`]).
pub(super) struct Touched<'g, 'k> {
    pub(super) rows: HashMap<&'g Arc<str>, TouchedRow<'g, 'k>>,
    /// Conversations the group deleted.
    pub(super) deleted: Vec<&'g str>,
    known: &'k KnownRows,
    journal: &'k JournalFill,
}

/// A conversation's events a group wrote into the journal: how many, and
/// their encoded bytes.
pub(super) struct Journaled<'g> {
    id: &'g Arc<str>,
    events: usize,
    bytes: usize,
}

pub(super) struct TouchedRow<'g, 'k> {
    /// The head as of this point of the transaction.
    pub(super) head: u64,
    /// The row's fields as stored before this group.
    pub(super) stored: Cow<'k, RowFields>,
    /// The last append, whose state is written to the row if needed.
    pub(super) pending: Option<&'g AppendBatch>,
    /// An append without events: only the row can record its state.
    pub(super) row_needed: bool,
    /// This group's events, in seq order, for the runs. Paced traffic
    /// brings one or two per conversation and group: held inline, not in
    /// an allocation of their own.
    pub(super) events: SmallVec<[&'g EventRecord; 4]>,
}

impl<'g> TouchedRow<'g, '_> {
    /// The state the row must be updated to, if it must.
    fn row_update(&self) -> Option<&'g AppendBatch> {
        self.pending
            .filter(|batch| self.row_needed || !self.stored.matches(&batch.state))
    }
}

impl<'g, 'k> Touched<'g, 'k> {
    /// For a group of `commands`.
    pub(super) fn new(known: &'k KnownRows, journal: &'k JournalFill, commands: usize) -> Self {
        Touched {
            rows: HashMap::with_capacity(commands),
            deleted: Vec::new(),
            known,
            journal,
        }
    }

    /// The head stored for `id` as of this point of the transaction: what
    /// the writer remembers, or else read from the row (and its newest
    /// run) on the first touch.
    pub(super) fn head(&mut self, conn: &Connection, id: &'g Arc<str>) -> Result<u64, StoreError> {
        if let Some(row) = self.rows.get(id) {
            return Ok(row.head);
        }
        let (head, stored) = match self.known.get(id) {
            Some(known) => (known.head, Cow::Borrowed(&known.fields)),
            None => {
                let (head, stored) = read_row(conn, id, self.journal.holds(id))?;
                (head, Cow::Owned(stored))
            }
        };
        self.rows.insert(
            id,
            TouchedRow {
                head,
                stored,
                pending: None,
                row_needed: false,
                events: SmallVec::new(),
            },
        );
        Ok(head)
    }

    /// How each conversation stands once the group is committed, for the
    /// writer's memory.
    pub(super) fn settled(&self) -> impl Iterator<Item = Settled<'g>> + '_ {
        self.rows.iter().map(|(id, row)| Settled {
            id,
            head: row.head,
            fields: match (row.row_update(), &row.stored) {
                (Some(batch), _) => Some(RowFields::of(&batch.state)),
                (None, Cow::Owned(fields)) => Some(fields.clone()),
                (None, Cow::Borrowed(_)) => None,
            },
        })
    }

    /// Writes the group's runs and rows (the journal's row built in
    /// `journal_row`, left empty); returns the conversations whose events
    /// went into the journal, with how many and their encoded bytes.
    pub(super) fn write(
        &self,
        conn: &Connection,
        journal: &JournalFill,
        members: &JournalMembers,
        journal_row: &mut JournalRow,
    ) -> Result<Vec<Journaled<'g>>, StoreError> {
        journal_row.clear();
        let mut journaled = Vec::new();
        for (id, row) in &self.rows {
            let table = journal.table_for(id, row.events.len());
            if table == RunTable::Journal && !row.events.is_empty() {
                // Before the rows are committed: a reader must never see
                // them while the conversation is not marked.
                if !journal.holds(id) {
                    members.mark(id);
                }
            }
            let bytes_before = journal_row.event_bytes();
            for chunk in row.events.chunks(RUN_MAX_EVENTS) {
                let events = chunk.iter().map(|ev| RunEvent::from(*ev));
                match table {
                    RunTable::Journal => journal_row.add(id, events)?,
                    RunTable::Runs => insert_run(conn, table, id, events)?,
                }
            }
            if table == RunTable::Journal && !row.events.is_empty() {
                let bytes = journal_row.event_bytes() - bytes_before;
                journaled.push(Journaled {
                    id,
                    events: row.events.len(),
                    bytes,
                });
            }
            if let Some(batch) = row.row_update() {
                let state = &batch.state;
                conn.prepare_cached(
                    "UPDATE conversations SET status = ?2, head_seq = ?3, last_activity_at = ?4, \
                     current_turn_id = ?5, last_turn_message_seq = ?6 WHERE id = ?1",
                )?
                .execute(params![
                    id,
                    state.status.as_str(),
                    clamp_i64(state.head_seq),
                    batch.last_activity_at(),
                    state.current_turn_id.as_deref(),
                    clamp_i64(state.last_turn_message_seq),
                ])?;
            }
        }
        journal_row.insert(conn)?;
        Ok(journaled)
    }
}

/// A conversation's stored head (its row's, or its newest run's when
/// newer, in the journal or in `event_runs`) and the fields only its row
/// records.
/// `journal`: whether the journal may hold rows of it (else its scan is
/// left out).
fn read_row(conn: &Connection, id: &str, journal: bool) -> Result<(u64, RowFields), StoreError> {
    fn head_and_fields(row: &rusqlite::Row<'_>) -> rusqlite::Result<(u64, RowFields)> {
        Ok((
            row.get::<_, u64>(0)?,
            RowFields {
                status: Status::parse(&row.get::<_, String>(1)?),
                current_turn_id: row.get::<_, Option<String>>(2)?.map(Arc::from),
                last_turn_message_seq: row.get(3)?,
            },
        ))
    }
    let (head, fields) = conn
        .prepare_cached(
            "SELECT max(head_seq, coalesce((SELECT max(last_seq) FROM event_runs \
             WHERE conversation_id = ?1), 0)), status, current_turn_id, \
             last_turn_message_seq FROM conversations WHERE id = ?1",
        )?
        .query_row([id], head_and_fields)
        .optional()?
        .ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
    let newest = if journal {
        super::journal::runs_of(conn, id, head, false)?.pop()
    } else {
        None
    };
    Ok((newest.map_or(head, |run| run.last_seq), fields))
}

// `touched` is only changed once a command has fully succeeded, so that a
// command rolled back to its savepoint leaves it as it was.
pub(super) fn apply<'a>(
    conn: &Connection,
    cmd: &'a Command,
    touched: &mut Touched<'a, '_>,
) -> Result<Done, StoreError> {
    match cmd {
        Command::Append { batch, .. } => append(conn, batch, touched).map(|()| Done::Unit),
        Command::Delete { id, .. } => {
            let existed = delete(conn, id)?;
            // Keyed by the appends' ids, which a delete does not have: it
            // is rare enough to look through the group's few.
            touched
                .rows
                .retain(|touched_id, _| touched_id.as_ref() != id.as_str());
            touched.deleted.push(id);
            Ok(Done::Existed(existed))
        }
        Command::AddObserver { id, user, .. } => add_observer(conn, id, user).map(|()| Done::Unit),
        Command::Flush { .. } => Ok(Done::Unit),
        Command::Probe { .. } => {
            conn.prepare_cached(
                "CREATE TABLE IF NOT EXISTS health_probe (id INTEGER PRIMARY KEY, at TEXT NOT NULL)",
            )?
            .execute([])?;
            conn.prepare_cached("INSERT OR REPLACE INTO health_probe (id, at) VALUES (1, ?1)")?
                .execute([crate::event::now_rfc3339()])?;
            Ok(Done::Unit)
        }
        // Never in a group (see `Writer::take`).
        Command::Prune { .. } => Ok(Done::Unit),
        #[cfg(test)]
        Command::Hold { .. } => Ok(Done::Unit),
    }
}

pub(super) fn append<'a>(
    conn: &Connection,
    batch: &'a AppendBatch,
    touched: &mut Touched<'a, '_>,
) -> Result<(), StoreError> {
    let id = &batch.conversation_id;
    let state = &batch.state;
    let base = check_contiguous(batch)?;
    match &batch.create {
        Some(new) => {
            let close_delay_ms = new
                .close_delay
                .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            conn.prepare_cached(
                "INSERT INTO conversations (id, user, title, status, created_at, \
                 last_activity_at, head_seq, close_delay_ms, observers, current_turn_id, \
                 last_turn_message_seq) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, '[]', ?9, ?10)",
            )?
            .execute(params![
                id,
                new.user,
                new.title,
                state.status.as_str(),
                new.created_at,
                batch.last_activity_at(),
                clamp_i64(state.head_seq),
                close_delay_ms,
                state.current_turn_id.as_deref(),
                clamp_i64(state.last_turn_message_seq),
            ])?;
        }
        None => {
            // Refuse a batch that would leave a gap in the history or
            // overlap what is stored.
            let head = touched.head(conn, id)?;
            if head != base {
                return Err(StoreError::Backend(format!(
                    "conversation {id}: stored head_seq is {head}, the append follows {base}"
                )));
            }
        }
    }
    if batch.forget_client_msg_ids_before > 0 {
        // Those before the window, found by the (conversation_id, seq)
        // index; this also drops what a store written before the window
        // existed held beyond it. First, so that an id that left the
        // window and comes back is recorded anew.
        conn.prepare_cached("DELETE FROM client_msgs WHERE conversation_id = ?1 AND seq < ?2")?
            .execute(params![id, clamp_i64(batch.forget_client_msg_ids_before)])?;
    }
    if !batch.client_msg_ids.is_empty() {
        // An id the conversation no longer remembers may still be stored
        // (kept by a store written before the window existed): the new
        // message takes its place.
        let mut stmt = conn.prepare_cached(
            "INSERT OR REPLACE INTO client_msgs (conversation_id, client_msg_id, seq) \
             VALUES (?1, ?2, ?3)",
        )?;
        for (client_msg_id, seq) in &batch.client_msg_ids {
            stmt.execute(params![id, client_msg_id, clamp_i64(*seq)])?;
        }
    }
    let row = touched.rows.entry(id).or_insert_with(|| TouchedRow {
        // Created by this batch: the insert wrote its row.
        head: 0,
        stored: Cow::Owned(RowFields::of(state)),
        pending: None,
        row_needed: false,
        events: SmallVec::new(),
    });
    row.head = state.head_seq;
    if batch.create.is_none() {
        row.pending = Some(batch);
        row.row_needed |= batch.events.is_empty();
    }
    row.events.extend(batch.events.iter().map(|ev| &**ev));
    Ok(())
}

/// Checks that the batch's events are `base+1 ..= state.head_seq` and
/// returns `base`, the head the store must hold before this batch.
pub(super) fn check_contiguous(batch: &AppendBatch) -> Result<u64, StoreError> {
    let id = &batch.conversation_id;
    let n = batch.events.len() as u64;
    let head = batch.state.head_seq;
    let bad = |why: String| StoreError::Backend(format!("conversation {id}: bad append: {why}"));
    let Some(base) = head.checked_sub(n) else {
        return Err(bad(format!("{n} events but head_seq {head}")));
    };
    for (i, ev) in batch.events.iter().enumerate() {
        let want = base + 1 + i as u64;
        if ev.seq != want {
            return Err(bad(format!(
                "event seq {} where {want} was expected (head_seq {head})",
                ev.seq
            )));
        }
    }
    if batch.create.is_some() && base != 0 {
        return Err(bad(format!(
            "a new conversation starts at seq 1, not {}",
            base + 1
        )));
    }
    Ok(base)
}

pub(super) fn delete(conn: &Connection, id: &str) -> Result<bool, StoreError> {
    conn.prepare_cached("DELETE FROM event_runs WHERE conversation_id = ?1")?
        .execute([id])?;
    super::journal::delete_runs_of(conn, id)?;
    conn.prepare_cached("DELETE FROM client_msgs WHERE conversation_id = ?1")?
        .execute([id])?;
    let rows = conn
        .prepare_cached("DELETE FROM conversations WHERE id = ?1")?
        .execute([id])?;
    Ok(rows > 0)
}

pub(super) fn add_observer(conn: &Connection, id: &str, user: &str) -> Result<(), StoreError> {
    let observers: Option<String> = conn
        .prepare_cached("SELECT observers FROM conversations WHERE id = ?1")?
        .query_row([id], |row| row.get(0))
        .optional()?;
    let Some(observers) = observers else {
        return Err(StoreError::NotFound(id.to_owned()));
    };
    let mut observers = parse_observers(id, &observers)?;
    if observers.iter().any(|o| o == user) {
        return Ok(());
    }
    observers.push(user.to_owned());
    let json = serde_json::to_string(&observers)
        .map_err(|e| StoreError::Backend(format!("conversation {id}: observers: {e}")))?;
    conn.prepare_cached("UPDATE conversations SET observers = ?2 WHERE id = ?1")?
        .execute(params![id, json])?;
    Ok(())
}

/// The highest rowid of `event_runs` (0 for none).
fn max_run_rowid(conn: &Connection) -> Result<i64, StoreError> {
    Ok(conn
        .prepare_cached("SELECT coalesce(max(rowid), 0) FROM event_runs")?
        .query_row([], |row| row.get(0))?)
}

/// What one prune step did.
pub(super) struct PruneStep {
    /// Events deleted.
    pub(super) deleted: u64,
    /// Runs looked at: fewer than [`PRUNE_CHUNK`] means the end was reached.
    pub(super) scanned: i64,
    /// The last run looked at (rowid), where the next step starts.
    pub(super) cursor: i64,
}

/// Looks at the next [`PRUNE_CHUNK`] runs after `cursor` (in rowid order,
/// roughly the order they were written in: no index on time is kept) and
/// deletes their events older than `cutoff`: a whole run when all its events
/// are, else the run is rewritten without them.
pub(super) fn prune_chunk(
    conn: &Connection,
    cutoff: &str,
    cursor: i64,
) -> Result<PruneStep, StoreError> {
    struct Seen {
        rowid: i64,
        id: String,
        last_seq: u64,
        n: u64,
        min_ts: String,
        max_ts: String,
    }
    let seen = conn
        .prepare_cached(
            "SELECT rowid, conversation_id, last_seq, n, min_ts, max_ts FROM event_runs \
             WHERE rowid > ?1 ORDER BY rowid LIMIT ?2",
        )?
        .query_map(params![cursor, PRUNE_CHUNK], |row| {
            Ok(Seen {
                rowid: row.get(0)?,
                id: row.get(1)?,
                last_seq: row.get(2)?,
                n: row.get(3)?,
                min_ts: row.get(4)?,
                max_ts: row.get(5)?,
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    let mut step = PruneStep {
        deleted: 0,
        scanned: seen.len() as i64,
        cursor: seen.last().map_or(cursor, |run| run.rowid),
    };
    for run in seen.iter().filter(|run| run.min_ts.as_str() < cutoff) {
        if run.max_ts.as_str() < cutoff {
            // The row's head may be older than this run's (see
            // `META_SELECT`): it keeps the head, and its time, once the run
            // that held them is gone, so that a seq is never used twice.
            conn.prepare_cached(
                "UPDATE conversations SET head_seq = ?2, last_activity_at = ?3 \
                 WHERE id = ?1 AND head_seq < ?2",
            )?
            .execute(params![run.id, clamp_i64(run.last_seq), run.max_ts])?;
            conn.prepare_cached("DELETE FROM event_runs WHERE rowid = ?1")?
                .execute([run.rowid])?;
            step.deleted += run.n;
            continue;
        }
        let json: String = conn
            .prepare_cached("SELECT events FROM event_runs WHERE rowid = ?1")?
            .query_row([run.rowid], |row| row.get(0))?;
        let events = decode(&run.id, &json)?;
        let kept: Vec<RunEvent<'_>> = events
            .iter()
            .filter(|ev| ev.ts() >= cutoff)
            .map(|ev| RunEvent {
                seq: ev.seq(),
                ts: ev.ts(),
                kind: ev.kind(),
                data: ev.data(),
            })
            .collect();
        step.deleted += (events.len() - kept.len()) as u64;
        // Not empty (its max_ts is not older than the cutoff). Its last seq
        // stays, as the newest event is kept, so its index entry holds.
        if let Some(left) = encode(kept) {
            conn.prepare_cached(
                "UPDATE event_runs SET first_seq = ?2, n = ?3, min_ts = ?4, events = ?5 \
                 WHERE rowid = ?1",
            )?
            .execute(params![
                run.rowid,
                clamp_i64(left.first_seq),
                left.n as i64,
                left.min_ts,
                left.json,
            ])?;
        }
    }
    Ok(step)
}
