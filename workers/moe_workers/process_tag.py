"""One process, named so that a reused pid does not pass for it: "pid:start time"."""

from __future__ import annotations


def process_tag(pid: int | None = None) -> str:
    """This process' tag (or pid's)."""
    import psutil

    p = psutil.Process(pid)
    return f"{p.pid}:{p.create_time():.2f}"


def tag_running(tag: str) -> bool:
    """Whether the process `tag` names still runs (the same process: a reused pid has another start time)."""
    import psutil

    try:
        pid, started = tag.split(":", 1)
        return f"{psutil.Process(int(pid)).create_time():.2f}" == started
    except (ValueError, psutil.Error):
        return False
