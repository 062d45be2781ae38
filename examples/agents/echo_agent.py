#!/usr/bin/env python3
"""A minimal linger command agent (protocol §9), standard library only.

Run it with:

    [agent]
    kind = "command"
    command = ["python3", "examples/agents/echo_agent.py"]

linger starts one process per active conversation, in the conversation's
workspace directory, and talks JSON lines on stdin/stdout:

    to the agent:   {"type":"turn","turn_id","text"}
                    {"type":"tool_result","call_id","output","is_error"}
                    {"type":"stop","turn_id"}
    from the agent: {"kind":"text_delta","text"}
                    {"kind":"assistant_message","text"}
                    {"kind":"tool_call","call_id","name","args"}
                    {"kind":"turn_finished","status":"completed"|"failed","error"?}

For each turn this agent appends a line to `turns.log` in its workspace (so
you can see that the workspace outlives the process), streams the words of
the message back one `text_delta` at a time, then sends the whole reply as
`assistant_message` and finishes the turn.

`/ask NAME [JSON]` makes a client tool call instead and replies with what
the client answered. A `stop` ends the current turn early. Stderr goes to
linger's log. `ECHO_AGENT_DELAY_MS` (default 0) paces the words.
"""

import json
import os
import queue
import sys
import threading
import time

DELAY = float(os.environ.get("ECHO_AGENT_DELAY_MS", "0")) / 1000.0


def emit(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def log(text):
    print(f"echo_agent[{os.getpid()}]: {text}", file=sys.stderr, flush=True)


def read_stdin(inbox):
    """Reads linger's lines in a thread, so a turn can notice a `stop`
    while it is still streaming."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            inbox.put(json.loads(line))
        except ValueError:
            log(f"ignoring a line that is not JSON: {line[:80]!r}")
    inbox.put(None)  # end of input: linger closed the conversation


class Stopped(Exception):
    pass


class EndOfInput(Exception):
    pass


def check_inbox(inbox, held, turn_id, block=False):
    """Returns the next tool result; raises Stopped when linger stops this
    turn. Without `block`, returns None when nothing is waiting. Anything
    else (the next turn) is held for the main loop."""
    while True:
        try:
            message = inbox.get(block=block)
        except queue.Empty:
            return None
        if message is None:
            raise EndOfInput()
        kind = message.get("type")
        if kind == "stop":
            if message.get("turn_id") == turn_id:
                raise Stopped()
        elif kind == "tool_result":
            return message
        else:
            held.append(message)


def run_turn(inbox, held, turn_id, text, calls):
    with open("turns.log", "a", encoding="utf-8") as f:
        f.write(f"{turn_id}\t{text}\n")
    words = text.split()
    if words and words[0] == "/ask" and len(words) >= 2:
        name = words[1]
        raw = text.split(None, 2)[2] if len(words) > 2 else "{}"
        try:
            args = json.loads(raw)
        except ValueError:
            args = {"text": raw}
        calls[0] += 1
        call_id = f"call_{os.getpid()}_{calls[0]}"
        emit(kind="tool_call", call_id=call_id, name=name, args=args)
        while True:
            message = check_inbox(inbox, held, turn_id, block=True)
            if message.get("type") == "tool_result" and message.get("call_id") == call_id:
                output = json.dumps(message.get("output"), separators=(",", ":"))
                reply = f"{name} returned {output}"
                if message.get("is_error"):
                    reply += " (an error)"
                emit(kind="assistant_message", text=reply)
                emit(kind="turn_finished", status="completed")
                return
    for i, word in enumerate(words):
        check_inbox(inbox, held, turn_id)
        if i > 0 and DELAY:
            time.sleep(DELAY)
        emit(kind="text_delta", text=word if i == len(words) - 1 else word + " ")
    emit(kind="assistant_message", text=" ".join(words))
    emit(kind="turn_finished", status="completed")


def main():
    log(f"started for conversation {os.environ.get('LINGER_CONVERSATION_ID')} "
        f"of {os.environ.get('LINGER_USER')} in {os.getcwd()}")
    inbox = queue.Queue()
    threading.Thread(target=read_stdin, args=(inbox,), daemon=True).start()
    held = []
    calls = [0]
    while True:
        message = held.pop(0) if held else inbox.get()
        if message is None:
            break
        if message.get("type") != "turn":
            continue  # a stop or tool result for a turn already over
        turn_id = message.get("turn_id")
        try:
            run_turn(inbox, held, turn_id, message.get("text", ""), calls)
        except Stopped:
            # linger has recorded the turn as stopped; finishing it tells
            # linger this process is free for the next one.
            emit(kind="turn_finished", status="completed")
        except EndOfInput:
            break
    log("input closed, exiting")


if __name__ == "__main__":
    main()
