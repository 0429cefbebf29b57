"""The served models' logic, as plain modules that generated model.py files import.

Like the tokenizers, these files are copied verbatim into the repository's version folders
(model_repository/encoder.py's `serving_files`), so they import only the standard library, numpy
and each other (onnx_session.py alone imports onnxruntime; `triton_python_backend_utils` is
imported by responses.py when a response is built, never at import time). The package imports
them from here: one source of truth, unit-tested without a server (tests/unit/test_serving_modules.py).

- responses.py       error responses and codes, the execute() boundary, BLS calls and their codes
- parameters.py      config.pbtxt `parameters` read at initialize
- onnx_session.py    the ONNX Runtime session (threads, arena, providers, optimization level)
- host.py            cores this process may use -> ONNX Runtime threads per instance
- batching.py        rows of different lengths -> length buckets and sub-batches
- encoding.py        N_encoder (graph runs over joined rows) and N_tokenizer
- graph_model.py     a decoder graph run by the Python backend (ensemble layout)
- decoding.py        the decode loops' graphs (in-process or BLS), settings, N_decodes
- request_options.py N_samplings' optional inputs (the dev server parses them with it too)
- sampling.py        N_samplings: jobs, their decodes, the decode loop over them
- positionwise.py    a position-wise graph (the masked-LM head, N_lm_head) over joined positions
- scoring.py         N_scores' logic: variants, methods, masked copies, scores, limits
- scores.py          N_scores: requests -> masked copies -> BLS calls to N_logits -> scores
- windows.py         proteins longer than the model: overlapping windows and their merge rule
"""
