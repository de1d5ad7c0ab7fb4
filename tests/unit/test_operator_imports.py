"""The operator image installs the package without torch and Ray (Dockerfile): its entry points
must import without them. A data-plane import reached from the operator's modules (the request
protocol once imported the sampler, which imports torch) kept the operator Pod from starting on
the node; this finds it in a second."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCKED = ("torch", "ray", "safetensors", "tokenizers", "llguidance", "jinja2", "numpy", "transformers")


def test_the_operator_and_moectl_import_without_data_plane_packages():
    code = (f"import sys\nfor m in {BLOCKED!r}: sys.modules[m] = None\n"
            "import moe_operator.handlers.operator, moe_operator.cli.main, moe_operator.reconcile\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'workers'}", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
