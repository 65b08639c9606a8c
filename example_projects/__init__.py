"""Runnable example projects for lightning_bnp (offline by default)."""
