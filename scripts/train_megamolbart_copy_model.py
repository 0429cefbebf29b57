"""Train the small MegaMolBART copy model that the test suite decodes with, and write it where the
suite reads it (tests/data/megamolbart-copy/ unless another folder is given).

    OMP_NUM_THREADS=1 python scripts/train_megamolbart_copy_model.py [OUT]

The suite's decode tests need a model that gives SMILES back (random weights decode noise), but
training one takes about a minute of CPU on a fast host and 2.5 minutes on the slower kind, most of
the suite's heaviest test. So the model is trained once, by this script, and committed (safetensors:
no pickled code; about 0.7 MB). Training is deterministic for a seed on one machine and thread count
only, so a rerun elsewhere writes other bytes of the same quality: the suite checks the committed
model's reconstruction rates (tests/export/test_megamolbart.py), not its bytes, and checks the trainer
itself with a short run. Rerun this after a change to the family's saved form or to the trainer, and
commit the result with the rates it prints.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bionemo_export.models.megamolbart_training import train_copy_model

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "megamolbart-copy"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT,
                        help=f"the folder to write (default: {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="the training seed (default 0, the committed model's)")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.out.parent if args.out.parent.exists() else None) as work:
        written = train_copy_model(Path(work) / "model", seed=args.seed)
        if args.out.exists():
            shutil.rmtree(args.out)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(written), args.out)  # whole or not at all: the old model stays until this line
    print(f"trained in {time.perf_counter() - started:.1f} s on {torch.get_num_threads()} thread(s) "
          f"(torch {torch.__version__}, seed {args.seed}): {args.out}")


if __name__ == "__main__":
    main()
