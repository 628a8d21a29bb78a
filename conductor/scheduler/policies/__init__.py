"""Routing policies, one per module, each a pure function
`(ClusterSnapshot, RouteRequest) -> Route | Reject | None` (None: no instance can take it).
`conductor.scheduler.policy.POLICIES` names them for the configuration."""
