"""A Ray backend that only renders: it keeps the Serve config it is given in a file instead of
deploying it. For benchmarking the control plane without Ray (bench/control_plane.py) and for
inspecting exactly what would be applied. A ServeBackend (backends/serve_backend.py), as
RayServeClient is."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RenderOnlyClient:
    directory: str
    puts: int = 0  # config writes made, as RayServeClient counts them
    write_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def dashboard_url(self) -> str:
        return f"render-only://{self.directory}"

    def _file(self) -> Path:
        return Path(self.directory) / "serve-config.json"

    def get(self) -> dict:
        try:
            config = json.loads(self._file().read_text())
        except FileNotFoundError:
            config = {"applications": []}
        return {"applications": {a["name"]: {"name": a["name"], "status": "RUNNING", "route_prefix": a.get("route_prefix"),
                                             "deployed_app_config": a} for a in config.get("applications", [])}}

    def put(self, config: dict) -> None:
        self.puts += 1
        path = self._file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(config))
        tmp.replace(path)

    def delete_all(self) -> None:
        self.put({"applications": []})

    def wait_running(self, names: list[str], timeout_s: float = 0) -> dict:
        return self.get()

    def wait_gone(self, name: str, timeout_s: float = 0) -> None:
        return None

    def nodes(self) -> list[dict] | None:
        return None  # no Ray: nobody can say where a pinned group would run
