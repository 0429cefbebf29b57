"""Tests that need neither a server nor an ONNX export: seconds in all (`make unit`)."""
