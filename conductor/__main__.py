"""`python -m conductor --model DIR --etcd HOST:PORT [--port 8000]`: serve the endpoint."""

from __future__ import annotations

import uvicorn

from cluster.logging import configure
from conductor.app import create_app
from conductor.config import parse_args


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure("conductor")
    uvicorn.run(create_app(config), host=config.host, port=config.port, loop="uvloop",
                http="httptools", log_level="warning", access_log=False,
                timeout_keep_alive=config.http_keep_alive_s,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
