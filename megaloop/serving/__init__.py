"""Serving: a resident step over a table of sequence slots with a paged KV cache (docs/serving.md)."""
