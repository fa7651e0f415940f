"""One logging setup for every service: one line per record, service name first."""
from __future__ import annotations

import logging
import os
import sys


def setup_logging(service: str) -> logging.Logger:
    level = os.environ.get("STORMSERVE_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger(f"stormserve.{service}")
