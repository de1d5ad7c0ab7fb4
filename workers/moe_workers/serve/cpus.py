"""CPUs of their own for expert shard replicas: each replica on a machine takes CPUs that no
other live replica holds, and runs all its threads there.

Why: a decode layer whose two picked experts sit in two groups should have both shards compute
at once. Left to the kernel, the second shard woken is often queued on the CPU the first one
was just sent to, and waits for it while another CPU idles (the wake-up picks a CPU before the
first shard runs, and a CPU whose idle spells are short skips pulling queued work). With each
shard replica on a CPU of its own, the two parts run side by side (docs/benchmarks.md).

How: the machine's replicas record what they hold in one small JSON file, under an exclusive
flock: {process tag ("pid:start time"): [cpus]}. A claim lapses when its process is gone (or the
pid now names another process). A replica takes `n` CPUs of its allowed set
(`os.sched_getaffinity`: a container's cpuset, Kubernetes' static CPU manager's exclusive CPUs)
that no live claim holds, lowest first; when fewer are free it takes none and the kernel places
it, as without this. The ingress is not pinned: it is the busiest process on the decode path and
goes wherever a CPU is free.

The claims file is shared by the processes that share a temp directory: on a machine, or in one
container. Containers on one node that see the same CPUs do not see each other's claims, so a
process under a CPU quota smaller than the CPUs it may run on (a Pod with a CPU limit, in the
node's shared pool) takes none: its neighbours would pin the same low CPUs. A cpuset of its own
(Kubernetes' static CPU manager policy gives Guaranteed Pods exclusive CPUs) has a quota no
smaller than its CPUs, and is pinned within.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path

from moe_workers.process_tag import process_tag, tag_running

CLAIMS_ENV = "MOE_CPU_CLAIMS"  # where the claims file lives (processes of one pid namespace); default: the temp dir


def claims_path() -> Path:
    return Path(os.environ.get(CLAIMS_ENV) or Path(tempfile.gettempdir()) / "moe-cpu-claims.json")


def quota_cpus(root: Path = Path("/sys/fs/cgroup"), own: str | None = None) -> float | None:
    """This process' CPU quota in CPUs (the smallest along its cgroup's ancestors; cgroup v2's
    cpu.max or v1's cpu.cfs_quota_us), or None when there is none."""
    try:
        own = own if own is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    found: list[float] = []
    for line in own.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            dirs, read = [root, root / "unified"], _v2_quota
        elif "cpu" in controllers.split(","):
            dirs, read = [root / controllers, root / "cpu", root / "cpu,cpuacct"], _v1_quota
        else:
            continue
        for base in dirs:
            d = base / path.lstrip("/")
            while True:
                q = read(d)
                if q is not None:
                    found.append(q)
                if d == base or base not in d.parents:
                    break
                d = d.parent
    return min(found) if found else None


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 else quota / period


def choose(allowed: list[int], held: set[int], n: int) -> list[int] | None:
    """The `n` lowest CPUs of `allowed` nobody holds, or None when fewer than n are free."""
    free = sorted(c for c in set(allowed) if c not in held)
    return free[:n] if n >= 1 and len(free) >= n else None


def live_claims(claims: dict, running=tag_running) -> dict[str, list[int]]:
    """The claims whose process still runs (the same process: tag_running)."""
    out = {}
    for tag, cpus in claims.items():
        try:
            if running(tag):
                out[tag] = [int(c) for c in cpus]
        except (ValueError, TypeError):
            continue  # a malformed entry lapses
    return out


class CpuClaim:
    """This process' claim on CPUs of its own (see the module's docstring)."""

    def __init__(self, path: Path | None = None, quota=quota_cpus):
        self.path = path or claims_path()
        self.tag = process_tag()  # this process, in the claims file
        self._quota = quota
        self.cpus: list[int] | None = None
        self.reason = ""  # why no CPUs were taken, when none were

    def take(self, n: int) -> list[int] | None:
        """Claim n free CPUs and run every thread of this process on them (threads started later
        inherit it). Returns the CPUs, or None (then `reason` says why)."""
        try:
            allowed = sorted(os.sched_getaffinity(0))
            quota = self._quota()
            if quota is not None and quota < len(allowed):
                self.reason = (f"a CPU quota of {quota:g} over {len(allowed)} shared CPUs: placed by the kernel "
                               f"(pinned, it could share its CPU with a neighbour's)")
                return None
            with _locked(self.path) as f:
                claims = live_claims(_read(f))
                claims.pop(self.tag, None)
                held = {c for cpus in claims.values() for c in cpus}
                cpus = choose(allowed, held, n)
                if cpus is None:
                    self.reason = (f"{len(allowed) - len(held & set(allowed))} of CPUs {allowed} free for {n}: "
                                   f"placed by the kernel")
                    _write(f, claims)
                    return None
                claims[self.tag] = cpus
                _write(f, claims)
            pin_process(cpus)
        except OSError as err:
            self.reason = f"{type(err).__name__}: {err}"
            return None
        self.cpus, self.reason = cpus, ""
        return cpus

    def release(self) -> None:
        """Give the CPUs back (a stopping replica); a process that exits without it loses its
        claim anyway."""
        if self.cpus is None:
            return
        try:
            with _locked(self.path) as f:
                claims = live_claims(_read(f))
                claims.pop(self.tag, None)
                _write(f, claims)
        except OSError:
            pass
        self.cpus = None

    def status(self) -> dict:
        return {"cpus": self.cpus, "reason": self.reason}


@contextlib.contextmanager
def _locked(path: Path):
    """The claims file, open for reading and writing under an exclusive flock (closing drops it)."""
    with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield f


def _read(f) -> dict:
    f.seek(0)
    try:
        data = json.loads(f.read() or "{}")
    except ValueError:
        return {}  # a torn or foreign file: start over
    return data if isinstance(data, dict) else {}


def _write(f, claims: dict) -> None:
    f.seek(0)
    f.truncate()
    f.write(json.dumps(claims))
    f.flush()


def pin_process(cpus: list[int], pid: int | str = "self") -> None:
    """Every thread of a process (this one by default) onto `cpus` (sched_setaffinity is per
    thread on Linux)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended, or one we may not move
