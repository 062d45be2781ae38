//! Security and hostile input: authentication in `tokens` and `jwt` mode
//! (refused with 401 before any upgrade), ownership on every frame and REST
//! route, observers, `server.allowed_origins`, every limit with its error,
//! and a table of hostile inputs against a server that keeps serving another
//! user's running conversation throughout.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

use common::*;
use linger::config::{AuthMode, TokenEntry};

// ---------------------------------------------------------------- helpers

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A fresh secret in a fresh environment variable (one per test: tests run
/// in parallel threads of one process).
fn jwt_secret(test: &str) -> (String, String) {
    let var = format!(
        "LINGER_TEST_JWT_{}_{}",
        test.to_uppercase(),
        std::process::id()
    );
    let secret: String = (0..48)
        .map(|_| char::from(b'a' + rand::random_range(0..26u8)))
        .collect();
    std::env::set_var(&var, &secret);
    (var, secret)
}

fn jwt_with(alg: Algorithm, secret: &str, claims: &Value) -> String {
    let key = EncodingKey::from_secret(secret.as_bytes()).expect("a usable secret");
    jsonwebtoken::encode(&Header::new(alg), claims, &key).expect("encode a JWT")
}

fn jwt(secret: &str, claims: Value) -> String {
    jwt_with(Algorithm::HS256, secret, &claims)
}

/// A valid HS256 token for `sub`, good for an hour.
fn token_for(secret: &str, sub: &str) -> String {
    jwt(secret, json!({"sub": sub, "exp": now() + 3600}))
}

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, b| (n << 8) | u32::from(*b)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// An unsigned token (`alg: none`), the classic forgery.
fn alg_none(claims: &Value) -> String {
    format!(
        "{}.{}.",
        base64url(br#"{"alg":"none","typ":"JWT"}"#),
        base64url(claims.to_string().as_bytes())
    )
}

/// Every REST route of protocol §2 that needs a caller, for conversation
/// `id`: (method, path, body).
fn authenticated_routes(id: &str) -> Vec<(&'static str, String, Option<Value>)> {
    vec![
        ("GET", "/v1/conversations".into(), None),
        (
            "POST",
            "/v1/conversations".into(),
            Some(json!({"title": "x"})),
        ),
        ("GET", format!("/v1/conversations/{id}"), None),
        (
            "GET",
            format!("/v1/conversations/{id}/events?after=0"),
            None,
        ),
        (
            "POST",
            format!("/v1/conversations/{id}/observers"),
            Some(json!({"user": "mallory"})),
        ),
        ("DELETE", format!("/v1/conversations/{id}"), None),
        ("GET", "/v1/admin/conversations".into(), None),
        // The websocket path itself, without upgrade headers.
        ("GET", "/v1/ws".into(), None),
    ]
}

/// Asserts that `token` (None: no token at all) is refused with 401 on the
/// websocket (query and header) and on every REST route, and that the
/// refusal changed nothing.
async fn assert_refused(server: &TestServer, what: &str, token: Option<&str>, id: &str) {
    let url = format!("ws://{}/v1/ws", server.addr);
    match token {
        None => {
            let refused = try_connect(&url, "nobody", &[]).await.err();
            assert_eq!(refused, Some(401), "{what}: websocket without a token");
        }
        Some(token) => {
            let refused = try_connect(&server.ws_url(token), "nobody", &[])
                .await
                .err();
            assert_eq!(refused, Some(401), "{what}: websocket with ?token=");
            let bearer = format!("Bearer {token}");
            let refused = try_connect(&url, "nobody", &[("authorization", &bearer)])
                .await
                .err();
            assert_eq!(refused, Some(401), "{what}: websocket with a bearer header");
        }
    }
    for (method, path, body) in authenticated_routes(id) {
        let (status, reply) = server.call(method, &path, token, body).await;
        assert_eq!(status, 401, "{what}: {method} {path} -> {reply}");
        assert_eq!(
            reply["error"]["code"], "unauthorized",
            "{method} {path}: {reply}"
        );
    }
}

/// The ids of the conversations in a REST list.
fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|c| c["id"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// Pings until a `pong` comes back: a rate-limited connection gets its
/// tokens back with time, and this polls for that (the interval only paces
/// the polling).
async fn ping_until_pong(client: &mut Client) {
    let deadline = std::time::Instant::now() + RECV_TIMEOUT;
    loop {
        let reply = client.request(json!({"type": "ping"})).await;
        if reply["type"] == "pong" {
            return;
        }
        assert_eq!(reply["code"], "rate_limited", "{reply}");
        assert!(
            std::time::Instant::now() < deadline,
            "no pong in {RECV_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Number of stored `user_message` events.
async fn stored_messages(server: &TestServer, id: &str, token: &str) -> usize {
    server
        .stored_events(id, token, 0)
        .await
        .iter()
        .filter(|e| kind(e) == "user_message")
        .count()
}

// ------------------------------------------------------------------ auth

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_mode_refuses_before_the_upgrade_and_admins_list_everything() {
    let server = TestServer::start_with(|c| {
        c.auth.mode = AuthMode::Tokens;
        c.auth.tokens = vec![
            TokenEntry {
                token: "tok-alice-0123456789".into(),
                user: "alice".into(),
                admin: false,
            },
            TokenEntry {
                token: "tok-bob-0123456789".into(),
                user: "bob".into(),
                admin: false,
            },
            TokenEntry {
                token: "tok-root-0123456789".into(),
                user: "root".into(),
                admin: true,
            },
        ];
    })
    .await;
    // alice over the websocket (query token), bob over REST (header).
    let mut alice = Client::connect(&server.ws_url("tok-alice-0123456789"), "alice").await;
    let a = alice.create_titled("alice's").await;
    let opening = alice.events(&a, 1).await;
    assert_eq!(opening[0]["data"]["user"], "alice", "{}", opening[0]);
    alice.send_message(&a, "hello there").await;
    let turn = alice.events_until_turn_finished(&a).await;
    assert_eq!(turn.last().unwrap()["data"]["status"], "completed");
    let (status, created) = server
        .call(
            "POST",
            "/v1/conversations",
            Some("tok-bob-0123456789"),
            Some(json!({"title": "bob's"})),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    let b = created["id"].as_str().unwrap().to_owned();
    // The header works on the websocket too.
    let url = format!("ws://{}/v1/ws", server.addr);
    let mut bob = try_connect(
        &url,
        "bob",
        &[("authorization", "Bearer tok-bob-0123456789")],
    )
    .await
    .unwrap_or_else(|status| panic!("bob's bearer header refused: {status}"));
    let attached = bob.attach(&b, 0).await;
    assert_eq!(attached["head_seq"], 2, "{attached}");

    for (what, token) in [
        ("no token", None),
        ("an unknown token", Some("tok-nobody-0123456789")),
        ("a user name (dev style)", Some("alice")),
        ("a prefix of a token", Some("tok-alice-012345678")),
        ("a token and more", Some("tok-alice-0123456789x")),
        ("an empty token", Some("")),
    ] {
        assert_refused(&server, what, token, &a).await;
    }
    // A good token under another scheme than Bearer is no token.
    let refused = try_connect(
        &url,
        "x",
        &[("authorization", "Basic tok-alice-0123456789")],
    )
    .await
    .err();
    assert_eq!(refused, Some(401));

    // Each user sees their own; the admin sees every user's.
    let (status, list) = server
        .call(
            "GET",
            "/v1/conversations",
            Some("tok-alice-0123456789"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(ids(&list), vec![a.clone()], "{list}");
    let (status, list) = server
        .call("GET", "/v1/conversations", Some("tok-bob-0123456789"), None)
        .await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(ids(&list), vec![b.clone()], "{list}");
    let (status, all) = server
        .call(
            "GET",
            "/v1/admin/conversations",
            Some("tok-root-0123456789"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{all}");
    let mut seen: Vec<(String, String)> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap().to_owned(),
                c["user"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    seen.sort();
    let mut want = vec![
        (a.clone(), "alice".to_owned()),
        (b.clone(), "bob".to_owned()),
    ];
    want.sort();
    assert_eq!(seen, want, "{all}");
    for token in ["tok-alice-0123456789", "tok-bob-0123456789"] {
        let (status, reply) = server
            .call("GET", "/v1/admin/conversations", Some(token), None)
            .await;
        assert_eq!(status, 404, "a non-admin on the admin list: {reply}");
    }
    // Being admin is no key to other users' conversations.
    let (status, reply) = server
        .call(
            "GET",
            &format!("/v1/conversations/{a}"),
            Some("tok-root-0123456789"),
            None,
        )
        .await;
    assert_eq!(status, 404, "{reply}");
    // Nothing the refused callers did changed anything.
    let stored = server.stored_events(&a, "tok-alice-0123456789", 0).await;
    assert_eq!(
        stored.iter().map(seq).collect::<Vec<_>>(),
        (1..=seq(turn.last().unwrap())).collect::<Vec<_>>()
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_mode_checks_signature_algorithm_expiry_and_subject() {
    let (var, secret) = jwt_secret("checks");
    let server = TestServer::start_with(|c| {
        c.auth.mode = AuthMode::Jwt;
        c.auth.jwt_secret_env = var.clone();
    })
    .await;
    let alice = token_for(&secret, "alice");
    let bob = token_for(&secret, "bob");

    // A good token works on the websocket and REST, as the user in `sub`.
    let mut c = Client::connect(&server.ws_url(&alice), "alice").await;
    let id = c.create().await;
    let opening = c.events(&id, 1).await;
    assert_eq!(opening[0]["data"]["user"], "alice", "{}", opening[0]);
    let (status, list) = server
        .call("GET", "/v1/conversations", Some(&alice), None)
        .await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(ids(&list), vec![id.clone()]);
    let (status, list) = server
        .call("GET", "/v1/conversations", Some(&bob), None)
        .await;
    assert_eq!(status, 200, "{list}");
    assert!(ids(&list).is_empty(), "bob sees alice's: {list}");
    let (status, reply) = server
        .call("GET", &format!("/v1/conversations/{id}"), Some(&bob), None)
        .await;
    assert_eq!(status, 404, "{reply}");
    // nbf in the past and a token without nbf are fine.
    let fine = jwt(
        &secret,
        json!({"sub": "alice", "exp": now() + 60, "nbf": now() - 60}),
    );
    let (status, reply) = server
        .call("GET", "/v1/conversations", Some(&fine), None)
        .await;
    assert_eq!(status, 200, "{reply}");

    let wrong_secret: String = secret.chars().rev().collect();
    let cases: Vec<(&str, String)> = vec![
        (
            "forged (another secret)",
            jwt(&wrong_secret, json!({"sub": "alice", "exp": now() + 3600})),
        ),
        (
            "expired an hour ago",
            jwt(&secret, json!({"sub": "alice", "exp": now() - 3600})),
        ),
        (
            "not valid for an hour yet (nbf)",
            jwt(
                &secret,
                json!({"sub": "alice", "exp": now() + 7200, "nbf": now() + 3600}),
            ),
        ),
        (
            "alg none",
            alg_none(&json!({"sub": "alice", "exp": now() + 3600})),
        ),
        (
            "alg none with the real signature",
            format!(
                "{}.{}",
                alg_none(&json!({"sub": "alice", "exp": now() + 3600})).trim_end_matches('.'),
                alice.rsplit('.').next().unwrap()
            ),
        ),
        (
            "HS512 with the right secret (only HS256 is accepted)",
            jwt_with(
                Algorithm::HS512,
                &secret,
                &json!({"sub": "alice", "exp": now() + 3600}),
            ),
        ),
        ("payload swapped under a valid signature", {
            let parts: Vec<&str> = alice.split('.').collect();
            let payload = base64url(
                json!({"sub": "bob", "exp": now() + 3600})
                    .to_string()
                    .as_bytes(),
            );
            format!("{}.{payload}.{}", parts[0], parts[2])
        }),
        ("no exp", jwt(&secret, json!({"sub": "alice"}))),
        (
            "an audience (linger has none to match)",
            jwt(
                &secret,
                json!({"sub": "alice", "exp": now() + 3600, "aud": "another-service"}),
            ),
        ),
        ("no sub", jwt(&secret, json!({"exp": now() + 3600}))),
        (
            "empty sub",
            jwt(&secret, json!({"sub": "", "exp": now() + 3600})),
        ),
        (
            "sub that is not a user name",
            jwt(
                &secret,
                json!({"sub": "alice bob/../x", "exp": now() + 3600}),
            ),
        ),
        (
            "sub of the wrong type",
            jwt(&secret, json!({"sub": 7, "exp": now() + 3600})),
        ),
        ("garbage", "not-a-jwt".into()),
        ("three garbage parts", "abc.def.ghi".into()),
        ("a user name (dev style)", "alice".into()),
        ("truncated", alice[..alice.len() - 3].to_owned()),
    ];
    for (what, token) in &cases {
        assert_refused(&server, what, Some(token), &id).await;
    }
    assert_refused(&server, "no token", None, &id).await;

    // The admin claim opens the admin list; without it, 404.
    let admin = jwt(
        &secret,
        json!({"sub": "ops", "exp": now() + 3600, "admin": true}),
    );
    let (status, all) = server
        .call("GET", "/v1/admin/conversations", Some(&admin), None)
        .await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(ids(&all), vec![id.clone()], "{all}");
    let (status, reply) = server
        .call("GET", "/v1/admin/conversations", Some(&alice), None)
        .await;
    assert_eq!(status, 404, "{reply}");

    // The refusals changed nothing: alice's history is the two opening
    // events.
    assert_eq!(server.stored_events(&id, &alice, 0).await.len(), 2);
    server.shutdown().await;
    std::env::remove_var(&var);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_mode_without_a_usable_secret_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let var = format!("LINGER_TEST_JWT_UNSET_{}", std::process::id());
    let mut config = linger::config::Config::default();
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.store.path = dir.path().to_path_buf();
    config.auth.mode = AuthMode::Jwt;
    config.auth.jwt_secret_env = var.clone();
    let error = match linger::server::Server::start(config.clone()).await {
        Ok(_) => panic!("started in jwt mode without the secret variable"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains(&var), "{error}");
    let short = format!("LINGER_TEST_JWT_SHORT_{}", std::process::id());
    std::env::set_var(&short, "short");
    config.auth.jwt_secret_env = short.clone();
    let error = match linger::server::Server::start(config).await {
        Ok(_) => panic!("started in jwt mode with a 5-byte secret"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains(&short), "{error}");
    std::env::remove_var(&short);
}

// ------------------------------------------------------------- ownership

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_conversation_is_not_found_on_every_frame_and_route() {
    let server = TestServer::start().await;
    let mut alice = server.connect("alice").await;
    let a = alice.create().await;
    alice.events(&a, 2).await;
    alice.send_message(&a, "/sleep 10m").await;
    let started = alice.events_until_kind(&a, "turn_started").await;
    let head = seq(started.last().unwrap());

    // Bob gets for alice's conversation exactly what he gets for one that
    // does not exist: nothing tells him it is there.
    let missing = "c_01J00000000000000000000000";
    let mut bob = server.connect("bob").await;
    let frames = |id: &str| {
        vec![
            json!({"type": "attach", "conversation_id": id}),
            json!({"type": "attach", "conversation_id": id, "mode": "observe"}),
            json!({"type": "attach", "conversation_id": id, "last_seq": 1}),
            json!({"type": "detach", "conversation_id": id}),
            json!({"type": "message", "conversation_id": id, "text": "/stream 5 0"}),
            json!({"type": "tool_result", "conversation_id": id, "call_id": "call_1", "output": 1}),
            json!({"type": "stop", "conversation_id": id}),
            json!({"type": "close", "conversation_id": id}),
        ]
    };
    for (theirs, nothing) in frames(&a).into_iter().zip(frames(missing)) {
        let reply = bob.request(theirs.clone()).await;
        let baseline = bob.request(nothing).await;
        assert_eq!(reply["type"], "error", "{theirs} -> {reply}");
        assert_eq!(
            reply["code"], baseline["code"],
            "{theirs}: {reply} differs from the answer for a missing id: {baseline}"
        );
        let want = if theirs["type"] == "attach" {
            "not_found"
        } else {
            "not_attached"
        };
        assert_eq!(reply["code"], want, "{theirs} -> {reply}");
    }
    let routes = |id: &str| {
        vec![
            ("GET", format!("/v1/conversations/{id}"), None),
            (
                "GET",
                format!("/v1/conversations/{id}/events?after=0"),
                None,
            ),
            (
                "POST",
                format!("/v1/conversations/{id}/observers"),
                Some(json!({"user": "bob"})),
            ),
            ("DELETE", format!("/v1/conversations/{id}"), None),
        ]
    };
    for ((method, path, body), (_, missing_path, missing_body)) in
        routes(&a).into_iter().zip(routes(missing))
    {
        let (status, reply) = server.call(method, &path, Some("bob"), body).await;
        let (missing_status, baseline) = server
            .call(method, &missing_path, Some("bob"), missing_body)
            .await;
        assert_eq!(status, 404, "bob: {method} {path} -> {reply}");
        assert_eq!(missing_status, 404, "{baseline}");
        assert_eq!(reply, baseline, "{method} {path}");
    }
    let (status, list) = server
        .call("GET", "/v1/conversations", Some("bob"), None)
        .await;
    assert_eq!(status, 200, "{list}");
    assert!(ids(&list).is_empty(), "{list}");
    // Bob's observer request did not take: he still cannot see it.
    let (status, _) = server
        .call("GET", &format!("/v1/conversations/{a}"), Some("bob"), None)
        .await;
    assert_eq!(status, 404);

    // Alice's turn is still running and nothing bob sent reached it.
    let (status, summary) = server
        .call(
            "GET",
            &format!("/v1/conversations/{a}"),
            Some("alice"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{summary}");
    assert_eq!(summary["status"], "running", "{summary}");
    assert_eq!(summary["head_seq"], head, "{summary}");
    let ack = alice
        .request(json!({"type": "stop", "conversation_id": a}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let end = alice.events_until_turn_finished(&a).await;
    assert_contiguous(&end, head + 1);
    assert_eq!(end.len(), 1, "{end:#?}");
    assert_eq!(end[0]["data"]["status"], "stopped");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_granted_through_rest_only_observe() {
    let server = TestServer::start().await;
    let mut alice = server.connect("alice").await;
    let a = alice.create().await;
    alice.events(&a, 2).await;

    // Not yet granted: bob cannot observe.
    let mut bob = server.connect("bob").await;
    let reply = bob
        .request(json!({"type": "attach", "conversation_id": a, "mode": "observe"}))
        .await;
    assert_eq!(reply["code"], "not_found", "{reply}");
    let (status, reply) = server
        .call(
            "POST",
            &format!("/v1/conversations/{a}/observers"),
            Some("alice"),
            Some(json!({"user": "bob"})),
        )
        .await;
    assert_eq!(status, 204, "{reply}");

    // Control is refused; observe works and sees the events.
    let reply = bob
        .request(json!({"type": "attach", "conversation_id": a, "mode": "control"}))
        .await;
    assert_eq!(reply["type"], "error", "{reply}");
    assert_eq!(reply["code"], "read_only", "{reply}");
    let reply = bob
        .request(json!({"type": "attach", "conversation_id": a}))
        .await;
    assert_eq!(
        reply["code"], "read_only",
        "attach defaults to control: {reply}"
    );
    let attached = bob.attach_with(&a, 0, "observe").await;
    assert_eq!(attached["replay_from"], 1, "{attached}");
    alice.send_message(&a, "/stream 30 1").await;
    let seen_by_alice = alice.events_until_turn_finished(&a).await;
    let seen_by_bob = bob.events_until_turn_finished(&a).await;
    assert_contiguous(&seen_by_bob, 1);
    assert_eq!(
        &seen_by_bob[2..],
        &seen_by_alice[..],
        "the observer saw something else"
    );

    // The observer cannot steer, over the websocket or REST.
    for frame in [
        json!({"type": "message", "conversation_id": a, "text": "/stream 5 0"}),
        json!({"type": "tool_result", "conversation_id": a, "call_id": "call_1", "output": 1}),
        json!({"type": "stop", "conversation_id": a}),
        json!({"type": "close", "conversation_id": a}),
    ] {
        let reply = bob.request(frame.clone()).await;
        assert_eq!(reply["code"], "read_only", "{frame} -> {reply}");
    }
    let (status, summary) = server
        .call("GET", &format!("/v1/conversations/{a}"), Some("bob"), None)
        .await;
    assert_eq!(status, 200, "an observer may read the summary: {summary}");
    let (status, _) = server
        .call(
            "GET",
            &format!("/v1/conversations/{a}/events"),
            Some("bob"),
            None,
        )
        .await;
    assert_eq!(status, 200, "an observer may read the history");
    for (method, path, body) in [
        ("DELETE", format!("/v1/conversations/{a}"), None),
        (
            "POST",
            format!("/v1/conversations/{a}/observers"),
            Some(json!({"user": "carol"})),
        ),
    ] {
        let (status, reply) = server.call(method, &path, Some("bob"), body).await;
        assert_eq!(status, 404, "observer: {method} {path} -> {reply}");
    }
    // Carol was not made an observer by bob's attempt; the list is bob's.
    let (status, _) = server
        .call(
            "GET",
            &format!("/v1/conversations/{a}"),
            Some("carol"),
            None,
        )
        .await;
    assert_eq!(status, 404);
    let (status, list) = server
        .call("GET", "/v1/conversations", Some("bob"), None)
        .await;
    assert_eq!(status, 200);
    assert!(
        ids(&list).is_empty(),
        "the list is the caller's own: {list}"
    );

    // Stopped, the grant still holds, and still only for observing.
    let ack = alice
        .request(json!({"type": "close", "conversation_id": a}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let (detached, _) = bob.recv_until(|f| f["type"] == "detached").await;
    assert_eq!(detached["reason"], "closed", "{detached}");
    let head = server.stored_events(&a, "alice", 0).await.len() as u64;
    let reply = bob
        .request(json!({"type": "attach", "conversation_id": a, "mode": "control"}))
        .await;
    assert_eq!(reply["code"], "read_only", "{reply}");
    let attached = bob.attach_with(&a, head, "observe").await;
    assert_eq!(attached["replay_from"], head + 1, "{attached}");
    let reply = bob
        .request(json!({"type": "message", "conversation_id": a, "text": "hi"}))
        .await;
    assert_eq!(reply["code"], "read_only", "{reply}");
    // Nothing bob sent is in the history.
    let stored = server.stored_events(&a, "alice", 0).await;
    assert!(
        stored
            .iter()
            .all(|e| kind(e) != "user_message" || e["data"]["text"] == "/stream 30 1"),
        "{stored:#?}"
    );
    server.shutdown().await;
}

/// An observer may read, not steer: bringing back a stopped conversation
/// must not stop the owner's other conversations (the per-user limit evicts
/// one of the owner's, and a running turn would end `stopped`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_cannot_stop_the_owners_conversations_through_the_user_limit() {
    let server = TestServer::start_with(|c| c.conversations.max_per_user = 2).await;
    let mut alice = server.connect("alice").await;
    let shared = alice.create().await;
    let (status, _) = server
        .call(
            "POST",
            &format!("/v1/conversations/{shared}/observers"),
            Some("alice"),
            Some(json!({"user": "bob"})),
        )
        .await;
    assert_eq!(status, 204);
    let ack = alice
        .request(json!({"type": "close", "conversation_id": shared}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    alice.recv_until(|f| f["type"] == "detached").await;
    // Alice is at her limit with two running, attached turns.
    let mut busy = Vec::new();
    for _ in 0..2 {
        let id = alice.create().await;
        alice.send_message(&id, "/sleep 10m").await;
        alice.events_until_kind(&id, "turn_started").await;
        busy.push(id);
    }
    let mut bob = server.connect("bob").await;
    let reply = bob
        .request(json!({"type": "attach", "conversation_id": shared, "mode": "observe"}))
        .await;
    // Whatever bob gets (attached, or refused), alice's turns run on.
    for id in &busy {
        let (status, summary) = server
            .call(
                "GET",
                &format!("/v1/conversations/{id}"),
                Some("alice"),
                None,
            )
            .await;
        assert_eq!(status, 200);
        assert_eq!(
            summary["status"], "running",
            "bob's observe attach ({reply}) stopped alice's {id}: {summary}"
        );
    }
    server.shutdown().await;
}

/// `GET /v1/ws` that is not a websocket upgrade: 426 with the JSON error
/// body, after authentication (401 without a token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_get_of_the_websocket_is_told_to_upgrade() {
    let server = TestServer::start().await;
    let (status, body) = server.get("/v1/ws", Some("alice")).await;
    assert_eq!(status, 426, "{body}");
    assert_eq!(body["error"]["code"], "bad_request", "{body}");
    let (status, body) = server.get("/v1/ws", None).await;
    assert_eq!(status, 401, "{body}");
    server.shutdown().await;
}

// ---------------------------------------------------------------- origins

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_origins_refuse_foreign_browsers_with_403() {
    let server = TestServer::start_with(|c| {
        c.server.allowed_origins = vec!["https://app.example".into()];
    })
    .await;
    let url = server.ws_url("alice");
    for origin in [
        "https://evil.example",
        "null",
        "https://app.example.evil.example",
        "http://app.example",
        "https://app.example:8443",
    ] {
        let refused = try_connect(&url, "alice", &[("origin", origin)])
            .await
            .err();
        assert_eq!(refused, Some(403), "Origin: {origin}");
    }
    // Authentication comes first: a foreign page without a token learns 401.
    let bare = format!("ws://{}/v1/ws", server.addr);
    let refused = try_connect(&bare, "x", &[("origin", "https://evil.example")])
        .await
        .err();
    assert_eq!(refused, Some(401));
    for headers in [vec![("origin", "https://app.example")], vec![]] {
        let mut c = try_connect(&url, "alice", &headers)
            .await
            .unwrap_or_else(|status| panic!("{headers:?} refused with {status}"));
        let pong = c.request(json!({"type": "ping"})).await;
        assert_eq!(pong["type"], "pong", "{pong}");
    }
    server.shutdown().await;

    // With no list, any Origin may connect.
    let open = TestServer::start().await;
    let mut c = try_connect(
        &open.ws_url("alice"),
        "alice",
        &[("origin", "https://evil.example")],
    )
    .await
    .unwrap_or_else(|status| panic!("refused with {status} though no list is set"));
    let pong = c.request(json!({"type": "ping"})).await;
    assert_eq!(pong["type"], "pong", "{pong}");
    open.shutdown().await;
}

// ----------------------------------------------------------------- limits

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_over_max_frame_bytes_closes_with_1009() {
    let server = TestServer::start_with(|c| c.limits.max_frame_bytes = 4096).await;
    let mut c = server.connect("alice").await;
    let pad = |n: usize| {
        let head = r#"{"type":"ping","req":"p","pad":""#;
        format!("{head}{}\"}}", "x".repeat(n - head.len() - 2))
    };
    let under = pad(4000);
    assert_eq!(under.len(), 4000);
    c.send_text(&under).await;
    assert_eq!(c.recv().await["type"], "pong");
    c.send_text(&pad(5000)).await;
    let (frames, code) = c.until_closed().await;
    assert_eq!(code, Some(1009), "frames before the close: {frames:?}");
    // Binary too.
    let mut c = server.connect("alice").await;
    c.send_binary(vec![b'x'; 5000]).await;
    let (_, code) = c.until_closed().await;
    assert_eq!(code, Some(1009));
    // The server goes on.
    let mut c = server.connect("alice").await;
    assert_eq!(c.request(json!({"type": "ping"})).await["type"], "pong");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_frames_is_rate_limited_and_has_no_effect() {
    let server = TestServer::start_with(|c| {
        c.limits.messages_per_second = 1;
        c.limits.messages_burst = 3;
    })
    .await;
    let mut c = server.connect("alice").await;
    let id = c.create().await;
    // 30 messages back to back: 2 tokens are left of the burst, and at one a
    // second the rest cannot all have refilled.
    for i in 0..30 {
        c.send(
            json!({"type": "message", "req": i, "conversation_id": id, "text": format!("m{i}")}),
        )
        .await;
    }
    // Each gets exactly one reply (acks wait for the commit, so they may
    // come after later refusals).
    let mut replies: Vec<Option<Value>> = vec![None; 30];
    while replies.iter().any(Option::is_none) {
        let frame = c.recv().await;
        if frame["type"] == "event" {
            continue;
        }
        let req = frame["req"]
            .as_u64()
            .unwrap_or_else(|| panic!("a reply without req: {frame}")) as usize;
        assert!(replies[req].is_none(), "two replies to {req}: {frame}");
        replies[req] = Some(frame);
    }
    let (mut acked, mut limited) = (0, 0);
    for frame in replies.into_iter().flatten() {
        match frame["type"].as_str() {
            Some("ack") => acked += 1,
            Some("error") => {
                assert_eq!(frame["code"], "rate_limited", "{frame}");
                assert_eq!(frame["conversation_id"], id, "{frame}");
                limited += 1;
            }
            _ => panic!("unexpected reply {frame}"),
        }
    }
    assert!(acked >= 2, "the burst lets the first two through");
    assert!(limited >= 1, "nothing was rate limited ({acked} acked)");
    // Only the accepted ones were recorded.
    let recorded = stored_messages(&server, &id, "alice").await;
    assert_eq!(
        recorded, acked,
        "rate-limited messages must not be recorded"
    );
    // The connection is still open and gets tokens back.
    ping_until_pong(&mut c).await;
    // Another connection of the same user has its own bucket.
    let mut other = server.connect("alice").await;
    assert_eq!(other.request(json!({"type": "ping"})).await["type"], "pong");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_connections_for_one_user() {
    let server = TestServer::start_with(|c| c.limits.max_connections_per_user = 2).await;
    let mut first = server.connect("alice").await;
    let mut second = server.connect("alice").await;
    let mut third = server.connect("alice").await;
    let (frames, code) = third.until_closed().await;
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(frames[0]["type"], "error", "{}", frames[0]);
    assert_eq!(frames[0]["code"], "too_many_connections", "{}", frames[0]);
    assert_eq!(code, Some(1008));
    // The two open ones and other users are unaffected.
    for c in [&mut first, &mut second] {
        assert_eq!(c.request(json!({"type": "ping"})).await["type"], "pong");
    }
    let mut bob = server.connect("bob").await;
    assert_eq!(bob.request(json!({"type": "ping"})).await["type"], "pong");
    // A closed connection gives its slot back (released when the server
    // has finished with the socket: poll for it). A refused connection gets
    // the error unasked, then is closed; an accepted one answers the ping.
    drop(first);
    let deadline = std::time::Instant::now() + RECV_TIMEOUT;
    loop {
        let mut c = server.connect("alice").await;
        c.send(json!({"type": "ping", "req": "again"})).await;
        let (reply, _) = c
            .recv_until(|f| f["type"] == "pong" || f["type"] == "error")
            .await;
        if reply["type"] == "pong" {
            break;
        }
        assert_eq!(reply["code"], "too_many_connections", "{reply}");
        assert!(
            std::time::Instant::now() < deadline,
            "the slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_messages_are_capped_with_queue_full() {
    let server = TestServer::start_with(|c| c.conversations.max_queued_messages = 2).await;
    let mut c = server.connect("alice").await;
    let id = c.create().await;
    c.send_message(&id, "/sleep 10m").await;
    c.events_until_kind(&id, "turn_started").await;
    c.send_message(&id, "one").await;
    c.send_message(&id, "two").await;
    let reply = c
        .request(json!({"type": "message", "conversation_id": id, "text": "three"}))
        .await;
    assert_eq!(reply["type"], "error", "{reply}");
    assert_eq!(reply["code"], "queue_full", "{reply}");
    assert_eq!(reply["conversation_id"], id, "{reply}");
    // The refused one was not recorded; the queue drains once the turn ends.
    assert_eq!(stored_messages(&server, &id, "alice").await, 3);
    let ack = c
        .request(json!({"type": "stop", "conversation_id": id}))
        .await;
    assert_eq!(ack["type"], "ack", "{ack}");
    let first = c.events_until_turn_finished(&id).await;
    assert_eq!(first.last().unwrap()["data"]["status"], "stopped");
    let one = c.events_until_turn_finished(&id).await;
    assert_eq!(the_one(&one, "assistant_message")["data"]["text"], "one");
    let two = c.events_until_turn_finished(&id).await;
    assert_eq!(the_one(&two, "assistant_message")["data"]["text"], "two");
    // With the queue empty again, a message is accepted.
    c.send_message(&id, "four").await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_long_fields_get_bad_request() {
    use linger::protocol::{MAX_ID_BYTES, MAX_TEXT_BYTES, MAX_TITLE_CHARS};
    let server = TestServer::start().await;
    let mut c = server.connect("alice").await;
    let id = c.create().await;
    let long_id = "c".repeat(MAX_ID_BYTES + 1);
    let cases = vec![
        json!({"type": "create", "title": "é".repeat(MAX_TITLE_CHARS + 1)}),
        json!({"type": "attach", "conversation_id": long_id}),
        json!({"type": "attach", "conversation_id": ""}),
        json!({"type": "detach", "conversation_id": long_id}),
        json!({"type": "message", "conversation_id": long_id, "text": "hi"}),
        json!({"type": "message", "conversation_id": id, "text": "x".repeat(MAX_TEXT_BYTES + 1)}),
        json!({"type": "message", "conversation_id": id, "text": "hi", "client_msg_id": "m".repeat(MAX_ID_BYTES + 1)}),
        json!({"type": "message", "conversation_id": id, "text": "hi", "client_msg_id": ""}),
        json!({"type": "tool_result", "conversation_id": id, "call_id": "k".repeat(MAX_ID_BYTES + 1), "output": 1}),
        json!({"type": "stop", "conversation_id": long_id}),
        json!({"type": "close", "conversation_id": long_id}),
        json!({"type": "create", "close_delay": "9".repeat(400)}),
        json!({"type": "create", "close_delay": "soon"}),
    ];
    for frame in cases {
        let reply = c.request(frame.clone()).await;
        assert_eq!(
            reply["type"],
            "error",
            "{} -> {reply}",
            &frame.to_string()[..80.min(frame.to_string().len())]
        );
        assert_eq!(reply["code"], "bad_request", "{reply}");
    }
    // At the limit is fine.
    let ok = c
        .request(json!({"type": "create", "title": "é".repeat(MAX_TITLE_CHARS)}))
        .await;
    assert_eq!(ok["type"], "created", "{ok}");
    let reply = c
        .request(json!({"type": "attach", "conversation_id": "c".repeat(MAX_ID_BYTES)}))
        .await;
    assert_eq!(reply["code"], "not_found", "{reply}");
    // Nothing over the limits was recorded.
    assert_eq!(stored_messages(&server, &id, "alice").await, 0);
    // REST has the same limits.
    let (status, reply) = server
        .call(
            "POST",
            "/v1/conversations",
            Some("alice"),
            Some(json!({"title": "t".repeat(MAX_TITLE_CHARS + 1)})),
        )
        .await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["code"], "bad_request", "{reply}");
    for user in ["u".repeat(65), String::new()] {
        let (status, reply) = server
            .call(
                "POST",
                &format!("/v1/conversations/{id}/observers"),
                Some("alice"),
                Some(json!({"user": user})),
            )
            .await;
        assert_eq!(status, 400, "{reply}");
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_event_pages_are_bounded_in_bytes() {
    let server = TestServer::start().await;
    let mut c = server.connect("alice").await;
    let id = c.create().await;
    // Eight messages of one 250 kB word: each is recorded three times (the
    // message, the echoed delta, the reply), about 6 MB in all.
    let word = "w".repeat(250_000);
    let mut head = 2;
    for _ in 0..8 {
        c.send_message(&id, &word).await;
        let turn = c.events_until_turn_finished(&id).await;
        head = seq(turn.last().unwrap());
    }
    let path = format!("/v1/conversations/{id}/events?after=0&limit=10000");
    let (status, page) = server.call("GET", &path, Some("alice"), None).await;
    assert_eq!(status, 200);
    assert_eq!(page["head_seq"], head, "{}", page["head_seq"]);
    let first = page["events"].as_array().unwrap();
    let last = seq(first.last().unwrap());
    assert!(
        last < head,
        "one page held all {head} events ({} bytes)",
        page.to_string().len()
    );
    assert!(page.to_string().len() <= 5 * 1024 * 1024);
    assert_contiguous(first, 1);
    // Paging on with `after` gets the rest, contiguous; a page holds at
    // least one event however large.
    let all = server.stored_events(&id, "alice", 0).await;
    assert_contiguous(&all, 1);
    assert_eq!(seq(all.last().unwrap()), head);
    let (_, one) = server
        .call(
            "GET",
            &format!("/v1/conversations/{id}/events?after=3&limit=1"),
            Some("alice"),
            None,
        )
        .await;
    assert_eq!(
        one["events"].as_array().unwrap().len(),
        1,
        "{}",
        one["head_seq"]
    );
    server.shutdown().await;
}

// --------------------------------------------------------- hostile inputs

/// What a hostile frame must get back.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// An `error` frame with this code.
    Error(&'static str),
    /// A reply of this type (the input is odd but allowed).
    Reply(&'static str),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_inputs_are_refused_and_another_users_turn_is_unaffected() {
    let (var, secret) = jwt_secret("hostile");
    let server = TestServer::start_with(|c| {
        c.auth.mode = AuthMode::Jwt;
        c.auth.jwt_secret_env = var.clone();
        c.server.allowed_origins = vec!["https://app.example".into()];
        // Every row gets a fresh connection (and so a fresh rate limiter).
        c.limits.max_connections_per_user = 10_000;
    })
    .await;
    let victim_token = token_for(&secret, "victim");
    let mallory = token_for(&secret, "mallory");
    let mallory_url = server.ws_url(&mallory);

    // The bystander: another user's long turn, watched on its own
    // connection for the whole test.
    let mut victim = Client::connect(&server.ws_url(&victim_token), "victim").await;
    let v = victim.create().await;
    victim.send_message(&v, "/stream 2000 5").await;
    let watched = v.clone();
    let watcher = tokio::spawn(async move {
        let events = victim.events_until_turn_finished(&watched).await;
        (victim, events)
    });

    // Mallory's own conversation, for the rows that need one.
    let mut own_conn = Client::connect(&mallory_url, "mallory").await;
    let own = own_conn.create().await;
    own_conn.events(&own, 2).await;

    let deep_arrays = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_objects = format!("{}1{}", r#"{"a":"#.repeat(100_000), "}".repeat(100_000));
    let deep_field = format!(
        r#"{{"type":"ping","x":{}0{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let huge_number = format!(
        r#"{{"type":"attach","conversation_id":"{own}","last_seq":{}}}"#,
        "9".repeat(500_000)
    );
    let long_text = json!({"type": "message", "conversation_id": own, "text": "y".repeat(300_000)});
    let rows: Vec<(&str, String, Want)> = vec![
        ("not JSON", "{not json".into(), Want::Error("bad_request")),
        ("empty frame", String::new(), Want::Error("bad_request")),
        ("a NUL byte", "\u{0}".into(), Want::Error("bad_request")),
        ("JSON null", "null".into(), Want::Error("bad_request")),
        (
            "a bare string",
            r#""ping""#.into(),
            Want::Error("bad_request"),
        ),
        (
            "an array",
            r#"[{"type":"ping"}]"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "trailing garbage",
            r#"{"type":"ping"} {"type":"ping"}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "type is a number",
            r#"{"type":1}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "type is null",
            r#"{"type":null}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "unknown type",
            r#"{"type":"shutdown"}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "type in capitals",
            r#"{"type":"PING"}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "conversation_id is a number",
            r#"{"type":"attach","conversation_id":5}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "conversation_id is an object",
            r#"{"type":"attach","conversation_id":{"$ne":""}}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "last_seq is a string",
            format!(r#"{{"type":"attach","conversation_id":"{own}","last_seq":"0"}}"#),
            Want::Error("bad_request"),
        ),
        (
            "last_seq is negative",
            format!(r#"{{"type":"attach","conversation_id":"{own}","last_seq":-1}}"#),
            Want::Error("bad_request"),
        ),
        (
            "last_seq 1e300",
            format!(r#"{{"type":"attach","conversation_id":"{own}","last_seq":1e300}}"#),
            Want::Error("bad_request"),
        ),
        (
            "last_seq 2^64",
            format!(
                r#"{{"type":"attach","conversation_id":"{own}","last_seq":18446744073709551616}}"#
            ),
            Want::Error("bad_request"),
        ),
        (
            "last_seq is a fraction",
            format!(r#"{{"type":"attach","conversation_id":"{own}","last_seq":1.5}}"#),
            Want::Error("bad_request"),
        ),
        (
            "last_seq of 500,000 digits",
            huge_number,
            Want::Error("bad_request"),
        ),
        (
            "last_seq 2^64-1 (valid, past the head)",
            format!(
                r#"{{"type":"attach","conversation_id":"{own}","last_seq":18446744073709551615}}"#
            ),
            Want::Reply("attached"),
        ),
        (
            "mode is unknown",
            format!(r#"{{"type":"attach","conversation_id":"{own}","mode":"admin"}}"#),
            Want::Error("bad_request"),
        ),
        (
            "text is an array",
            format!(r#"{{"type":"message","conversation_id":"{own}","text":["a"]}}"#),
            Want::Error("bad_request"),
        ),
        (
            "text is null",
            format!(r#"{{"type":"message","conversation_id":"{own}","text":null}}"#),
            Want::Error("bad_request"),
        ),
        (
            "is_error is a string",
            format!(
                r#"{{"type":"tool_result","conversation_id":"{own}","call_id":"c","output":1,"is_error":"yes"}}"#
            ),
            Want::Error("bad_request"),
        ),
        (
            "output missing",
            format!(r#"{{"type":"tool_result","conversation_id":"{own}","call_id":"c"}}"#),
            Want::Error("bad_request"),
        ),
        (
            "req is an object",
            r#"{"type":"ping","req":{"a":1}}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "req 2^64",
            r#"{"type":"ping","req":18446744073709551616}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "req 1e300",
            r#"{"type":"ping","req":1e300}"#.into(),
            Want::Error("bad_request"),
        ),
        (
            "100,000 nested arrays",
            deep_arrays,
            Want::Error("bad_request"),
        ),
        (
            "100,000 nested objects",
            deep_objects,
            Want::Error("bad_request"),
        ),
        (
            "100,000 nested arrays in an unknown field",
            deep_field,
            Want::Error("bad_request"),
        ),
        (
            "unknown fields are ignored",
            r#"{"type":"ping","admin":true,"user":"victim","__proto__":{}}"#.into(),
            Want::Reply("pong"),
        ),
        (
            "over-long text",
            long_text.to_string(),
            Want::Error("bad_request"),
        ),
        (
            "a user field does not change who sends",
            format!(r#"{{"type":"attach","conversation_id":"{v}","user":"victim"}}"#),
            Want::Error("not_found"),
        ),
        (
            "another user's id: attach",
            format!(r#"{{"type":"attach","conversation_id":"{v}"}}"#),
            Want::Error("not_found"),
        ),
        (
            "another user's id: observe",
            format!(r#"{{"type":"attach","conversation_id":"{v}","mode":"observe","last_seq":0}}"#),
            Want::Error("not_found"),
        ),
        (
            "another user's id: detach",
            format!(r#"{{"type":"detach","conversation_id":"{v}"}}"#),
            Want::Error("not_attached"),
        ),
        (
            "another user's id: message",
            format!(r#"{{"type":"message","conversation_id":"{v}","text":"/panic"}}"#),
            Want::Error("not_attached"),
        ),
        (
            "another user's id: tool_result",
            format!(
                r#"{{"type":"tool_result","conversation_id":"{v}","call_id":"call_1","output":{{}}}}"#
            ),
            Want::Error("not_attached"),
        ),
        (
            "another user's id: stop",
            format!(r#"{{"type":"stop","conversation_id":"{v}"}}"#),
            Want::Error("not_attached"),
        ),
        (
            "another user's id: close",
            format!(r#"{{"type":"close","conversation_id":"{v}"}}"#),
            Want::Error("not_attached"),
        ),
    ];
    for (what, text, want) in &rows {
        let mut c = Client::connect(&mallory_url, "mallory").await;
        c.send_text(text).await;
        let reply = c.recv().await;
        match want {
            Want::Error(code) => {
                assert_eq!(reply["type"], "error", "{what}: {reply}");
                assert_eq!(reply["code"], *code, "{what}: {reply}");
            }
            Want::Reply(kind_) => assert_eq!(reply["type"], *kind_, "{what}: {reply}"),
        }
        // The connection lives on.
        let pong = c.request(json!({"type": "ping", "req": "alive"})).await;
        assert_eq!(pong["type"], "pong", "{what}: then {pong}");
    }

    // A binary frame.
    let mut c = Client::connect(&mallory_url, "mallory").await;
    c.send_binary(b"{\"type\":\"ping\"}".to_vec()).await;
    assert_eq!(c.recv().await["code"], "bad_request");
    assert_eq!(c.request(json!({"type": "ping"})).await["type"], "pong");

    // A frame over limits.max_frame_bytes (default 1 MiB): closed with 1009.
    let mut c = Client::connect(&mallory_url, "mallory").await;
    c.send_text(&format!(
        r#"{{"type":"ping","pad":"{}"}}"#,
        "z".repeat(1 << 20)
    ))
    .await;
    let (_, code) = c.until_closed().await;
    assert_eq!(code, Some(1009), "a frame over the limit");

    // A flood: 500 frames back to back, each answered, in order; past the
    // burst they are rate limited.
    let mut c = Client::connect(&mallory_url, "mallory").await;
    for i in 0..500 {
        c.send(json!({"type": "ping", "req": i})).await;
    }
    let mut limited = 0;
    for i in 0..500 {
        let reply = c.recv().await;
        assert_eq!(reply["req"], i, "{reply}");
        match reply["type"].as_str() {
            Some("pong") => {}
            Some("error") if reply["code"] == "rate_limited" => limited += 1,
            _ => panic!("flood: {reply}"),
        }
    }
    assert!(limited > 0, "500 frames at once and none rate limited");
    ping_until_pong(&mut c).await;

    // Another user's ids over REST.
    for (method, path, body) in [
        ("GET", format!("/v1/conversations/{v}"), None),
        (
            "GET",
            format!("/v1/conversations/{v}/events?after=0&limit=10000"),
            None,
        ),
        (
            "POST",
            format!("/v1/conversations/{v}/observers"),
            Some(json!({"user": "mallory"})),
        ),
        ("DELETE", format!("/v1/conversations/{v}"), None),
        ("GET", "/v1/admin/conversations".into(), None),
    ] {
        let (status, reply) = server.call(method, &path, Some(&mallory), body).await;
        assert_eq!(status, 404, "mallory: {method} {path} -> {reply}");
    }

    // Forged, expired and unsigned tokens, and a foreign Origin.
    let wrong: String = secret.chars().rev().collect();
    for (what, token) in [
        (
            "forged",
            jwt(&wrong, json!({"sub": "victim", "exp": now() + 3600})),
        ),
        (
            "expired",
            jwt(&secret, json!({"sub": "victim", "exp": now() - 600})),
        ),
        (
            "alg none",
            alg_none(&json!({"sub": "victim", "exp": now() + 3600})),
        ),
        (
            "admin claim, forged",
            jwt(
                &wrong,
                json!({"sub": "mallory", "exp": now() + 3600, "admin": true}),
            ),
        ),
    ] {
        assert_refused(&server, what, Some(&token), &v).await;
    }
    let refused = try_connect(
        &mallory_url,
        "mallory",
        &[("origin", "https://evil.example")],
    )
    .await
    .err();
    assert_eq!(refused, Some(403), "a foreign Origin");

    // The victim's turn ran through all of it: contiguous, complete.
    let (_victim, events) = tokio::time::timeout(Duration::from_secs(120), watcher)
        .await
        .expect("the victim's turn did not finish")
        .expect("the victim's reader panicked");
    assert_contiguous(&events, 1);
    assert_eq!(text_deltas(&events).len(), 2000);
    let last = events.last().unwrap();
    assert_eq!(last["data"]["status"], "completed", "{last}");
    assert_eq!(
        the_one(&events, "assistant_message")["data"]["text"],
        stream_text(2000)
    );
    let stored = server.stored_events(&v, &victim_token, 0).await;
    assert_eq!(
        stored.len(),
        events.len(),
        "the victim's history has foreign events"
    );
    assert!(stored
        .iter()
        .all(|e| kind(e) != "user_message" || e["data"]["text"] == "/stream 2000 5"));
    // Mallory's own conversation still works, and so does the server.
    let mut c = Client::connect(&mallory_url, "mallory").await;
    c.attach(&own, 2).await;
    c.send_message(&own, "still here").await;
    let turn = c.events_until_turn_finished(&own).await;
    assert_eq!(turn.last().unwrap()["data"]["status"], "completed");
    let (status, _) = server.get("/healthz", None).await;
    assert_eq!(status, 200);
    server.shutdown().await;
    std::env::remove_var(&var);
}
