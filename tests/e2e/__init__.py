"""Tests against a real tritonserver (marked `e2e` by tests/conftest.py)."""
