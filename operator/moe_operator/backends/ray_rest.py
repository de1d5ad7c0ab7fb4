"""Ray dashboard REST client for Serve applications (PUT/GET/DELETE /api/serve/applications/).

Token authentication is on by default in Ray: every request carries
`x-ray-authorization: Bearer <token>`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import requests

from .serve_status import start_failure_message, unschedulable_message


class RayServeError(RuntimeError):
    pass


class ReplicaStartFailed(RayServeError):
    """Replicas of the application raise in their constructor (the message names the deployment
    and the exception)."""


class Unschedulable(RayServeError):
    """Ray reports replicas of the application that it cannot place (the message says what they
    need and what the cluster has)."""


@dataclass
class RayServeClient:
    dashboard_url: str
    token: str | None = None
    timeout_s: float = 30.0
    puts: int = 0  # config writes made (bench/control_plane.py counts them per pass)
    # held across a read-merge-write of the cluster's Serve config (moe_operator.reconcile);
    # RayClients gives every client of one cluster the same lock
    write_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _headers(self) -> dict[str, str]:
        return {"x-ray-authorization": f"Bearer {self.token}"} if self.token else {}

    def _url(self) -> str:
        return self.dashboard_url.rstrip("/") + "/api/serve/applications/"

    def get(self) -> dict:
        resp = requests.get(self._url(), headers=self._headers(), timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RayServeError(f"GET {self._url()}: {resp.status_code} {resp.text[:300]}")
        return resp.json()

    def put(self, config: dict) -> None:
        """Replace the cluster's whole Serve config (every application)."""
        self.puts += 1
        resp = requests.put(self._url(), json=config, headers=self._headers(), timeout=self.timeout_s * 2)
        if resp.status_code != 200:
            raise RayServeError(f"PUT {self._url()}: {resp.status_code} {resp.text[:500]}")

    def nodes(self) -> list[dict]:
        """Ray's nodes (state, labels, resources_total), from the dashboard's state API."""
        url = self.dashboard_url.rstrip("/") + "/api/v0/nodes?limit=10000&detail=true"
        resp = requests.get(url, headers=self._headers(), timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RayServeError(f"GET {url}: {resp.status_code} {resp.text[:300]}")
        return ((resp.json().get("data") or {}).get("result") or {}).get("result") or []

    def delete_all(self) -> None:
        resp = requests.delete(self._url(), headers=self._headers(), timeout=self.timeout_s * 2)
        if resp.status_code != 200:
            raise RayServeError(f"DELETE {self._url()}: {resp.status_code} {resp.text[:300]}")

    def wait_gone(self, name: str, timeout_s: float = 120.0) -> None:
        """Until `name` is no longer listed (Serve shows a removed app as DELETING for a while)."""
        deadline = time.monotonic() + timeout_s
        while name in self.get().get("applications", {}):
            if time.monotonic() > deadline:
                raise RayServeError(f"application {name} still present {timeout_s:.0f} s after removal")
            time.sleep(0.5)

    def wait_running(self, names: list[str], timeout_s: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout_s
        status: dict = {}
        while time.monotonic() < deadline:
            status = self.get()
            apps = status.get("applications", {})
            states = {n: apps.get(n, {}).get("status") for n in names}
            failed = {n: apps[n].get("message", "") for n, s in states.items() if s == "DEPLOY_FAILED"}
            starts = [m for n in failed if (m := start_failure_message(n, apps[n]))]
            if starts:
                raise ReplicaStartFailed("; ".join(starts))
            if failed:
                raise RayServeError(f"deploy failed: {failed}")
            stuck = [m for n in names if (m := unschedulable_message(n, apps.get(n) or {}))]
            if stuck:
                raise Unschedulable("; ".join(stuck))
            if all(s == "RUNNING" for s in states.values()):
                return status
            time.sleep(0.5)
        raise RayServeError(f"applications {names} not RUNNING after {timeout_s:.0f} s: "
                            f"{ {n: a.get('status') for n, a in status.get('applications', {}).items()} }")


class RayClients:
    """The operator's clients for its lifetime: one per (dashboard, token), and one write lock per
    dashboard shared by them (a rotated token makes a new client of the same cluster)."""

    def __init__(self):
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._clients: dict[tuple[str, str | None], RayServeClient] = {}

    def get(self, address: str, token: str | None) -> RayServeClient:
        with self._guard:
            client = self._clients.get((address, token))
            if client is None:
                lock = self._locks.setdefault(address.rstrip("/"), threading.Lock())
                client = self._clients[(address, token)] = RayServeClient(address, token, write_lock=lock)
            return client
