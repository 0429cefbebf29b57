"""tritonclient-based clients for the served models (Python API and the `client` CLI commands)."""

from .encoders import EncoderClient, Seq2SeqClient, masked_mean
from .triton import DEFAULT_URL, InferenceError, TritonClient, TritonUrl, strings_to_tensor

__all__ = ["DEFAULT_URL", "EncoderClient", "InferenceError", "TritonClient", "TritonUrl", "Seq2SeqClient", "masked_mean",
           "strings_to_tensor"]
