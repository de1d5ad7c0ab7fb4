"""The operator's settings from its environment (what the Helm chart sets), read once at start."""

from __future__ import annotations

import pytest

from moe_operator.settings import Settings, SettingsError


def test_an_empty_environment_gives_the_documented_defaults():
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.serve_http_port, s.serve_http_host, s.endpoint_host) == (8000, "127.0.0.1", "127.0.0.1")
    assert s.allowed_roots == () and s.metrics_port is None and s.ray_backend == ""


def test_every_variable_lands_in_its_field():
    s = Settings.from_env({
        "MOE_RAY_ADDRESS": "http://ray:8265", "MOE_RAY_TOKEN_FILE": "/var/run/ray/token", "MOE_RAY_TOKEN": "t",
        "MOE_ALLOWED_ROOTS": "/models::/weights", "MOE_SERVE_HTTP_PORT": "8100", "MOE_SERVE_HTTP_HOST": "0.0.0.0",
        "MOE_ENDPOINT_HOST": "moe.example", "MOE_METRICS_PORT": "9090", "MOE_METRICS_HOST": "0.0.0.0",
        "MOE_RAY_BACKEND": "render-only", "MOE_RENDER_ONLY_DIR": "/tmp/r"})
    assert s.ray_address == "http://ray:8265" and s.ray_token_file == "/var/run/ray/token" and s.ray_token == "t"
    assert s.allowed_roots == ("/models", "/weights")  # empty entries dropped
    assert (s.serve_http_port, s.serve_http_host, s.endpoint_host) == (8100, "0.0.0.0", "moe.example")
    assert (s.metrics_port, s.metrics_host) == (9090, "0.0.0.0")
    assert (s.ray_backend, s.render_only_dir) == ("render-only", "/tmp/r")


@pytest.mark.parametrize("env, named", [
    ({"MOE_SERVE_HTTP_PORT": "http"}, "MOE_SERVE_HTTP_PORT='http'"),
    ({"MOE_SERVE_HTTP_PORT": "70000"}, "MOE_SERVE_HTTP_PORT='70000'"),
    ({"MOE_METRICS_PORT": "0"}, "MOE_METRICS_PORT='0'"),
    ({"MOE_RAY_BACKEND": "kuberay"}, "MOE_RAY_BACKEND='kuberay'"),
])
def test_a_bad_value_is_refused_naming_the_variable(env, named):
    with pytest.raises(SettingsError, match=named.replace("(", r"\(")):
        Settings.from_env(env)


def test_the_operator_refuses_to_start_on_a_bad_variable(monkeypatch):
    """kopf retries a startup handler's ordinary errors forever; a setting that cannot work is
    permanent: the operator exits with the variable's name."""
    import kopf

    from moe_operator.handlers.operator import configure

    memo = kopf.Memo()
    monkeypatch.setenv("MOE_SERVE_HTTP_PORT", "eighty")
    with pytest.raises(kopf.PermanentError, match="MOE_SERVE_HTTP_PORT='eighty'"):
        configure(settings=kopf.OperatorSettings(), memo=memo)
    monkeypatch.setenv("MOE_SERVE_HTTP_PORT", "8100")
    configure(settings=kopf.OperatorSettings(), memo=memo)
    assert memo.settings.serve_http_port == 8100 and memo.autoscaler is not None


def test_the_kubernetes_clients_are_built_once_at_start(tmp_path, monkeypatch):
    """The 2 s and 5 s timers used to load the kubeconfig and build a client on every call; the
    memo's KubeApis builds them once, at the operator's start (every loop writes status through
    them), and hands out the same ones after."""
    import kopf

    from moe_operator.clients import KubeApis
    from moe_operator.handlers.operator import configure

    (tmp_path / "config").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\nusers: [{name: u, user: {token: t}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    memo = kopf.Memo()
    configure(settings=kopf.OperatorSettings(), memo=memo)
    apis = memo.kube
    assert isinstance(apis, KubeApis) and apis._core is not None  # loaded at start
    core, kuberay = apis.core, apis.kuberay
    assert core.api_client.configuration.host == "https://127.0.0.1:1"
    assert apis.core is core and apis.kuberay is kuberay
