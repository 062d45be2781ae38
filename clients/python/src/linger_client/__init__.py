"""An asyncio client for linger: conversations that survive a dropped
socket. See `LingerClient`."""

from .backoff import Backoff
from .client import ConnectionState, LingerClient, StateChange, socket_url
from .conversation import Ack, Conversation, SeqGap
from .errors import (
    ClientClosed,
    ConnectionLost,
    Detached,
    LingerError,
    ReadOnly,
    ServerError,
    ToolError,
    Unauthorized,
)
from .rest import Rest, Summary, http_url
from .seqstore import JsonFileSeqStore, MemorySeqStore, SeqStore
from .transcript import (
    Applied,
    AssistantText,
    Event,
    Item,
    Note,
    ToolCall,
    Transcript,
    Turn,
    UserMessage,
    reason_words,
)

__all__ = [
    "Ack",
    "Applied",
    "AssistantText",
    "Backoff",
    "ClientClosed",
    "ConnectionLost",
    "ConnectionState",
    "Conversation",
    "Detached",
    "Event",
    "Item",
    "JsonFileSeqStore",
    "LingerClient",
    "LingerError",
    "MemorySeqStore",
    "Note",
    "ReadOnly",
    "Rest",
    "SeqGap",
    "SeqStore",
    "ServerError",
    "StateChange",
    "Summary",
    "ToolCall",
    "ToolError",
    "Transcript",
    "Turn",
    "Unauthorized",
    "UserMessage",
    "http_url",
    "reason_words",
    "socket_url",
]
