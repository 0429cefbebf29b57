"""The served package: all the code Triton's Python backend runs for a repository's Python models.

Copied whole, as `bionemo_serving/`, into every Python model's version folder
(model_repository/encoder.py's `served_package`), beside the same static model.py, whose class
hands the model to the ServedModel its config parameter `served_model` names (models.py). So its
modules import only each other (relative imports), the standard library and numpy
(onnx_session.py alone imports onnxruntime; `triton_python_backend_utils` is imported by
responses.py when a response is built, never at import time): `_layers.outside_the_served_package`
keeps it so. The package imports them from here too: one source of truth, unit-tested without a
server (tests/unit/test_serving_modules.py).

- models.py          the served models (EncoderModel, ScoresModel, ...) and model.py's TritonPythonModel
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
- search.py          decoding and sampling (greedy, beam search, top-k/p), shared with the PyTorch reference
- kv_decoder.py      the decoder's key/value cache over the cross_kv and decoder_step graphs
- tokenizers/        the families' tokenizers (character, SMILES, SentencePiece, structure-aware)
- numerics.py        the one cosine every check uses
"""
