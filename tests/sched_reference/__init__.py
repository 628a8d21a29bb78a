"""Frozen copies of scheduler code, for old-against-new checks (tests/test_route_replay.py).

`kv_centric.py`: conductor/scheduler/policies/kv_centric.py verbatim as of a9e4f2a, the policy
that priced every instance per decision. Never imported by product code.
"""
