#!/usr/bin/env python3
"""A linger command agent (protocol §9 and §11) whose turns are long jobs
that survive a restart of linger. Standard library only.

    [agent]
    kind = "command"
    command = ["python3", "examples/agents/checkpoint_agent.py"]
    resume_interrupted = true

A turn is a job of several steps. After each step the agent writes a
checkpoint in its workspace (its working directory, which outlives the
process), then reports the step. When linger runs an interrupted turn again
(a crash, a shutdown; the turn line then says `"resumed": true`), the agent
continues after the last step it checkpointed instead of starting over.

    /steps N MS     a job of N steps of MS milliseconds each
    anything else   CHECKPOINT_AGENT_STEPS steps (default 10) of
                    CHECKPOINT_AGENT_STEP_MS milliseconds (default 500)

Each step streams one line, `step I of N done`; a resumed turn first says
`continuing after step K of N`. The whole text is then sent as
`assistant_message`.

`checkpoint.json` holds {"text", "step", "steps"} of the job under way. It
is written whole (a temporary file renamed over it), so a kill never leaves
half of one, and only a job with the same text continues from it. It is
removed when a job completes, and kept when a turn is stopped: linger sends
`stop` before closing the agent's input at a shutdown too, and runs a turn
again only if it was interrupted, so a stopped job is never continued by
mistake (a new turn starts afresh). Every turn the agent is given is
appended to `turns.log` (turn id, `new` or `resumed`, text).
"""

import json
import os
import queue
import sys
import threading
import time

CHECKPOINT = "checkpoint.json"
DEFAULT_STEPS = int(os.environ.get("CHECKPOINT_AGENT_STEPS", "10"))
DEFAULT_STEP_MS = int(os.environ.get("CHECKPOINT_AGENT_STEP_MS", "500"))


class EndOfInput(Exception):
    """linger closed our input: the conversation stopped (or linger died)."""


def emit(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def log(text):
    try:
        print(f"checkpoint_agent[{os.getpid()}]: {text}", file=sys.stderr, flush=True)
    except OSError:
        pass  # linger is gone, and its end of our stderr with it


def read_stdin(inbox):
    """Reads linger's lines in a thread, so that a step can be cut short."""
    for line in sys.stdin:
        try:
            inbox.put(json.loads(line))
        except ValueError:
            continue  # a blank line, or not JSON: nothing for us
    inbox.put(None)


def job(text):
    """(steps, seconds per step) of a message."""
    words = text.split()
    if len(words) == 3 and words[0] == "/steps" and words[1].isdigit() and words[2].isdigit():
        return int(words[1]), int(words[2]) / 1000.0
    return DEFAULT_STEPS, DEFAULT_STEP_MS / 1000.0


def load_checkpoint():
    try:
        with open(CHECKPOINT, encoding="utf-8") as f:
            saved = json.load(f)
        return saved if isinstance(saved, dict) else None
    except (OSError, ValueError):
        return None


def save_checkpoint(text, step, steps):
    tmp = CHECKPOINT + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"text": text, "step": step, "steps": steps}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, CHECKPOINT)


def stopped_while_working(inbox, turn_id, seconds):
    """Works for `seconds` (here: waits); True if linger stops the turn
    meanwhile. Raises EndOfInput when linger closes our input."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            message = inbox.get(timeout=left)
        except queue.Empty:
            return False
        if message is None:
            raise EndOfInput()
        if message.get("type") == "stop" and message.get("turn_id") == turn_id:
            return True


def run_turn(inbox, turn):
    turn_id = turn.get("turn_id")
    text = turn.get("text", "")
    resumed = turn.get("resumed") is True
    with open("turns.log", "a", encoding="utf-8") as f:
        f.write(f"{turn_id}\t{'resumed' if resumed else 'new'}\t{text}\n")
    steps, seconds = job(text)
    reply = []

    def say(line):
        reply.append(line)
        emit(kind="text_delta", text=line)

    done = 0
    saved = load_checkpoint() if resumed else None
    if saved and saved.get("text") == text and saved.get("steps") == steps:
        step = saved.get("step")
        done = step if isinstance(step, int) and 0 <= step <= steps else 0
        say(f"continuing after step {done} of {steps}\n")
    for step in range(done + 1, steps + 1):
        if stopped_while_working(inbox, turn_id, seconds):
            emit(kind="turn_finished", status="completed")
            return
        # Checkpoint first: a step reported is a step that will not be
        # done again.
        save_checkpoint(text, step, steps)
        say(f"step {step} of {steps} done\n")
    emit(kind="assistant_message", text="".join(reply))
    emit(kind="turn_finished", status="completed")
    try:
        os.remove(CHECKPOINT)
    except OSError:
        pass


def main():
    inbox = queue.Queue()
    threading.Thread(target=read_stdin, args=(inbox,), daemon=True).start()
    try:
        while True:
            message = inbox.get()
            if message is None:
                break
            if message.get("type") == "turn":
                run_turn(inbox, message)
    except (EndOfInput, BrokenPipeError):
        pass  # linger stopped the conversation, or is gone
    log("input closed, exiting")


if __name__ == "__main__":
    main()
