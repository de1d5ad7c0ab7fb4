"""The GPU bring-up kit (`scripts/gpu-check`, bench/gpu.py) run to the end on the CPU, as the
smoke run: every check runs its real code (our engine and transformers on tiny random
checkpoints of every family, the tiered store promoting through its device operations, the
decode comparison, paged attention, quantized decode) and the report says ran / skipped (why)
for each; none may fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_kit_runs_to_the_end_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--quick", "--batches", "1,4",
                           "--out", str(out), "--work-dir", str(tmp_path / "work")],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    checks = report["checks"]
    assert list(checks) == ["preflight", "families", "paged-attention", "attention", "quantized", "store", "decode",
                            "overlap", "served"]
    for name, check in checks.items():
        assert check["status"] == "ran", (name, check)  # this torch compiles flex attention for the CPU too
        assert check["summary"], name
    assert checks["preflight"]["grouped_gemm"] is True and checks["preflight"]["compile_s"] > 0
    assert {(r["batch"], r["context"]) for r in checks["attention"]["rows"]} == {(1, 40), (17, 40)}
    assert checks["served"]["tokens_agree"].split("/")[0] == checks["served"]["tokens_agree"].split("/")[1]
    families = {(r["family"], r["dtype"]) for r in checks["families"]["rows"]}
    assert len(families) == 14  # seven families, fp32 and bf16
    assert all(r["max_logit_diff"] < 1e-3 for r in checks["families"]["rows"] if r["dtype"] == "float32")
    assert {(r["shape"], r["batch"]) for r in checks["decode"]["rows"]} == {
        (s, b) for s in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b") for b in (1, 4)}
    assert "families " in proc.stdout and "report:" in proc.stdout


def test_a_check_past_its_limit_is_cut_and_the_report_keeps_what_ran(tmp_path):
    """Each check runs in a child process under a time limit; the report is written after each."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--quick", "--only", "preflight",
                           "--limit-scale", "0.001", "--out", str(out), "--work-dir", str(tmp_path / "work")],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    check = json.loads(out.read_text())["checks"]["preflight"]
    assert check["status"] == "timed out" and "limit" in check["summary"]


def test_the_gpu_kit_refuses_cuda_where_there_is_none_and_unknown_checks(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--out", str(tmp_path / "g.json")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    proc = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--only", "nope"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "nope" in proc.stderr


def test_no_bench_script_shadows_the_standard_library():
    """`python bench/gpu.py` puts bench/ first on sys.path: a bench/operator.py made a fresh venv's
    `import argparse` fail (partially initialized module 're'), the standard library's `operator`
    not being imported yet. Without site (-S) nothing is imported before the script's own path is."""
    shadows = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem in sys.stdlib_module_names)
    assert shadows == [], shadows
    proc = subprocess.run([sys.executable, "-S", str(REPO / "bench" / "gpu.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    # argparse and everything before the first third-party import load; torch is outside -S's path
    assert "partially initialized" not in proc.stderr and "circular import" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0 or "No module named 'torch'" in proc.stderr, proc.stderr[-2000:]
