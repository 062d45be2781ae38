//! The cluster-wide admin list (`GET /v1/admin/conversations`, `linger ps`
//! in cluster mode): every node lists only what it runs, so the node asked
//! gathers the other live nodes' lists over NATS request/reply and merges
//! them with its own. A node that does not answer within [`LIST_TIMEOUT`]
//! (stopped, overloaded, cut off) is named rather than waited for: an
//! operator gets what the others run at once, and knows what is missing.

use std::time::Duration;

use futures_util::future::join_all;
use tracing::debug;

use crate::actors::active_view::ActiveConversation;
use crate::cluster::node::ClusterNode;

/// How long the node asked waits for each other node's list.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(2);

/// What every live node runs, and the nodes that did not say.
#[derive(Debug, Default)]
pub struct ClusterList {
    /// By user, then id (a conversation being handed from one node to
    /// another can show on both: the old owner's entry says `stopping`).
    pub conversations: Vec<ActiveConversation>,
    /// Live nodes (heartbeat seen) that did not answer in time, sorted.
    pub unanswered: Vec<String>,
}

/// Merges `own` (this node's list) with the lists of the other nodes whose
/// heartbeat this node sees, asked all at once.
pub async fn gather(node: &ClusterNode, own: Vec<ActiveConversation>) -> ClusterList {
    let others: Vec<String> = node
        .ownership
        .leases()
        .liveness()
        .live_nodes()
        .into_iter()
        .filter(|n| *n != node.node)
        .collect();
    let answers = join_all(others.into_iter().map(|other| async move {
        let listed = ask(node, &other).await;
        (other, listed)
    }))
    .await;
    let mut list = ClusterList {
        conversations: own,
        unanswered: Vec::new(),
    };
    for (other, listed) in answers {
        match listed {
            Ok(theirs) => list.conversations.extend(theirs),
            Err(reason) => {
                debug!(node = %other, %reason, "no admin list from another node");
                list.unanswered.push(other);
            }
        }
    }
    list.conversations
        .sort_by(|a, b| (&a.user, &a.id, &a.node).cmp(&(&b.user, &b.id, &b.node)));
    list.unanswered.sort();
    list
}

/// One other node's list, or why there is none.
async fn ask(node: &ClusterNode, other: &str) -> Result<Vec<ActiveConversation>, String> {
    let request = async_nats::Request::new().timeout(Some(LIST_TIMEOUT));
    let answer = node
        .client
        .send_request(node.subjects.list(other), request)
        .await
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&answer.payload).map_err(|e| format!("not a list: {e}"))
}
