"""Routing policies, one per module, each a pure function
`(ClusterSnapshot, RouteRequest) -> Route | Reject | None` (None: no instance can take it).
`conductor.policy.POLICIES` names them for the configuration."""
