//! What a caller of the supervisor gets back: an [`Activated`]
//! conversation or an [`ActivateError`], how long it waits for that
//! ([`CALL_TIMEOUT`]), and what a call that got no answer means
//! ([`Unanswered`]): the one mapping every caller uses.

use std::sync::Arc;
use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{ActorRef, MessagingErr, RpcReplyPort};

use super::SupervisorMsg;
use crate::actors::active_view::ActiveConversation;
use crate::actors::conversation::ConversationMsg;
use crate::protocol::ErrorCode;
use crate::store::StoreError;

/// How long a caller waits for the supervisor to create or activate.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Why an activation or creation was refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ActivateError {
    #[error("no such conversation")]
    NotFound,
    #[error("you may attach to this conversation in observe mode only")]
    ObserveOnly,
    #[error("{max} conversations are already active (conversations.max_per_user)")]
    LimitReached { max: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// Cluster mode, for an activation that must be local (a request from
    /// another node): this node does not run the conversation.
    #[error("the conversation runs on another node; attach again")]
    Elsewhere,
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ActivateError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ActivateError::NotFound | ActivateError::Elsewhere => ErrorCode::NotFound,
            ActivateError::ObserveOnly => ErrorCode::ReadOnly,
            ActivateError::LimitReached { .. } => ErrorCode::LimitReached,
            ActivateError::Store(e) if e.is_unavailable() => ErrorCode::StoreUnavailable,
            ActivateError::ShuttingDown | ActivateError::Store(_) | ActivateError::Internal(_) => {
                ErrorCode::Internal
            }
        }
    }
}

/// An active conversation handed to a caller.
#[derive(Clone)]
pub struct Activated {
    pub id: Arc<str>,
    pub actor: ActorRef<ConversationMsg>,
}

pub type ActivateReply = RpcReplyPort<Result<Activated, ActivateError>>;

/// A call to the supervisor that got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unanswered {
    /// It is alive but did not answer within [`CALL_TIMEOUT`]: overloaded
    /// or stuck, which is an internal error, not a shutdown.
    #[error("the supervisor did not answer in time")]
    Timeout,
    /// It is gone, or dropped the reply: only a shutdown does that.
    #[error("the server is shutting down")]
    Gone,
}

impl Unanswered {
    /// The answer of a `call`, or why there is none.
    pub fn check<T>(
        result: Result<CallResult<T>, MessagingErr<SupervisorMsg>>,
    ) -> Result<T, Unanswered> {
        match result {
            Ok(CallResult::Success(answer)) => Ok(answer),
            Ok(CallResult::Timeout) => Err(Unanswered::Timeout),
            Ok(CallResult::SenderError) | Err(_) => Err(Unanswered::Gone),
        }
    }
}

impl From<Unanswered> for ActivateError {
    fn from(e: Unanswered) -> Self {
        match e {
            Unanswered::Timeout => ActivateError::Internal(e.to_string()),
            Unanswered::Gone => ActivateError::ShuttingDown,
        }
    }
}

/// The conversations active on this node, as the admin list shows them.
pub async fn list_active(
    supervisor: &ActorRef<SupervisorMsg>,
) -> Result<Vec<ActiveConversation>, Unanswered> {
    let listed = supervisor
        .call(
            |reply| SupervisorMsg::ListActive { reply },
            Some(CALL_TIMEOUT),
        )
        .await;
    Unanswered::check(listed)
}

/// The outcome of a `Create` or `Activate` call, an unanswered call
/// included.
pub fn activation_reply<T>(
    result: Result<CallResult<Result<T, ActivateError>>, MessagingErr<SupervisorMsg>>,
) -> Result<T, ActivateError> {
    Unanswered::check(result)?
}
