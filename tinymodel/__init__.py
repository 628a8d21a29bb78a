"""A tiny, locally trained Llama checkpoint for tests and demos (no model-hub download)."""

from tinymodel.builder import BUILDER_VERSION, ModelSpec, default_cache_dir, ensure_model

__all__ = ["BUILDER_VERSION", "ModelSpec", "default_cache_dir", "ensure_model"]
