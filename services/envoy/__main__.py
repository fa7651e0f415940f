"""python -m services.envoy: render the Envoy config (deploy/envoy) from flags and
STORMSERVE_* variables and become Envoy. `--print` writes the config to stdout
instead. Envoy replaces this process (same pid), so a supervisor's or the
kubelet's signals reach Envoy itself."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from services.common.config import load_config
from services.common.supervisor import exit_with_supervisor
from services.envoy.config import EnvoyConfig
from services.envoy.render import envoy_command, render, write


def main() -> None:
    exit_with_supervisor()  # the parent-death signal survives exec
    argv = sys.argv[1:]
    if "--print" in argv:
        argv.remove("--print")
        sys.stdout.write(render(load_config(EnvoyConfig, argv)))
        return
    config = load_config(EnvoyConfig, argv)
    path = write(config, Path(tempfile.mkdtemp(prefix="stormserve-envoy-")) / "envoy.yaml")
    command = envoy_command(path)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
