//! DELETE is one operation of the supervisor: attaches and messages that
//! race it from other connections never bring the conversation back, never
//! run an agent in a removed workspace, and every one of them is answered.

mod common;

use common::TestServer;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_wins_against_racing_attaches_and_messages() {
    let server = TestServer::start_with(|c| c.conversations.max_per_user = 0).await;
    for round in 0..5 {
        let mut owner = server.connect("alice").await;
        let id = owner.create().await;
        owner.send_message(&id, "/stream 100000 5").await;
        // A connection of the same user attached and sending, two more
        // attaching while the delete runs.
        let mut sender = server.connect("alice").await;
        sender.attach(&id, 0).await;
        let mut racers = Vec::new();
        for _ in 0..2 {
            racers.push(server.connect("alice").await);
        }
        let path = format!("/v1/conversations/{id}");
        let delete = server.call("DELETE", &path, Some("alice"), None);
        let race = async {
            let mut replies = Vec::new();
            for _ in 0..5 {
                for racer in racers.iter_mut() {
                    replies.push(
                        racer
                            .request(json!({"type": "attach", "conversation_id": id}))
                            .await,
                    );
                }
                replies.push(
                    sender
                        .request(json!({"type": "message", "conversation_id": id, "text": "x"}))
                        .await,
                );
            }
            replies
        };
        let ((status, body), replies) = tokio::join!(delete, race);
        assert_eq!(status, 204, "round {round}: {body}");
        // Every request was answered (request() waits for its reply), with
        // one of the answers the protocol allows.
        for reply in &replies {
            let ok = matches!(reply["type"].as_str(), Some("attached" | "ack"))
                || matches!(reply["code"].as_str(), Some("not_found" | "not_attached"));
            assert!(ok, "round {round}: {reply}");
        }

        // Gone for good: not listed, not attachable, no workspace, and no
        // actor brought back by a late attach.
        let (status, _) = server.get(&path, Some("alice")).await;
        assert_eq!(status, 404, "round {round}");
        let late = racers[0]
            .request(json!({"type": "attach", "conversation_id": id}))
            .await;
        assert_eq!(late["code"], "not_found", "round {round}: {late}");
        assert!(
            !server.store_path().join("workspaces").join(&id).exists(),
            "round {round}: the workspace is removed"
        );
        let (_, list) = server.get("/v1/conversations", Some("alice")).await;
        assert!(
            !list.as_array().unwrap().iter().any(|c| c["id"] == id.as_str()),
            "round {round}: {list}"
        );
        // The owner was told why it lost the conversation.
        let (detached, _) = owner
            .recv_until(|f| f["type"] == "detached" && f["conversation_id"] == id.as_str())
            .await;
        assert_eq!(detached["reason"], "deleted", "{detached}");
    }
}
