"""Adapters that plug zos into existing decode runners (optional extras; see each module)."""
