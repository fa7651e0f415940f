"""One logging setup for every service: one line per record, service name first.

STORMSERVE_LOG_FORMAT=json writes each record as one JSON object per line
(ts, level, service, logger, msg, and the record's `fields` when it has them,
as the edge's access log does); the default is plain text."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(service: str) -> logging.Logger:
    level = os.environ.get("STORMSERVE_LOG_LEVEL", "INFO").upper()
    log_format = os.environ.get("STORMSERVE_LOG_FORMAT", "text").strip().lower()
    if log_format not in LOG_FORMATS:
        raise SystemExit(f"STORMSERVE_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return logging.getLogger(f"stormserve.{service}")
