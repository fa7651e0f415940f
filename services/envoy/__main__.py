"""python -m services.envoy: render the Envoy config (deploy/envoy) from flags and
STORMSERVE_* variables and become Envoy. `--print` writes the config to stdout
instead; `--drain` drains a running Envoy gracefully (drain.py). Envoy
replaces this process (same pid), so a supervisor's or the kubelet's signals
reach Envoy itself."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from services.common.config import load_config
from services.common.supervisor import exit_with_supervisor
from services.common.log import setup_logging
from services.envoy.config import EnvoyConfig
from services.envoy.drain import drain
from services.envoy.render import envoy_command, render, write


def main() -> None:
    exit_with_supervisor()  # the parent-death signal survives exec
    argv = sys.argv[1:]
    if "--print" in argv:
        argv.remove("--print")
        sys.stdout.write(render(load_config(EnvoyConfig, argv)))
        return
    if "--drain" in argv:
        argv.remove("--drain")
        setup_logging("envoy")
        raise SystemExit(0 if drain(load_config(EnvoyConfig, argv)) else 1)
    config = load_config(EnvoyConfig, argv)
    path = write(config, Path(tempfile.mkdtemp(prefix="stormserve-envoy-")) / "envoy.yaml")
    command = envoy_command(config, path)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
