"""Autoregressive decoding and sampling (numpy only), shared by served models and the reference."""

from bionemo_export.generation.search import (
    LIMITS,
    SAMPLING_METHODS,
    GenerationError,
    StepDecoder,
    TooLargeError,
    beam_search,
    check_sampling_arguments,
    generate,
    greedy,
    perturb,
    sample_top_k_top_p,
    validate_hiddens,
)

__all__ = [
    "LIMITS",
    "SAMPLING_METHODS",
    "GenerationError",
    "StepDecoder",
    "TooLargeError",
    "beam_search",
    "check_sampling_arguments",
    "generate",
    "greedy",
    "perturb",
    "sample_top_k_top_p",
    "validate_hiddens",
]
