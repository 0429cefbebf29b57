"""Numpy-only helpers that generated model.py files import (joining requests of different lengths
into sub-batches, sizing ONNX Runtime's thread pool from the serving host's cores).

Like the tokenizers, these files are copied verbatim into the repository's version folders, so
they import only the standard library and numpy; the package imports them from here (one source
of truth, unit-tested here).
"""
