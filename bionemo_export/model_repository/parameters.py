"""Config parameters through which a generated repository tells the serving runtime about its models.

The planners (masked_lm.py, seq2seq.py) write them into a model's `config.pbtxt` (`parameters`);
the supervisor (runtime/supervisor.py) reads them back from the server. They are named here, in the
planners' layer, which the runtime may import and the planners do not climb out of.
"""

from __future__ import annotations

BLS_MODELS = "bls_models"
"""Config parameter of a model that calls others through BLS: their names, comma-separated. Triton
knows an ensemble's steps but not these calls; the supervisor reloads the callees with their caller."""
