"""A request's ids: the one its client sees and the one the cluster keys its work on."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from conductor.errors import InvalidRequest

_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")


def client_request_id(header: str | None, field: str | None) -> str | None:
    """The caller's id for a request: its X-Request-Id header, held to the rules of the body's
    `request_id` (an empty header counts as none), else that field."""
    if header and not _CLIENT_ID.fullmatch(header):
        raise InvalidRequest("The X-Request-Id header must be 1-128 visible ASCII "
                             "characters.", param="X-Request-Id")
    return header or field


@dataclass(frozen=True, slots=True)
class RequestIds:
    """`public`: what the client sees (the response's id, X-Request-Id): its own id when it
    gave one. `internal`: what the engines, aborts and the load model key on, unique per
    request: two clients sending the same id (a gateway's retry, a copied snippet) must not
    abort or account each other's work."""

    public: str
    internal: str

    @classmethod
    def of(cls, prefix: str, client_id: str | None) -> RequestIds:
        if client_id is None:
            own = f"{prefix}-{uuid.uuid4().hex}"
            return cls(own, own)
        public = f"{prefix}-{client_id}"
        return cls(public, f"{public}-{uuid.uuid4().hex[:12]}")

    def log(self) -> dict[str, str]:
        """What the log lines and spans carry: the internal id, and the client's when given
        (then the two differ)."""
        if self.public != self.internal:
            return {"request_id": self.internal, "client_request_id": self.public}
        return {"request_id": self.internal}
