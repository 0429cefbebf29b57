"""Read and write `config.pbtxt` through Triton's own `ModelConfig` protobuf schema.

Configs are never assembled as strings: a field name or enum that Triton does not know fails
here, at build time, instead of when the server loads the model.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

ModelConfig = mc.ModelConfig


def to_pbtxt(config: mc.ModelConfig) -> str:
    """Serialize a ModelConfig as protobuf text, the format Triton reads from config.pbtxt."""
    return text_format.MessageToString(config, use_short_repeated_primitives=True)


def parse_pbtxt(text: str) -> mc.ModelConfig:
    """Parse config.pbtxt text; raises google.protobuf.text_format.ParseError on schema errors."""
    return text_format.Parse(text, mc.ModelConfig())


def write_config(model_dir: Path, config: mc.ModelConfig) -> Path:
    """Write `config` to `model_dir/config.pbtxt` and return the file's path."""
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.pbtxt"
    path.write_text(to_pbtxt(config))
    return path


def read_config(model_dir: Path) -> mc.ModelConfig:
    return parse_pbtxt((model_dir / "config.pbtxt").read_text())
