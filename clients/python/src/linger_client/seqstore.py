"""Where the last seq applied per conversation is kept between runs.

The client resumes a conversation from `get(id)` when it has no transcript
of it yet, and calls `set(id, seq)` after each event was applied and handed
to the application, so a restarted process resumes after the last event it
processed: nothing missed, nothing twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Protocol


class SeqStore(Protocol):
    def get(self, conversation_id: str) -> int | None: ...

    def set(self, conversation_id: str, seq: int) -> None: ...

    def forget(self, conversation_id: str) -> None: ...


class MemorySeqStore:
    """The default: forgotten when the process ends."""

    def __init__(self) -> None:
        self._seqs: dict[str, int] = {}

    def get(self, conversation_id: str) -> int | None:
        return self._seqs.get(conversation_id)

    def set(self, conversation_id: str, seq: int) -> None:
        self._seqs[conversation_id] = seq

    def forget(self, conversation_id: str) -> None:
        self._seqs.pop(conversation_id, None)


class JsonFileSeqStore:
    """One JSON object `{conversation_id: seq}` in a file, replaced
    atomically on every change (write to a temporary file, then rename), so
    a crash leaves either the old or the new content."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._seqs: dict[str, int] = {}
        try:
            data = json.loads(self._path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            data = {}
        if isinstance(data, dict):
            self._seqs = {k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool)}

    def get(self, conversation_id: str) -> int | None:
        return self._seqs.get(conversation_id)

    def set(self, conversation_id: str, seq: int) -> None:
        if self._seqs.get(conversation_id) == seq:
            return
        self._seqs[conversation_id] = seq
        self._save()

    def forget(self, conversation_id: str) -> None:
        if self._seqs.pop(conversation_id, None) is not None:
            self._save()

    def _save(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=self._path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._seqs, f)
            os.replace(tmp, self._path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
