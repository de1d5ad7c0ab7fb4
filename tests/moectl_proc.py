"""moectl as users run it: one command (exit code and one-line errors checked), or `moectl up` in
the background until it serves."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from waiting import wait_for

MOECTL = str(Path(sys.executable).with_name("moectl"))


def moectl(*args, env, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([MOECTL, *args], env=env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"moectl {' '.join(args)}: {proc.returncode} {proc.stderr}")
    return proc


class MoectlUp:
    """`moectl up -f FILE --port PORT` in its own process group; stopped with SIGTERM (exit 0 checked)."""

    def __init__(self, manifest: Path, port: int, env: dict, log_path: Path, *extra: str):
        self.log_path = log_path
        self.proc = subprocess.Popen([MOECTL, "up", "-f", str(manifest), "--port", str(port), *extra], env=env,
                                     stdout=open(log_path, "w+"), stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_serving(self) -> None:
        def serving():
            assert self.proc.poll() is None, self.log()
            return "is serving at" in self.log()

        wait_for(serving, what="moectl up to serve")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=120)
        assert rc == 0, self.log()
