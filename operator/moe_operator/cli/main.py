"""moectl: drive MoEDeployments (also installed as the kubectl plugin `kubectl moe`).

Exit codes: 0 success; 1 the operation failed (the reason is printed on one line); 2 bad usage.
"""

from __future__ import annotations

# each module registers its commands on `app` when imported: `moectl --help` lists them in this order
from . import init_model  # init-model
from . import up  # up
from . import get  # get
from . import hot_swap  # hot-swap
from . import rebalance  # rebalance
from . import quarantine  # quarantine
from . import experts  # experts, top
from . import profile  # profile
from . import bench  # bench
from .console import app

COMMANDS = (init_model, up, get, hot_swap, rebalance, quarantine, experts, profile, bench)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
