"""Attention backends: one interface over the paged KV cache, and the backends behind it."""
