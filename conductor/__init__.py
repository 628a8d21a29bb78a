"""The conductor: OpenAI-compatible endpoint, routing over prefill/decode pairs, admin API."""
