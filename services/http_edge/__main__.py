"""`python -m services.http_edge --port 8000 --tokenizer-address 127.0.0.1:50051`"""
from __future__ import annotations

from collections.abc import Sequence

from services.common.config import load_config
from services.common import tracing
from services.common.log import setup_logging
from services.common.supervisor import exit_with_supervisor
from services.http_edge.config import EdgeConfig
from services.http_edge.server import run


def main(argv: Sequence[str] | None = None) -> None:
    exit_with_supervisor()
    setup_logging("http_edge")
    tracing.setup("edge")
    run(load_config(EdgeConfig, argv))


if __name__ == "__main__":
    main()
