"""The docs site: generated reference pages are current, `mkdocs build --strict` passes (no
broken link or anchor), and the README stays short and points at pages that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_operator import reference

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(reference.pages()))
def test_generated_reference_is_current(name):
    page = REPO / "docs" / "reference" / name
    assert page.exists(), f"{page} missing: run python -m moe_operator.reference docs/reference"
    assert page.read_text() == reference.pages()[name], \
        f"{page} is stale: run python -m moe_operator.reference docs/reference"


def test_reference_covers_every_field_command_value_and_metric():
    pages = reference.pages()
    api = pages["moedeployment-api.md"]
    for field in ("spec.model.path (required)", "spec.experts.overrides[].weights.sha256",
                  "spec.ray.authTokenSecretRef.key", "status.conditions[].reason", "status.autoscaling.phase"):
        assert f"| {field} |" in api, field
    cli = pages["moectl.md"]
    for command in ("init-model", "up", "get", "hot-swap", "experts", "top", "bench", "rebalance"):
        assert f"## moectl {command}\n" in cli, command
    assert "| `--sha256` | str |" in cli
    values = pages["helm-values.md"]
    assert "| `metrics.serviceMonitor.enabled` | boolean | `false` | Create a prometheus-operator ServiceMonitor." in values
    assert not re.search(r"^\| `[^`]+` \| [^|]+ \| [^|]+ \|  \|", values, re.M), "a Helm value without a description"
    metrics = pages["metrics.md"]
    for name in ("`moe_operator_reconciles_total` | counter | result", "`ray_moe_expert_tokens_total` | counter",
                 "`ray_moe_time_to_first_token_seconds` | histogram | app, replica"):
        assert name in metrics, name


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "moedeployment-api" / "index.html").exists()


def test_readme_is_short_and_links_to_pages_that_exist():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 20
    for link in links:
        assert (REPO / link).exists(), link
    assert "scripts/quickstart" in text and "scripts/test" in text
