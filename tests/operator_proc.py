"""The kopf operator as a subprocess for e2e tests: started, SIGKILLed, restarted like a Pod."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

KOPF = str(Path(sys.executable).with_name("kopf"))


class Operator:
    def __init__(self, k8s, ray_head, roots, log):
        self.env = {**k8s.env, "MOE_ALLOWED_ROOTS": roots}
        if ray_head is not None:
            self.env.update({"MOE_RAY_ADDRESS": ray_head.dashboard_url, "MOE_RAY_TOKEN": ray_head.token,
                             "MOE_SERVE_HTTP_PORT": str(ray_head.serve_http_port)})
        self.log = log
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([KOPF, "run", "--standalone", "--namespace", "default", "-m",
                                      "moe_operator.handlers.operator"], env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=60)
