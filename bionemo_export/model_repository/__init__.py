"""Plan a Triton model repository as typed objects and write it to disk (config.pbtxt via ModelConfig)."""

from .pbtxt import ModelConfig, parse_pbtxt, read_config, to_pbtxt, write_config

__all__ = ["ModelConfig", "parse_pbtxt", "read_config", "to_pbtxt", "write_config"]
