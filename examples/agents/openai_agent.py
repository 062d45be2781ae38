#!/usr/bin/env python3
"""A linger command agent (protocol §9) that answers with any
OpenAI-compatible chat-completions endpoint. Standard library only.

    [agent]
    kind = "command"
    command = ["python3", "examples/agents/openai_agent.py"]

Environment:

    OPENAI_BASE_URL   default https://api.openai.com/v1 (any compatible
                      server: vLLM, llama.cpp, Ollama's /v1, ...)
    OPENAI_MODEL      default gpt-4o-mini
    OPENAI_API_KEY    sent as a bearer token when set
    OPENAI_SYSTEM_PROMPT  optional system message
    OPENAI_TIMEOUT    seconds to wait for the endpoint, default 120

Each reply is streamed (`"stream": true`): one `text_delta` per chunk, then
the whole reply as `assistant_message`. The conversation's history lives in
memory and in `history.json` in the conversation's workspace (its working
directory), so it survives the process being stopped and started again.
An HTTP or network error fails the turn with the error text. A `stop` ends
the turn at once; the part of the reply already streamed is kept.
"""

import json
import os
import queue
import sys
import threading
import urllib.error
import urllib.request

BASE_URL = os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1").rstrip("/")
MODEL = os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
API_KEY = os.environ.get("OPENAI_API_KEY", "")
SYSTEM_PROMPT = os.environ.get("OPENAI_SYSTEM_PROMPT", "")
TIMEOUT = float(os.environ.get("OPENAI_TIMEOUT", "120"))
HISTORY_FILE = "history.json"


def emit(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def log(text):
    print(f"openai_agent[{os.getpid()}]: {text}", file=sys.stderr, flush=True)


def load_history():
    try:
        with open(HISTORY_FILE, encoding="utf-8") as f:
            history = json.load(f)
        if isinstance(history, list):
            return history
        log(f"{HISTORY_FILE} is not a list; starting afresh")
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        log(f"cannot read {HISTORY_FILE} ({e}); starting afresh")
    return []


def save_history(history):
    # Written whole and renamed over the old one, so a kill mid-write never
    # leaves a half file behind.
    tmp = HISTORY_FILE + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(history, f, ensure_ascii=False, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, HISTORY_FILE)


def read_stdin(inbox):
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            inbox.put(("linger", json.loads(line)))
        except ValueError:
            log(f"ignoring a line that is not JSON: {line[:80]!r}")
    inbox.put(("linger", None))


def stream_completion(messages, turn_id, inbox, cancelled):
    """Runs in a thread: posts the request and puts each streamed piece of
    text on the inbox, then ("done", ...) or ("error", ...)."""
    body = {"model": MODEL, "messages": messages, "stream": True}
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if API_KEY:
        headers["Authorization"] = f"Bearer {API_KEY}"
    request = urllib.request.Request(
        f"{BASE_URL}/chat/completions",
        data=json.dumps(body).encode("utf-8"),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            for raw in response:
                if cancelled.is_set():
                    return
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if isinstance(chunk, dict) and chunk.get("error"):
                    inbox.put(("error", turn_id, f"the endpoint reported: {chunk['error']}"))
                    return
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        inbox.put(("chunk", turn_id, text))
        inbox.put(("done", turn_id, None))
    except urllib.error.HTTPError as e:
        try:
            detail = e.read().decode("utf-8", errors="replace")
        except OSError:
            detail = ""
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        inbox.put(("error", turn_id, f"HTTP {e.code} from {BASE_URL}: {str(detail)[:500] or e.reason}"))
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        inbox.put(("error", turn_id, f"cannot reach {BASE_URL}: {reason}"))


def run_turn(history, turn_id, text, inbox):
    """Returns False when linger closed our input."""
    history.append({"role": "user", "content": text})
    messages = list(history)
    if SYSTEM_PROMPT:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    cancelled = threading.Event()
    threading.Thread(
        target=stream_completion, args=(messages, turn_id, inbox, cancelled), daemon=True
    ).start()
    reply = []
    while True:
        item = inbox.get()
        source = item[0]
        if source == "linger":
            message = item[1]
            stopped = message is not None and (
                message.get("type") == "stop" and message.get("turn_id") == turn_id
            )
            if message is None or stopped:
                # Closed or stopped mid-reply: keep what was streamed (the
                # user saw it); with nothing streamed, drop the question so
                # the history stays an alternation of user and assistant.
                cancelled.set()
                if reply:
                    history.append({"role": "assistant", "content": "".join(reply)})
                else:
                    history.pop()
                save_history(history)
                if stopped:
                    emit(kind="turn_finished", status="completed")
                return stopped
            continue  # no tools: nothing else concerns this turn
        if item[1] != turn_id:
            continue  # a late piece of a stopped turn's request
        if source == "chunk":
            reply.append(item[2])
            emit(kind="text_delta", text=item[2])
        elif source == "done":
            full = "".join(reply)
            history.append({"role": "assistant", "content": full})
            save_history(history)
            emit(kind="assistant_message", text=full)
            emit(kind="turn_finished", status="completed")
            return True
        elif source == "error":
            # Keep the history a clean alternation: the failed question goes.
            history.pop()
            save_history(history)
            log(item[2])
            emit(kind="turn_finished", status="failed", error=item[2])
            return True


def main():
    history = load_history()
    log(f"started with {len(history)} messages of history, model {MODEL} at {BASE_URL}")
    inbox = queue.Queue()
    threading.Thread(target=read_stdin, args=(inbox,), daemon=True).start()
    while True:
        item = inbox.get()
        if item[0] != "linger":
            continue  # a late piece of a stopped turn's request
        message = item[1]
        if message is None:
            break
        if message.get("type") != "turn":
            continue
        if not run_turn(history, message.get("turn_id"), message.get("text", ""), inbox):
            break
    log("input closed, exiting")


if __name__ == "__main__":
    main()
