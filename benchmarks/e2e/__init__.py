"""End-to-end serving benchmark: request workloads and the report of a run."""
