"""Cached generation and elastic budget control."""
