"""A local Ray head on loopback, with the dashboard (Serve REST API) and token authentication.

Used by standalone mode (`moectl up` with no Ray address) and by the tests. The head runs as
`ray start --head --block` in its own process session, so stopping it kills exactly the
processes it started (by process group id), never other Ray clusters on the machine.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from moe_workers.serve.proxy.gate import CALLBACK, CALLBACK_ENV

# Ray reserves 10002-19999 for workers by default; our servers stay outside that range and the
# workers get a narrowed range of their own.
_WORKER_PORTS = (20000, 29999)


_handed_out: set[int] = set()


def ephemeral_ports() -> range:
    """The kernel's range for the source ports of outgoing connections (ip_local_port_range)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port(avoid: range = range(10002, 30000)) -> int:
    """A free TCP port outside Ray's worker port range and outside the kernel's ephemeral range,
    never one this process has handed out before (several are chosen before anything binds
    them). Not from the ephemeral range: between this choice and the server's bind, any
    outgoing connection on the machine could take such a port as its source port (a Ray head's
    runtime-env agent once failed to bind so, and the head with it)."""
    ephemeral = ephemeral_ports()
    candidates = [p for p in range(30000, 65536) if p not in avoid and p not in ephemeral and p not in _handed_out]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address: a listener on any of them would refuse the server
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free TCP port outside Ray's worker range and the ephemeral range")


@dataclass
class LocalRayHead:
    """A Ray head started by us; `start()` then `stop()`."""

    work_dir: Path
    num_cpus: int | None = None
    labels: dict[str, str] = field(default_factory=dict)  # Ray node labels (spec.experts.groupNodes pins by them)
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    serve_http_port: int = field(default_factory=free_port)
    metrics_export_port: int = field(default_factory=free_port)
    # every other listener Ray starts gets an explicit port too: left to Ray, one of them may take
    # the Serve HTTP port, which nothing binds until the first application is deployed
    internal_ports: dict[str, int] = field(default_factory=lambda: {
        flag: free_port() for flag in ("--node-manager-port", "--object-manager-port",
                                       "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                                       "--runtime-env-agent-port", "--ray-client-server-port")})
    token: str = field(default_factory=lambda: secrets.token_hex(24))
    process: subprocess.Popen | None = None

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def metrics_url(self) -> str:
        """Prometheus endpoint of this node's metrics (Ray's export, ours included)."""
        return f"http://127.0.0.1:{self.metrics_export_port}/metrics"

    @property
    def token_path(self) -> Path:
        return self.work_dir / "auth_token"

    def client_env(self) -> dict[str, str]:
        """Environment for processes that talk to this head (ray.init, serve, the Ray CLI)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
                "RAY_ADDRESS": self.gcs_address}

    def connect_driver(self, namespace: str | None = None):
        """ray.init() this process against the head (token auth included); returns the ray module."""
        os.environ.update(self.client_env())
        import ray
        from ray._raylet import AuthenticationTokenLoader, Config

        # Ray caches its config (the auth mode) and the token it saw first; this process may have
        # loaded both before the head existed (building a Serve app does), so read them again
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
        ray.init(address=self.gcs_address, namespace=namespace, log_to_driver=False)
        return ray

    def auth_headers(self) -> dict[str, str]:
        return {"x-ray-authorization": f"Bearer {self.token}"}

    def start(self, timeout_s: float = 120.0, parent_pid: int | None = None,
              stopping=None) -> "LocalRayHead":
        """Start the head in a process group of its own. `parent_pid`: a watchdog in that group
        ends it when that process is gone (SIGKILL included). `stopping()`: give up (and stop
        what started) as soon as it is true."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.token_path.write_text(self.token)
        self.token_path.chmod(0o600)
        # Ray's temp dir ends up in unix socket paths (limit 107 bytes): keep it short.
        temp_dir = Path("/tmp") / f"moe-ray-{os.getpid()}-{self.gcs_port}"
        cmd = [
            str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
            "--node-ip-address", "127.0.0.1",
            "--port", str(self.gcs_port),
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
            "--include-dashboard", "true",
            "--metrics-export-port", str(self.metrics_export_port),
            "--min-worker-port", str(_WORKER_PORTS[0]), "--max-worker-port", str(_WORKER_PORTS[1]),
            "--temp-dir", str(temp_dir),
            "--disable-usage-stats",
        ]
        for flag, port in self.internal_ports.items():
            cmd += [flag, str(port)]
        if self.num_cpus is not None:
            cmd += ["--num-cpus", str(self.num_cpus)]
        if self.labels:
            cmd += ["--labels", ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))]
        if parent_pid is not None:
            cmd = [sys.executable, "-m", "moe_operator.standalone.watchdog", str(parent_pid), "--", *cmd]
        # Serve names a replica it cannot place after RAY_SERVE_SLOW_STARTUP_WARNING_S (30 s by
        # default); on a one-node local head nothing will come to place it later, so say it sooner.
        # Serve's proxy admits requests through moe_workers.serve.proxy.gate (a user's value wins).
        env = {"RAY_SERVE_SLOW_STARTUP_WARNING_S": "5", CALLBACK_ENV: CALLBACK, **os.environ, **self.client_env(),
               "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS")
        log = open(self.work_dir / "ray-head.log", "wb")
        self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        (self.work_dir / "head.pgid").write_text(str(self.process.pid))  # for `moectl up` to find leftovers
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if stopping is not None and stopping():
                self.stop(timeout_s=2.0)
                raise KeyboardInterrupt
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"ray start exited with {self.process.returncode}; see {self.work_dir / 'ray-head.log'}"
                )
            if self._dashboard_ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"Ray dashboard not ready after {timeout_s:.0f} s; see {self.work_dir / 'ray-head.log'}")

    def _dashboard_ready(self) -> bool:
        req = urllib.request.Request(self.dashboard_url + "/api/version", headers=self.auth_headers())
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the head's process group, then SIGKILL whatever of it is still alive."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the group id is the leader's pid
        # Ray's workers (the Serve proxy, replicas) are the raylet's children but may not stay in
        # its group: taken now, while they are still its descendants
        tree = head_tree(pgid)
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            signal_all(pgid, tree, sig)
            deadline = time.monotonic() + wait_s
            while (live_group_members(pgid) or _alive(tree)) and time.monotonic() < deadline:
                time.sleep(0.1)
            try:
                self.process.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if not live_group_members(pgid) and not _alive(tree):
                break
        self.process = None
        with contextlib.suppress(OSError):
            (self.work_dir / "head.pgid").unlink()


def end_leftover_heads(state_dir: Path, log=print) -> list[int]:
    """Process groups of local heads that earlier `moectl up` runs under `state_dir` started and
    that outlived them (their directory is `ray-<moectl pid>`, the group in its head.pgid): ended
    with SIGKILL when that moectl is gone. Returns the groups ended."""
    import psutil

    ended = []
    for pgid_file in sorted(state_dir.glob("ray-*/head.pgid")):
        try:
            owner = int(pgid_file.parent.name.removeprefix("ray-"))
            pgid = int(pgid_file.read_text())
        except (ValueError, OSError):
            continue
        if psutil.pid_exists(owner) or not live_group_members(pgid):
            continue
        log(f"ending the local Ray head of an earlier moectl up (pid {owner}, gone): process group {pgid}")
        tree = head_tree(pgid)
        signal_all(pgid, tree, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (live_group_members(pgid) or _alive(tree)) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            pgid_file.unlink()
        ended.append(pgid)
    return ended


def port_holder(port: int, host: str = "127.0.0.1") -> str | None:
    """Who listens on host:port (or on every address), as 'pid N (command)'; None when free.
    'an unknown process' when the port is taken but its owner cannot be seen."""
    import socket

    import psutil

    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and \
                    c.laddr.ip in (host, "0.0.0.0", "::", "::1" if host == "127.0.0.1" else host):
                if c.pid:
                    try:
                        p = psutil.Process(c.pid)
                        return f"pid {c.pid} ({' '.join(p.cmdline())[:200] or p.name()})"
                    except psutil.Error:
                        return f"pid {c.pid}"
                return "an unknown process"
    except psutil.Error:
        pass
    with socket.socket() as s:  # without the rights to list connections: try to bind
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # old connections in TIME_WAIT do not count
        try:
            s.bind((host, port))
        except OSError:
            return "an unknown process"
    return None


def head_tree(pgid: int) -> set[int]:
    """The head's processes: its group, and every descendant of them (Ray workers)."""
    import psutil

    pids = set(live_group_members(pgid))
    for pid in list(pids):
        with contextlib.suppress(psutil.Error):
            pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    return pids


def signal_all(pgid: int, pids: set[int], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _alive(pids: set[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are still running (zombies waiting for a reaper don't count)."""
    import psutil

    alive = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return alive
