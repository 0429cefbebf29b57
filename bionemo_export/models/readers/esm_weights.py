"""The EvolutionaryScale `esm` package's own weight files for ESM C (`esmc_300m_2024_12_v0.pth`,
`esmc_600m_2024_12_v0.pth`): a plain torch state dict under that package's module names
(`embed.weight`, `transformer.blocks.0.attn.layernorm_qkv.1.weight`, `sequence_head.3.weight`, ...),
without a config: the sizes are read from the tensors (models/esmc.py `from_esm_weights`).

Opened as every torch file here (torch_files.py): torch's zip format only, `torch.load(weights_only=True)`;
no pickled code runs.
"""

from __future__ import annotations

from .base import Checkpoint, CheckpointError, CheckpointPath, CheckpointReader, register_reader
from .torch_files import load_torch_weights

MARKERS = ("embed.weight", "transformer.blocks.0.attn.layernorm_qkv.1.weight")
"""Keys every ESM C state dict of the `esm` package has."""


@register_reader
class EsmWeightsReader(CheckpointReader):
    form = "esm_weights"
    description = "the esm package's ESM C weight files (esmc_300m_2024_12_v0.pth, esmc_600m_2024_12_v0.pth)"

    def describe(self, checkpoint: Checkpoint) -> str:
        return f"esm package ESM C weights {checkpoint.path.name}"

    def recognizes(self, found: CheckpointPath) -> bool:
        path = found.path
        # Any .pth file, zip or not: a legacy pickle or a TorchScript archive is refused as such.
        return path.is_file() and path.suffix == ".pth"

    def read(self, found: CheckpointPath) -> Checkpoint:
        path = found.path
        weights, skipped = load_torch_weights(path, str(path))
        if missing := [key for key in MARKERS if key not in weights]:
            raise CheckpointError(f"{path} is not an ESM C weight file of the esm package: no {', '.join(missing)}")
        return Checkpoint(path=path, form=self.form, config={}, weights=weights, weights_name=path.name,
                          model_class="ESM C", skipped=skipped)
