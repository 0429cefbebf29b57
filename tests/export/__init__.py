"""Tests that export or build graphs with torch but start no server (marked `export` by tests/conftest.py)."""
