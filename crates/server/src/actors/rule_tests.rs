//! The supervisor's and the conversation's timer rules (idle close, detach
//! grace, turn timeout, protocol §6) under tokio's paused clock: the real
//! actors, the demo agent and an in-memory store, with an in-process
//! "socket" (a connection fed frames by a task, its outbound queue read
//! back).
//! Nothing here waits on a wall clock, so a busy machine cannot make these
//! fail; the margins asserted are the protocol's, in virtual time.

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::connection::{Connection, ConnectionArgs};
use super::outbound::{self, OutboundReceiver};
use super::supervision_log::SupervisionLog;
use super::supervisor::{Supervisor, SupervisorArgs, SupervisorMsg};
use crate::agent::demo::DemoAgent;
use crate::config::{Config, ConfigOwner, LiveConfig};
use crate::reload::{ConfigSource, Reloader, Trigger};
use crate::store::memory::MemoryStore;
use crate::store::Store;

struct Node {
    supervisor: ActorRef<SupervisorMsg>,
    store: Arc<MemoryStore>,
    config: LiveConfig,
    reloader: Reloader,
    decisions: Arc<SupervisionLog>,
    _dir: tempfile::TempDir,
}

async fn node(tweak: impl FnOnce(&mut Config)) -> Node {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = Config::default();
    config.store.path = dir.path().to_path_buf();
    tweak(&mut config);
    let owner = ConfigOwner::new(config);
    let config = owner.subscribe();
    let store = Arc::new(MemoryStore::default());
    let decisions = Arc::new(SupervisionLog::default());
    let (supervisor, _) = Actor::spawn(
        None,
        Supervisor,
        SupervisorArgs {
            config: config.clone(),
            decisions: decisions.clone(),
            store: store.clone() as Arc<dyn Store>,
            agent: Arc::new(DemoAgent),
            cluster: None,
        },
    )
    .await
    .expect("supervisor");
    let reloader = Reloader::new(
        ConfigSource::Given,
        owner,
        supervisor.clone(),
        decisions.clone(),
        None,
    );
    Node {
        supervisor,
        store,
        config,
        reloader,
        decisions,
        _dir: dir,
    }
}

/// A connection without a socket: a task hands it the frames sent, one at
/// a time as the socket's task does; what the client would read comes out
/// of the outbound queue.
struct Socket {
    frames: mpsc::UnboundedSender<String>,
    out: OutboundReceiver,
}

impl Socket {
    async fn open(node: &Node, id: u64, user: &str) -> Socket {
        let (outbound, out) = outbound::channel(1000, Duration::from_secs(30));
        let mut connection = Connection::open(ConnectionArgs {
            id,
            user: Arc::from(user),
            outbound,
            supervisor: node.supervisor.clone(),
            config: node.config.clone(),
        });
        let (frames, mut incoming) = mpsc::unbounded_channel::<String>();
        tokio::spawn(async move {
            while let Some(text) = incoming.recv().await {
                connection.text(&text).await;
            }
        });
        Socket { frames, out }
    }

    fn send(&self, frame: Value) {
        self.frames
            .send(frame.to_string())
            .expect("the connection's task lives");
    }

    async fn recv(&mut self) -> Value {
        let frame = self.out.rx.recv().await.expect("connection open");
        serde_json::from_str(frame.as_str()).expect("JSON frame")
    }

    async fn recv_until(&mut self, pred: impl Fn(&Value) -> bool) -> Value {
        loop {
            let frame = self.recv().await;
            if pred(&frame) {
                return frame;
            }
        }
    }

    /// The socket goes away: the connection detaches everywhere.
    fn close(self) {
        drop(self.frames);
    }
}

fn event_of(kind: &'static str) -> impl Fn(&Value) -> bool {
    move |f| f["type"] == "event" && f["kind"] == kind
}

/// Waits (in virtual time) until the stored history of `id` has an event
/// of `kind`; returns it.
async fn stored(node: &Node, id: &str, kind: &str) -> Value {
    let mut appends = node.store.appends();
    loop {
        let events = node.store.events(id, 0, usize::MAX).await.expect("events");
        if let Some(e) = events.iter().find(|e| &*e.kind == kind) {
            return serde_json::from_str(e.frame.as_str()).expect("JSON");
        }
        appends.changed().await.expect("the store lives");
    }
}

/// Creates a conversation as `user` over the socket; returns its id.
async fn create(socket: &mut Socket) -> String {
    socket.send(json!({"type": "create", "req": 1}));
    let created = socket.recv_until(|f| f["type"] == "created").await;
    created["conversation_id"].as_str().expect("id").to_owned()
}

/// A conversation of alice's running an eight-hour turn, attached.
async fn long_turn(node: &Node) -> (Socket, String) {
    let mut socket = Socket::open(node, 1, "alice").await;
    let id = create(&mut socket).await;
    socket.send(json!({"type": "message", "conversation_id": id, "text": "/sleep 8h"}));
    socket.recv_until(event_of("turn_started")).await;
    (socket, id)
}

/// A rule that acts `after` its condition began acted at its `limit`,
/// give or take the second a timer may take.
fn assert_on_time(after: Duration, limit: Duration) {
    assert!(
        after >= limit && after <= limit + Duration::from_secs(1),
        "acted after {after:?}, for a limit of {limit:?}"
    );
}

/// §6 margin: close_delay plus the larger of one second and a tenth.
fn margin(delay: Duration) -> Duration {
    delay + (delay / 10).max(Duration::from_secs(1))
}

#[tokio::test(start_paused = true)]
async fn idle_close_fires_after_close_delay_within_the_margin() {
    let delay = Duration::from_secs(15 * 60);
    let node = node(|c| c.conversations.close_delay = delay).await;
    let mut socket = Socket::open(&node, 1, "alice").await;
    let id = create(&mut socket).await;
    socket.send(json!({"type": "message", "conversation_id": id, "text": "hello"}));
    socket.recv_until(event_of("turn_finished")).await;
    socket.close();
    let quiet_from = Instant::now();
    let stopped = stored(&node, &id, "agent_stopped").await;
    let quiet = quiet_from.elapsed();
    assert_eq!(stopped["data"]["reason"], "idle", "{stopped}");
    assert!(quiet >= delay, "closed after {quiet:?}");
    assert!(quiet <= margin(delay), "closed after {quiet:?}");
}

#[tokio::test(start_paused = true)]
async fn an_attached_or_running_conversation_is_never_idle_closed() {
    let delay = Duration::from_secs(60);
    let node = node(|c| {
        c.conversations.close_delay = delay;
        c.conversations.detach_grace = Duration::from_secs(3600);
    })
    .await;
    let mut socket = Socket::open(&node, 1, "alice").await;
    let id = create(&mut socket).await;
    // Attached and idle for ten close delays: still active.
    tokio::time::sleep(delay * 10).await;
    socket.send(json!({"type": "message", "conversation_id": id, "text": "/sleep 20m", "req": 2}));
    socket.recv_until(event_of("turn_started")).await;
    // Running with nobody attached, past close_delay: still running.
    socket.close();
    tokio::time::sleep(delay * 10).await;
    let events = node.store.events(&id, 0, usize::MAX).await.unwrap();
    assert!(
        !events.iter().any(|e| &*e.kind == "agent_stopped"),
        "stopped while attached or running"
    );
    // Once the turn is over, the idle rule applies.
    let finished = stored(&node, &id, "turn_finished").await;
    assert_eq!(finished["data"]["status"], "completed", "{finished}");
    let idle_from = Instant::now();
    let stopped = stored(&node, &id, "agent_stopped").await;
    assert_eq!(stopped["data"]["reason"], "idle");
    assert!(idle_from.elapsed() <= margin(delay));
}

#[tokio::test(start_paused = true)]
async fn a_detached_turn_is_abandoned_after_detach_grace() {
    let grace = Duration::from_secs(10 * 60);
    let node = node(|c| c.conversations.detach_grace = grace).await;
    let (socket, id) = long_turn(&node).await;
    socket.close();
    let detached_at = Instant::now();
    let finished = stored(&node, &id, "turn_finished").await;
    let after = detached_at.elapsed();
    assert_eq!(finished["data"]["status"], "abandoned", "{finished}");
    assert_on_time(after, grace);
}

#[tokio::test(start_paused = true)]
async fn a_turn_past_its_timeout_fails_saying_so() {
    let timeout = Duration::from_secs(30 * 60);
    let node = node(|c| c.agent.turn_timeout = timeout).await;
    let (mut socket, id) = long_turn(&node).await;
    let started = Instant::now();
    let finished = socket.recv_until(event_of("turn_finished")).await;
    let after = started.elapsed();
    assert_eq!(finished["data"]["status"], "failed", "{finished}");
    assert!(
        finished["data"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("agent.turn_timeout")),
        "{finished}"
    );
    assert_on_time(after, timeout);
    let _ = id;
}

/// Changes the running configuration as a reload does.
async fn reload(node: &Node, tweak: impl FnOnce(&mut Config)) {
    let mut config = (*node.config.get()).clone();
    tweak(&mut config);
    let outcome = node
        .reloader
        .apply(config, Trigger::Signal)
        .await
        .expect("a valid configuration");
    assert!(outcome.refused.is_empty(), "{outcome:?}");
}

fn has_event(events: &[Arc<crate::event::EventRecord>], kind: &str) -> bool {
    events.iter().any(|e| &*e.kind == kind)
}

#[tokio::test(start_paused = true)]
async fn a_shorter_close_delay_rearms_the_idle_timer() {
    let node = node(|c| c.conversations.close_delay = Duration::from_secs(15 * 60)).await;
    let mut socket = Socket::open(&node, 1, "alice").await;
    let id = create(&mut socket).await;
    socket.close();
    let quiet_from = Instant::now();
    tokio::time::sleep(Duration::from_secs(120)).await;
    let delay = Duration::from_secs(5 * 60);
    reload(&node, |c| c.conversations.close_delay = delay).await;
    let stopped = stored(&node, &id, "agent_stopped").await;
    let quiet = quiet_from.elapsed();
    assert_eq!(stopped["data"]["reason"], "idle", "{stopped}");
    assert!(
        quiet >= delay && quiet <= margin(delay),
        "closed after {quiet:?}"
    );
    let rules: Vec<&str> = node
        .decisions
        .since(0, 100)
        .decisions
        .iter()
        .map(|d| d.rule)
        .collect();
    assert_eq!(rules, ["config_reload", "idle_close"]);
}

#[tokio::test(start_paused = true)]
async fn a_longer_close_delay_defers_an_armed_idle_close() {
    let node = node(|c| c.conversations.close_delay = Duration::from_secs(60)).await;
    let mut socket = Socket::open(&node, 1, "alice").await;
    let id = create(&mut socket).await;
    socket.close();
    let quiet_from = Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let delay = Duration::from_secs(10 * 60);
    reload(&node, |c| c.conversations.close_delay = delay).await;
    // Past the old delay: still active.
    tokio::time::sleep(Duration::from_secs(5 * 60)).await;
    let events = node.store.events(&id, 0, usize::MAX).await.unwrap();
    assert!(
        !has_event(&events, "agent_stopped"),
        "closed by the old delay"
    );
    let stopped = stored(&node, &id, "agent_stopped").await;
    assert_eq!(stopped["data"]["reason"], "idle", "{stopped}");
    let quiet = quiet_from.elapsed();
    assert!(
        quiet >= delay && quiet <= margin(delay),
        "closed after {quiet:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_new_detach_grace_counts_from_the_detach() {
    let node = node(|c| c.conversations.detach_grace = Duration::from_secs(10 * 60)).await;
    let (socket, id) = long_turn(&node).await;
    socket.close();
    let detached_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let grace = Duration::from_secs(3 * 60);
    reload(&node, |c| c.conversations.detach_grace = grace).await;
    let finished = stored(&node, &id, "turn_finished").await;
    let after = detached_at.elapsed();
    assert_eq!(finished["data"]["status"], "abandoned", "{finished}");
    assert_on_time(after, grace);
}

#[tokio::test(start_paused = true)]
async fn a_new_turn_timeout_reaches_the_running_turn() {
    let node = node(|c| c.agent.turn_timeout = Duration::from_secs(5 * 60)).await;
    let (mut socket, id) = long_turn(&node).await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(60)).await;
    // Longer: the timer armed for 5 minutes does not end the turn.
    let timeout = Duration::from_secs(20 * 60);
    reload(&node, |c| c.agent.turn_timeout = timeout).await;
    let finished = socket.recv_until(event_of("turn_finished")).await;
    let after = started.elapsed();
    assert_eq!(finished["data"]["status"], "failed", "{finished}");
    assert_on_time(after, timeout);

    // Shorter, below what the next turn has already run: it ends at once.
    socket.send(json!({"type": "message", "conversation_id": id, "text": "/sleep 8h"}));
    socket.recv_until(event_of("turn_started")).await;
    tokio::time::sleep(Duration::from_secs(10 * 60)).await;
    let at_reload = Instant::now();
    reload(&node, |c| c.agent.turn_timeout = Duration::from_secs(60)).await;
    let finished = socket.recv_until(event_of("turn_finished")).await;
    assert_eq!(finished["data"]["status"], "failed", "{finished}");
    assert!(at_reload.elapsed() <= Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn a_lower_max_per_user_evicts_at_the_next_activation_only() {
    let node = node(|c| c.conversations.max_per_user = 3).await;
    let mut socket = Socket::open(&node, 1, "alice").await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(create(&mut socket).await);
    }
    reload(&node, |c| c.conversations.max_per_user = 1).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    for id in &ids {
        let events = node.store.events(id, 0, usize::MAX).await.unwrap();
        assert!(!has_event(&events, "agent_stopped"), "evicted at reload");
    }
    // The next activation makes room under the new limit.
    let fourth = create(&mut socket).await;
    for id in &ids {
        let stopped = stored(&node, id, "agent_stopped").await;
        assert_eq!(stopped["data"]["reason"], "user_limit", "{stopped}");
    }
    let events = node.store.events(&fourth, 0, usize::MAX).await.unwrap();
    assert!(!has_event(&events, "agent_stopped"));
    let evictions = node
        .decisions
        .since(0, 100)
        .decisions
        .iter()
        .filter(|d| d.rule == "user_limit" && d.inputs["max_per_user"] == 1)
        .count();
    assert_eq!(evictions, 3);
}
