"""The operator's settings, read once when it starts (pure: a mapping in, a frozen object out).

The Helm chart sets them as environment variables (docs/reference/operator-settings.md):
  MOE_RAY_ADDRESS       default Ray dashboard URL when a spec names none
  MOE_RAY_TOKEN_FILE    file with the Ray dashboard token (or MOE_RAY_TOKEN)
  MOE_ALLOWED_ROOTS     colon-separated directories models and weights may be read from
  MOE_SERVE_HTTP_PORT   Serve proxy port on the Ray cluster (default 8000)
  MOE_SERVE_HTTP_HOST   address the Serve proxy binds when the operator starts Serve (default
                        127.0.0.1; the Helm chart sets 0.0.0.0, for Ray clusters in Pods)
  MOE_ENDPOINT_HOST     host written into status.endpoint (default 127.0.0.1)
  MOE_METRICS_PORT      serve the operator's Prometheus metrics on MOE_METRICS_HOST:PORT when set
  MOE_METRICS_HOST      address for the metrics (default 127.0.0.1; the Helm chart sets 0.0.0.0 in the Pod)
  MOE_RAY_BACKEND       render-only: keep the Serve config in MOE_RENDER_ONLY_DIR instead of deploying

The standalone runner builds the same object from its own arguments; a reconcile pass reads only
what it needs from it (roots, the proxy's port and host, the endpoint's host).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

RENDER_ONLY = "render-only"
BACKENDS = ("", RENDER_ONLY)  # "": the Ray REST API


class SettingsError(ValueError):
    """An environment variable the operator cannot use; the message names it."""


@dataclass(frozen=True)
class Settings:
    allowed_roots: tuple[str, ...] = ()
    serve_http_port: int = 8000
    serve_http_host: str = "127.0.0.1"
    endpoint_host: str = "127.0.0.1"
    ray_address: str = ""
    ray_token_file: str = ""
    ray_token: str = ""
    ray_backend: str = ""
    render_only_dir: str = "/tmp/moe-render-only"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "Settings":
        backend = env.get("MOE_RAY_BACKEND", "")
        if backend not in BACKENDS:
            raise SettingsError(f"MOE_RAY_BACKEND={backend!r}: expected {RENDER_ONLY!r} or unset (the Ray REST API)")
        metrics = env.get("MOE_METRICS_PORT", "")
        return Settings(
            allowed_roots=tuple(r for r in env.get("MOE_ALLOWED_ROOTS", "").split(":") if r),
            serve_http_port=_port(env, "MOE_SERVE_HTTP_PORT", "8000"),
            serve_http_host=env.get("MOE_SERVE_HTTP_HOST", "127.0.0.1"),
            endpoint_host=env.get("MOE_ENDPOINT_HOST", "127.0.0.1"),
            ray_address=env.get("MOE_RAY_ADDRESS", ""),
            ray_token_file=env.get("MOE_RAY_TOKEN_FILE", ""),
            ray_token=env.get("MOE_RAY_TOKEN", ""),
            ray_backend=backend,
            render_only_dir=env.get("MOE_RENDER_ONLY_DIR", "/tmp/moe-render-only"),
            metrics_port=_port(env, "MOE_METRICS_PORT", metrics) if metrics else None,
            metrics_host=env.get("MOE_METRICS_HOST", "127.0.0.1"),
        )


def _port(env: Mapping[str, str], name: str, default: str) -> int:
    raw = env.get(name, default)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise SettingsError(f"{name}={raw!r}: expected a port number (1-65535)")
    return int(raw)
