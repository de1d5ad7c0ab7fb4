"""Keep a local Ray head from outliving the process that started it.

    python -m moe_operator.standalone.watchdog PARENT_PID -- ray start --head --block ...

Run as the leader of the head's own process group (the caller starts it with a new session): it
starts the command in that group and watches PARENT_PID. When the parent is gone (it exited, or
was SIGKILLed and could not clean up) it ends the whole group: SIGTERM, then SIGKILL two seconds
later (Ray's raylet, GCS, dashboard and workers all live in this group). When the command exits
on its own, the watchdog exits with its code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil


def parent_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def end_group(grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, to the group and to every descendant (Ray's workers may have left
    the group; they are taken while still descendants)."""
    group = os.getpgrp()
    me = psutil.Process()
    tree = {c.pid for c in me.children(recursive=True)}
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ourselves: stay to send the SIGKILL
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM:
            os.killpg(group, sig)
            time.sleep(grace_s)
    os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m moe_operator.standalone.watchdog PARENT_PID -- COMMAND ...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    child = subprocess.Popen(argv[2:])
    # a SIGTERM to the group (a clean stop) reaches the child too; the watchdog just follows it
    signal.signal(signal.SIGTERM, lambda *_: None)
    while True:
        code = child.poll()
        if code is not None:
            return code
        if not parent_alive(parent):
            end_group()
            return 1
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
