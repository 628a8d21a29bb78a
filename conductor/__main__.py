"""`python -m conductor --model DIR --etcd HOST:PORT [--port 8000]`: serve the endpoint."""

from __future__ import annotations

import uvicorn

from cluster.logging import configure
from conductor.app import create_app
from conductor.config import parse_args
from conductor.http_server import raise_open_files_limit, server_config


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure("conductor")
    raise_open_files_limit()
    uvicorn.Server(server_config(create_app(config), config)).run()


if __name__ == "__main__":
    main()
