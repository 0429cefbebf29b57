"""bionemo-export: turn biology language model checkpoints into Triton model repositories."""

__version__ = "0.1.0"
