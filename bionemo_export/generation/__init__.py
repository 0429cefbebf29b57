"""Autoregressive decoding and sampling (numpy only), shared by served models and the reference."""

from bionemo_export.generation.search import (
    MAX_NUM_SAMPLES,
    SAMPLING_METHODS,
    GenerationError,
    StepDecoder,
    beam_search,
    generate,
    greedy,
    perturb,
    sample_top_k_top_p,
    validate_hiddens,
)

__all__ = [
    "MAX_NUM_SAMPLES",
    "SAMPLING_METHODS",
    "GenerationError",
    "StepDecoder",
    "beam_search",
    "generate",
    "greedy",
    "perturb",
    "sample_top_k_top_p",
    "validate_hiddens",
]
