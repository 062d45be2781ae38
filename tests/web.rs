//! The web page in a real headless Chromium (Debian's `chromium`, driven
//! through `chromedriver` over WebDriver) against an in-process server
//! behind a proxy the test can cut.
//!
//! It creates a conversation, streams `/stream 60 50`, cuts the network
//! mid-turn (no close frame) and checks the "reconnecting…" indicator, the
//! agent's status kept apart from it, and a reply with every token exactly
//! once; reloads mid-turn and checks nothing is shown twice; answers a
//! client tool call; sees plain-words stop reasons; resumes by sending a
//! message; observes read-only. A screenshot is saved to
//! `target/test-artifacts/web.png`.
//!
//! Chromium comes from `scripts/install-test-deps.sh`, which this test runs
//! itself when the browser is missing (so `cargo test` alone works on a
//! fresh machine); if it cannot be installed the test fails and says so. Waits poll the DOM with a bound, never sleep blindly.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::{stream_text, TestServer, RECV_TIMEOUT};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const USER: &str = "alice";
/// How often the DOM is polled while waiting for a state.
const POLL: Duration = Duration::from_millis(40);

/// chromedriver (in its own process group, with the Chromium it starts)
/// and one WebDriver session.
struct Browser {
    client: Client,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The whole group: chromedriver and the Chromium it started.
        let pgid = nix::unistd::Pid::from_raw(self.driver.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.driver.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Installs Chromium with the project's script when it is missing. Tests
/// run in parallel, so one lock makes the others wait for the install.
fn ensure_browser() {
    static INSTALL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    if Path::new(CHROMIUM).exists() && Path::new(CHROMEDRIVER).exists() {
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/install-test-deps.sh");
    let status = Command::new("bash").arg(&script).status();
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "installing Chromium with {} failed: {status:?}",
        script.display()
    );
}

async fn start_browser() -> Browser {
    ensure_browser();
    for (bin, package) in [(CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")] {
        assert!(
            Path::new(bin).exists(),
            "{bin} is missing: the browser test needs Debian's {package}; \
             run scripts/install-test-deps.sh (apt-get install -y chromium chromium-driver)"
        );
    }
    let port = free_port();
    let mut command = Command::new(CHROMEDRIVER);
    command
        .arg(format!("--port={port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let driver = command.spawn().expect("start chromedriver");
    let profile = tempfile::tempdir().expect("a Chromium profile directory");
    let url = format!("http://127.0.0.1:{port}");

    // chromedriver is ready when its /status says so.
    let http = reqwest::Client::new();
    let deadline = Instant::now() + RECV_TIMEOUT;
    loop {
        let ready = match http.get(format!("{url}/status")).send().await {
            Ok(response) => response
                .json::<Value>()
                .await
                .is_ok_and(|v| v["value"]["ready"] == true),
            Err(_) => false,
        };
        if ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "chromedriver did not get ready within {RECV_TIMEOUT:?}"
        );
        tokio::time::sleep(POLL).await;
    }

    let args = vec![
        "--headless".to_owned(),
        "--no-sandbox".to_owned(),
        "--disable-gpu".to_owned(),
        "--disable-dev-shm-usage".to_owned(),
        "--disable-quic".to_owned(),
        "--no-first-run".to_owned(),
        "--disable-background-networking".to_owned(),
        "--disable-component-update".to_owned(),
        "--disable-sync".to_owned(),
        "--window-size=1200,780".to_owned(),
        format!("--user-data-dir={}", profile.path().display()),
    ];
    let capabilities = json!({
        "browserName": "chrome",
        "goog:chromeOptions": { "binary": CHROMIUM, "args": args },
    });
    let capabilities = capabilities.as_object().cloned().unwrap_or_default();
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    let client = tokio::time::timeout(
        RECV_TIMEOUT,
        ClientBuilder::new(connector)
            .capabilities(capabilities)
            .connect(&url),
    )
    .await
    .unwrap_or_else(|_| panic!("no WebDriver session within {RECV_TIMEOUT:?}"))
    .unwrap_or_else(|e| panic!("starting Chromium through chromedriver: {e}"));
    Browser {
        client,
        driver,
        _profile: profile,
    }
}

/// What the test reads off the page in one go.
const SNAPSHOT: &str = r#"
const q = (s) => document.querySelector(s);
const text = (s) => (q(s) ? q(s).textContent : null);
return {
  conn: q('#conn').dataset.state,
  connText: text('#conn'),
  status: q('#agent-status').dataset.status,
  statusText: text('#agent-status'),
  banner: q('#banner').hidden ? null : text('#banner'),
  open: !q('#conversation').hidden,
  id: text('#conv-id'),
  composer: !q('#composer').hidden,
  assistant: [...document.querySelectorAll('#transcript .msg.assistant')]
    .map((b) => ({ text: b.textContent.trim(), final: b.dataset.final === 'true' })),
  users: [...document.querySelectorAll('#transcript .msg.user')].map((b) => b.textContent),
  notes: [...document.querySelectorAll('#transcript .note')].map((n) => n.textContent),
  tools: [...document.querySelectorAll('#transcript .tool')]
    .map((t) => ({ call: t.dataset.call, state: t.dataset.state })),
  listed: [...document.querySelectorAll('#conversations li[data-id]')].map((li) => li.dataset.id),
  admin: document.body.dataset.admin || '',
  adminProbes: Number(document.body.dataset.adminProbes || 0),
  adminTab: !q('#admin-tab').hidden,
  adminOpen: !q('#admin').hidden,
  adminRows: [...document.querySelectorAll('#admin-conversations tbody tr')]
    .map((tr) => [...tr.cells].map((c) => c.textContent)),
  adminDecisions: [...document.querySelectorAll('#admin-decisions li')].map((li) => li.dataset.rule),
  // Whether the open conversation's current attachment is a compact
  // replay, as the server's `attached` said (null until attached).
  compact: window.linger && window.linger.open && window.linger.open.conv.attached ? window.linger.open.conv.compactReplay : null,
  errors: window.__errors || [],
};
"#;

/// Records every frame the page's socket receives from now on (kind, seq,
/// turn and `compact`), in `window.__frames`.
const RECORD_FRAMES: &str = r#"
window.__frames = [];
window.linger.client.socket.on('frame', (f) => window.__frames.push({
  type: f.type, kind: f.kind || null, seq: f.seq ?? null, compact: f.compact ?? null,
  turn: (f.data && f.data.turn_id) || null, text: (f.data && f.data.text) || null,
}));
return true;
"#;

/// Page errors after load (uncaught exceptions, rejected promises).
const CATCH_ERRORS: &str = r#"
window.__errors = [];
window.addEventListener('error', (e) => window.__errors.push(String(e.message)));
window.addEventListener('unhandledrejection', (e) => window.__errors.push(String(e.reason)));
return !!window.linger;
"#;

/// The demo agent echoes a message word by word: a one-line Markdown list
/// item with HTML and a `javascript:` link that must stay inert.
const MARKDOWN_MESSAGE: &str = "- **bold** `code` <b>raw</b> <img src=x onerror=window.pwned=1> \
     [docs](https://example.com/) [bad](javascript:window.pwned=1)";

/// What the last reply's bubble holds.
const MARKDOWN_CHECK: &str = r#"
const bubbles = document.querySelectorAll('#transcript .msg.assistant');
const b = bubbles[bubbles.length - 1];
return {
  items: b.querySelectorAll('ul > li').length,
  strong: b.querySelectorAll('strong').length,
  code: b.querySelectorAll('code').length,
  img: b.querySelectorAll('img').length,
  b: b.querySelectorAll('b').length,
  links: [...b.querySelectorAll('a')].map((a) => [a.href, a.rel]),
  pwned: !!window.pwned,
};
"#;

struct Page<'a> {
    browser: &'a Browser,
    artifacts: PathBuf,
}

impl Page<'_> {
    fn client(&self) -> &Client {
        &self.browser.client
    }

    async fn snapshot(&self) -> Value {
        self.client()
            .execute(SNAPSHOT, vec![])
            .await
            .unwrap_or_else(|e| panic!("reading the page: {e}"))
    }

    async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self
            .client()
            .screenshot()
            .await
            .unwrap_or_else(|e| panic!("screenshot: {e}"));
        std::fs::create_dir_all(&self.artifacts).expect("create target/test-artifacts");
        let path = self.artifacts.join(name);
        std::fs::write(&path, png).expect("write the screenshot");
        path
    }

    /// Polls the page until `done` holds; `check` sees every snapshot on
    /// the way (to catch a state that must never be shown).
    async fn wait_for(
        &self,
        what: &str,
        check: &mut dyn FnMut(&Value),
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + RECV_TIMEOUT;
        loop {
            let state = self.snapshot().await;
            check(&state);
            let errors = state["errors"].as_array().map(Vec::len).unwrap_or(0);
            assert_eq!(errors, 0, "the page reported errors: {state:#}");
            if done(&state) {
                return state;
            }
            if Instant::now() >= deadline {
                let shot = self.screenshot("web-failure.png").await;
                panic!(
                    "waited {RECV_TIMEOUT:?} for {what}; the page (screenshot {}):\n{state:#}",
                    shot.display()
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    async fn wait(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        self.wait_for(what, &mut |_| {}, done).await
    }

    async fn find(&self, css: &str) -> fantoccini::elements::Element {
        self.client()
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css} on the page: {e}"))
    }

    async fn type_into(&self, css: &str, text: &str) {
        self.find(css)
            .await
            .send_keys(text)
            .await
            .unwrap_or_else(|e| panic!("typing into {css}: {e}"));
    }

    async fn click(&self, css: &str) {
        self.find(css)
            .await
            .click()
            .await
            .unwrap_or_else(|e| panic!("clicking {css}: {e}"));
    }

    async fn send(&self, text: &str) {
        self.type_into("#message", text).await;
        self.click("#send").await;
    }

    /// Loads the page at `base`, checks it is not signed in, and signs in
    /// as `USER` (dev auth: the token is the user name).
    async fn sign_in(&self, base: &str) {
        self.client()
            .goto(&format!("{base}/"))
            .await
            .expect("open the page");
        self.watch_errors().await;
        let state = self.snapshot().await;
        assert_eq!(state["connText"], "not signed in", "{state:#}");
        self.type_into("#token", USER).await;
        self.click("#token-use").await;
        self.wait("the socket to connect", |s| s["conn"] == "connected")
            .await;
    }

    async fn watch_errors(&self) {
        let loaded = self
            .client()
            .execute(CATCH_ERRORS, vec![])
            .await
            .unwrap_or_else(|e| panic!("installing the error catcher: {e}"));
        assert_eq!(loaded, true, "the page's script did not load");
    }
}

/// The text of every assistant bubble, in order.
fn replies(state: &Value) -> Vec<&str> {
    state["assistant"]
        .as_array()
        .map(|a| a.iter().filter_map(|b| b["text"].as_str()).collect())
        .unwrap_or_default()
}

/// The last assistant bubble, if any.
fn last_reply(state: &Value) -> Option<(&str, bool)> {
    let last = state["assistant"].as_array()?.last()?;
    Some((last["text"].as_str()?, last["final"] == true))
}

/// A check for every snapshot while a reply streams: what is shown is
/// always a prefix of the whole reply (a token shown twice or missed would
/// break it) and the final text replaces the streamed one.
fn prefix_of(whole: String, index: usize, seen: &mut usize) -> impl FnMut(&Value) + '_ {
    move |state: &Value| {
        if let Some(text) = state["assistant"][index]["text"].as_str() {
            assert!(
                whole.starts_with(text),
                "reply #{index} shows {text:?}, which is not how the reply starts \
                 (a token missing or shown twice)"
            );
            *seen += 1;
        }
    }
}

/// Replies are Markdown: a bubble's text is the rendered text, without the
/// trailing space of a streamed reply.
fn is_whole(state: &Value, whole: &str) -> bool {
    last_reply(state) == Some((whole.trim(), true))
}

async fn rest_create(server: &TestServer, title: &str) -> String {
    let response = reqwest::Client::new()
        .post(server.http_url("/v1/conversations"))
        .bearer_auth(USER)
        .json(&json!({ "title": title }))
        .send()
        .await
        .expect("POST /v1/conversations");
    assert_eq!(response.status().as_u16(), 201);
    let body: Value = response.json().await.expect("a JSON summary");
    body["id"].as_str().expect("an id").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_page_resumes_streams_answers_tools_and_explains_stops() {
    let server = TestServer::start_with(|c| c.conversations.max_per_user = 1).await;
    let proxy = Proxy::start(server.addr).await;
    let browser = start_browser().await;
    let page = Page {
        browser: &browser,
        artifacts: Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-artifacts"),
    };
    let client = page.client();
    page.sign_in(&proxy.http_url()).await;

    // Create a conversation.
    page.type_into("#new-title", "browser test").await;
    page.click("#new-conversation").await;
    let state = page
        .wait("the new conversation to open", |s| {
            s["open"] == true && s["status"] == "idle"
        })
        .await;
    let id = state["id"].as_str().expect("a conversation id").to_owned();
    assert!(id.starts_with("c_"), "{state:#}");
    // Nothing kept for it yet: the page asked for a compact replay.
    let state = page
        .wait("the first attach", |s| !s["compact"].is_null())
        .await;
    assert_eq!(state["compact"], true, "a first open is compact: {state:#}");
    assert!(
        state["listed"]
            .as_array()
            .is_some_and(|l| l.contains(&json!(id))),
        "the list shows it: {state:#}"
    );

    // Stream, and lose the network mid-turn.
    let whole = stream_text(60);
    let mut seen = 0;
    page.send("/stream 60 50").await;
    page.wait_for(
        "the reply to start",
        &mut prefix_of(whole.clone(), 0, &mut seen),
        |s| last_reply(s).is_some_and(|(t, _)| t.contains("tok5 ")),
    )
    .await;
    proxy.cut();
    let state = page
        .wait("the reconnecting indicator", |s| {
            s["conn"] == "reconnecting"
        })
        .await;
    assert_eq!(state["connText"], "reconnecting…", "{state:#}");
    assert_eq!(
        state["status"], "running",
        "a dropped socket is not the agent stopping: {state:#}"
    );
    assert!(state["banner"].is_null(), "no stop banner: {state:#}");
    page.screenshot("web-reconnecting.png").await;
    // The turn goes on while the page is away.
    server
        .wait_for_stored(&id, USER, "half the stream", |events| {
            common::text_deltas(events).len() >= 30
        })
        .await;
    proxy.heal();
    // The browser's own signal that the network is back.
    client
        .execute(
            "window.dispatchEvent(new Event('online')); return true;",
            vec![],
        )
        .await
        .expect("dispatch online");
    let state = page
        .wait_for(
            "the whole reply after the reconnect",
            &mut prefix_of(whole.clone(), 0, &mut seen),
            |s| s["conn"] == "connected" && is_whole(s, &whole),
        )
        .await;
    assert!(seen > 0);
    assert_eq!(
        state["compact"], false,
        "resuming from a known seq is not compact: {state:#}"
    );

    // Reload mid-turn: the page resumes from the seq it kept.
    let whole40 = stream_text(40);
    page.send("/stream 40 50").await;
    page.wait_for(
        "the second reply to start",
        &mut prefix_of(whole40.clone(), 1, &mut seen),
        |s| {
            s["assistant"].as_array().map(Vec::len) == Some(2)
                && last_reply(s).is_some_and(|(t, _)| t.contains("tok5 "))
        },
    )
    .await;
    client.refresh().await.expect("reload");
    page.watch_errors().await;
    let state = page
        .wait_for(
            "the second reply after the reload",
            &mut prefix_of(whole40.clone(), 1, &mut seen),
            |s| s["conn"] == "connected" && is_whole(s, &whole40),
        )
        .await;
    let replies = replies(&state);
    assert_eq!(
        replies,
        vec![whole.trim(), whole40.trim()],
        "each reply once after the reload"
    );
    assert_eq!(
        state["users"],
        json!(["/stream 60 50", "/stream 40 50"]),
        "each message once after the reload"
    );
    assert_eq!(
        state["compact"], false,
        "a reload resumes from the kept seq, in full: {state:#}"
    );

    // A client tool call, answered on its card.
    page.send("/ask weather {\"city\":\"Paris\"}").await;
    page.wait("the tool card", |s| {
        s["tools"][0]["state"] == "pending" && s["status"] == "waiting"
    })
    .await;
    page.type_into(".tool textarea", "{\"temp\": 21}").await;
    page.click(".tool button").await;
    let state = page
        .wait("the agent to use the result", |s| {
            is_whole(s, "weather returned {\"temp\":21}") && s["status"] == "idle"
        })
        .await;
    assert_eq!(state["tools"][0]["state"], "answered", "{state:#}");

    // Replies are Markdown, and what the agent writes as HTML stays text.
    page.send(MARKDOWN_MESSAGE).await;
    page.wait("the Markdown reply", |s| {
        last_reply(s).is_some_and(|(t, done)| done && t.contains("<img"))
    })
    .await;
    let markup = page
        .client()
        .execute(MARKDOWN_CHECK, vec![])
        .await
        .unwrap_or_else(|e| panic!("reading the Markdown reply: {e}"));
    assert_eq!(
        markup,
        json!({
            "items": 1, "strong": 1, "code": 1, "img": 0, "b": 0,
            "links": [["https://example.com/", "noopener noreferrer nofollow"]],
            "pwned": false,
        }),
        "rendered as Markdown, the agent's HTML and the javascript: link shown as text"
    );
    page.screenshot("web.png").await;

    // Stop a turn from the page.
    page.send("/sleep 30s").await;
    page.wait("the sleeping turn", |s| s["status"] == "running")
        .await;
    page.click("#stop").await;
    let state = page
        .wait("the stopped turn", |s| {
            s["status"] == "idle"
                && s["notes"]
                    .as_array()
                    .is_some_and(|n| n.contains(&json!("Turn stopped.")))
        })
        .await;
    assert!(state["banner"].is_null(), "{state:#}");

    // Closed by another client: the page says why, the socket stays up.
    let mut other = server.connect(USER).await;
    let head = server
        .stored_events(&id, USER, 0)
        .await
        .last()
        .map(common::seq)
        .unwrap_or(0);
    other.attach(&id, head).await;
    let ack = other
        .request(json!({"type": "close", "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let state = page
        .wait("the closed banner", |s| s["status"] == "stopped")
        .await;
    assert_eq!(
        state["banner"], "Stopped: it was closed. Send a message to resume it.",
        "{state:#}"
    );
    assert_eq!(state["conn"], "connected", "{state:#}");

    // Sending a message resumes it.
    page.send("back again").await;
    let state = page
        .wait("the resumed conversation to answer", |s| {
            is_whole(s, "back again") && s["status"] == "idle"
        })
        .await;
    assert!(state["banner"].is_null(), "{state:#}");

    // Another conversation takes the user's only slot.
    let other_id = rest_create(&server, "another").await;
    let state = page
        .wait("the user-limit banner, and the list with both", |s| {
            s["status"] == "stopped"
                && s["listed"]
                    .as_array()
                    .is_some_and(|l| l.contains(&json!(other_id)))
        })
        .await;
    assert_eq!(
        state["banner"], "Stopped: too many conversations. Send a message to resume it.",
        "{state:#}"
    );
    page.screenshot("web-stopped.png").await;

    // Delete the other one from the page (two clicks, no dialog).
    page.click(&format!("#conversations li[data-id='{other_id}']"))
        .await;
    page.wait("the other conversation to open", |s| {
        s["id"] == other_id.as_str() && s["status"] == "idle"
    })
    .await;
    page.click("#delete").await;
    page.click("#delete").await;
    page.wait("the deleted conversation to go", |s| {
        s["open"] == false
            && s["listed"]
                .as_array()
                .is_some_and(|l| !l.contains(&json!(other_id)))
    })
    .await;
    let (status, _) = server
        .get(&format!("/v1/conversations/{other_id}"), Some(USER))
        .await;
    assert_eq!(status, 404, "deleted on the server too");

    // Observe mode: bob may read, not write.
    let response = reqwest::Client::new()
        .post(server.http_url(&format!("/v1/conversations/{id}/observers")))
        .bearer_auth(USER)
        .json(&json!({"user": "bob"}))
        .send()
        .await
        .expect("add an observer");
    assert_eq!(response.status().as_u16(), 204);
    let token = page.find("#token").await;
    token.clear().await.expect("clear the token field");
    token.send_keys("bob").await.expect("type bob");
    page.click("#token-use").await;
    page.wait("bob's socket", |s| s["conn"] == "connected")
        .await;
    page.type_into("#observe-id", &id).await;
    page.click("#observe-form button").await;
    let state = page
        .wait("the observed history", |s| {
            s["open"] == true && is_whole(s, "back again")
        })
        .await;
    assert_eq!(
        state["composer"], false,
        "observers cannot write: {state:#}"
    );
    assert_eq!(
        state["banner"], "Stopped: too many conversations. Only its owner can resume it.",
        "{state:#}"
    );

    if let Err(e) = browser.client.clone().close().await {
        eprintln!("closing the WebDriver session: {e}");
    }
    drop(browser);
    drop(proxy);
    server.shutdown().await;
}

/// Protocol §11 from the page: a conversation the page has nothing of is
/// opened with a compact replay. Its finished turns arrive as whole
/// `assistant_message`s without their `text_delta`s and are shown; the
/// turn running at the attach streams in full, every token once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_open_is_a_compact_replay_that_shows_the_finished_turns() {
    let server = TestServer::start().await;
    let browser = start_browser().await;
    let page = Page {
        browser: &browser,
        artifacts: Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-artifacts"),
    };

    // Three finished turns, written by another client.
    let mut writer = server.connect(USER).await;
    let id = writer.create_titled("long history").await;
    let mut finished_turns = Vec::new();
    for _ in 0..3 {
        writer.send_message(&id, "/stream 8 1").await;
        let turn = writer.events_until_turn_finished(&id).await;
        let started = turn
            .iter()
            .find(|e| common::kind(e) == "turn_started")
            .expect("turn_started");
        finished_turns.push(started["data"]["turn_id"].clone());
    }

    // The page, signed in, recording what its socket receives.
    page.sign_in(&server.http_url("")).await;
    let recording = page
        .client()
        .execute(RECORD_FRAMES, vec![])
        .await
        .unwrap_or_else(|e| panic!("installing the frame recorder: {e}"));
    assert_eq!(recording, true);

    // A turn running when the page opens the conversation.
    let whole = stream_text(60);
    writer.send_message(&id, "/stream 60 50").await;
    let running = writer.events_until_kind(&id, "text_delta").await;
    let running_turn = running
        .iter()
        .find(|e| common::kind(e) == "turn_started")
        .expect("turn_started")["data"]["turn_id"]
        .clone();
    page.client()
        .execute(
            "location.hash = '#open=' + encodeURIComponent(arguments[0]); return true;",
            vec![json!(id)],
        )
        .await
        .expect("open the conversation");

    let mut seen = 0;
    let state = page
        .wait_for(
            "the finished replies, then the running one whole",
            &mut prefix_of(whole.clone(), 3, &mut seen),
            |s| s["assistant"].as_array().map(Vec::len) == Some(4) && is_whole(s, &whole),
        )
        .await;
    assert_eq!(state["compact"], true, "{state:#}");
    let short = stream_text(8);
    let replies = replies(&state);
    assert_eq!(
        replies,
        vec![short.trim(), short.trim(), short.trim(), whole.trim()],
        "every reply once, whole: {state:#}"
    );

    // What the socket brought: `attached {compact: true}`, then no
    // text_delta of a finished turn, each finished turn's whole reply, and
    // the running turn's deltas.
    let frames = page
        .client()
        .execute("return window.__frames;", vec![])
        .await
        .unwrap_or_else(|e| panic!("reading the recorded frames: {e}"));
    let frames = frames.as_array().cloned().unwrap_or_default();
    let attached = frames
        .iter()
        .find(|f| f["type"] == "attached")
        .unwrap_or_else(|| panic!("no attached frame: {frames:#?}"));
    assert_eq!(attached["compact"], true, "{attached}");
    let events = |kind: &str, turn: &Value| {
        frames
            .iter()
            .filter(|f| f["kind"] == kind && f["turn"] == *turn)
            .count()
    };
    for turn in &finished_turns {
        assert_eq!(
            events("text_delta", turn),
            0,
            "deltas of finished turn {turn} were sent"
        );
        assert_eq!(events("assistant_message", turn), 1, "{turn}: {frames:#?}");
    }
    assert_eq!(
        events("text_delta", &running_turn),
        60,
        "the running turn streams in full"
    );

    if let Err(e) = browser.client.clone().close().await {
        eprintln!("closing the WebDriver session: {e}");
    }
    drop(browser);
    server.shutdown().await;
}

/// An admin's token shows the admin tab, which lists what runs now and the
/// latest supervision decisions; anyone else's does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admins_token_opens_the_admin_tab_with_what_runs() {
    use linger::config::{AuthMode, TokenEntry};
    let server = TestServer::start_with(|c| {
        c.auth.mode = AuthMode::Tokens;
        c.auth.tokens = vec![
            TokenEntry {
                token: USER.into(),
                user: USER.into(),
                admin: false,
            },
            TokenEntry {
                token: "root-token".into(),
                user: "root".into(),
                admin: true,
            },
        ];
        c.conversations.max_per_user = 1;
    })
    .await;
    rest_create(&server, "first").await;
    // The second evicts the first: a user_limit decision.
    let second = rest_create(&server, "second").await;
    let browser = start_browser().await;
    let page = Page {
        browser: &browser,
        artifacts: Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-artifacts"),
    };
    page.client()
        .goto(&server.http_url("/"))
        .await
        .expect("open the page");
    page.watch_errors().await;

    // A user's token: no admin tab.
    page.type_into("#token", USER).await;
    page.click("#token-use").await;
    let state = page
        .wait("alice's token to be checked", |s| {
            s["adminProbes"].as_u64() >= Some(2)
        })
        .await;
    assert_eq!(state["admin"], "no", "{state:#}");
    assert_eq!(state["adminTab"], false, "{state:#}");

    // An admin's token: the tab, and in it alice's conversation.
    let token = page.find("#token").await;
    token.clear().await.expect("clear the token field");
    token.send_keys("root-token").await.expect("type the token");
    page.click("#token-use").await;
    page.wait("the admin tab", |s| s["adminTab"] == true).await;
    page.click("#admin-tab").await;
    let state = page
        .wait("the active conversation and the eviction", |s| {
            let row = s["adminRows"]
                .as_array()
                .and_then(|rows| rows.iter().find(|r| r[0] == second.as_str()));
            s["adminOpen"] == true
                && row.is_some_and(|r| r[1] == USER && r[2] == "idle")
                && s["adminDecisions"]
                    .as_array()
                    .is_some_and(|d| d.contains(&json!("user_limit")))
        })
        .await;
    assert_eq!(
        state["adminRows"].as_array().map(Vec::len),
        Some(1),
        "{state:#}"
    );
    page.screenshot("web-admin.png").await;

    // Back to the chats.
    page.click("#admin-tab").await;
    page.wait("the chats again", |s| s["adminOpen"] == false)
        .await;
    if let Err(e) = browser.client.clone().close().await {
        eprintln!("closing the WebDriver session: {e}");
    }
    drop(browser);
    server.shutdown().await;
}
