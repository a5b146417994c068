"""Tiers below the pool: pinned host memory and the checksummed filesystem disk tier."""
