"""Tooling for the docs (not part of the product)."""
