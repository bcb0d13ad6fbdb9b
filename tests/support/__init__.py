"""Helpers the test packages share (no test module imports another test module for them)."""
