"""Check that a restructuring changed no behaviour: build the same tiny checkpoints with two versions of
the code, serve each repository with the real tritonserver, and compare what was written and what is
answered.

    # on the old code (e.g. a `git worktree` of the commit before the change):
    PYTHONPATH=<old tree> python scripts/compare_builds.py snapshot /tmp/before
    # on the new code:
    python scripts/compare_builds.py snapshot /tmp/after
    python scripts/compare_builds.py compare /tmp/before /tmp/after

`snapshot` builds every case of `CASES` (random checkpoints, seed 0: the same bytes every time), serves
each repository and records every public model's answers (and its error for a bad request) with raw
tritonclient calls, so that the client code under change takes no part in the check. `compare` reports,
per case: files added or removed, graph and data files whose bytes differ, config.pbtxt differences
(`parameters` reported apart: a restructuring may move settings into them), manifest entries that differ
(paths, times, versions, this host's int8 timings and file digests ignored), and served answers and
errors that are not identical. It exits 1 when anything but parameters and served code (model.py and
the .py modules beside it) differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROTEIN = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEG"
SHORT = "MKTAYIAKQRQISFVKSH"
SMILES = ["CC(=O)Oc1ccccc1C(=O)O", "c1ccccc1", "CCO"]
IGNORED_MANIFEST_KEYS = ("created", "checkpoint.path", "versions", "build_host", "files", "tool",
                         "export.encoder.int8_speed_on_build_host")
"""Manifest entries that differ between any two builds (times, paths, this host's timings, digests)."""


@dataclass(frozen=True)
class Case:
    """One repository to build: a family, how its checkpoint is made, and the build's settings."""

    name: str
    family: str
    make: Callable[[Path], Path]
    settings: dict[str, Any]
    served: bool = True
    """False: compared on disk only (the embedded tritonserver has no onnxruntime backend to serve it)."""


def _random(family: str) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        from bionemo_export.testing.checkpoints import save_random_checkpoint

        return save_random_checkpoint(family, folder, seed=0)

    return make


def _esm2_classifier(folder: Path) -> Path:
    import torch
    import transformers

    from bionemo_export.models.esm2 import ALPHABET
    from bionemo_export.testing.checkpoints import esm2_config, save_huggingface

    config = esm2_config()
    config.num_labels = 3
    config.id2label = {0: "cytoplasm", 1: "membrane", 2: "nucleus"}
    config.label2id = {v: k for k, v in config.id2label.items()}
    torch.manual_seed(0)
    return save_huggingface(transformers.EsmForSequenceClassification(config).eval(), folder, ALPHABET)


CASES = (
    Case("esm2_fp32", "esm2", _random("esm2"), {}),
    Case("esm2_int8", "esm2", _random("esm2"), {"precision": "int8"}),
    Case("esm2_native", "esm2", _random("esm2"), {"backend": "native"}, served=False),
    Case("esm2_classifier", "esm2", _esm2_classifier, {}),
    Case("bert_plain", "bert", _random("bert"), {"optimize": False}),
    Case("prott5", "prott5", _random("prott5"), {}),
    Case("megamolbart", "megamolbart", _random("megamolbart"), {}),
)


def _requests(family: str, task: str) -> list[dict[str, np.ndarray]]:
    """The requests sent to a public model of `task`: a batch of two, one alone, and a bad one."""
    def sequences(values: list[str]) -> np.ndarray:
        return np.array([[v.encode()] for v in values], dtype=object)

    good = SMILES[:2] if family == "megamolbart" else [PROTEIN[:60], SHORT]
    bad = sequences(["not a sequence!!"])
    if task == "scores":
        return [{"sequences": sequences([SHORT]), "variants": np.array([[b"K2A", b"T3G:A4C"]], dtype=object)},
                {"sequences": sequences([SHORT])},
                {"sequences": sequences([SHORT]), "variants": np.array([[b"Q2A"]], dtype=object)}]
    if task == "samplings":
        return [{"sequences": sequences(good), "seed": np.array([[7], [7]], dtype=np.int64),
                 "num_samples": np.array([[2], [2]], dtype=np.int32)}, {"sequences": bad}]
    return [{"sequences": sequences(good)}, {"sequences": sequences([good[1]])}, {"sequences": bad}]


def _infer(client: Any, model: str, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    tensors = []
    for name, value in inputs.items():
        tensor = http.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    try:
        result = client.infer(model, tensors)
    except InferenceServerException as err:
        return {"error": str(err.message())}
    outputs = result.get_response()["outputs"]
    return {o["name"]: result.as_numpy(o["name"]) for o in outputs}


def snapshot(out: Path) -> None:
    """Build, serve and query every case into `out` (a new folder)."""
    import tritonclient.http as http

    from bionemo_export.build import BuildRequest, build_repository
    from bionemo_export.runtime import TritonServer

    out.mkdir(parents=True)
    for case in CASES:
        print(f"[{case.name}] building", flush=True)
        checkpoint = case.make(out / "checkpoints" / case.name)
        repository = out / case.name
        build_repository(BuildRequest(family=case.family, checkpoint=checkpoint, name="m", out=repository,
                                      **case.settings))
        manifest = json.loads((repository / "manifest.json").read_text())
        answers: dict[str, Any] = {}
        if not case.served:
            np.savez(out / f"{case.name}.answers.npz")
            (out / f"{case.name}.errors.json").write_text("{}")
            continue
        with TritonServer(repository, log_file=out / f"{case.name}.tritonserver.log") as server:
            client = http.InferenceServerClient(server.endpoints.http_url)
            for task, model in zip(manifest["tasks"], manifest["public_models"], strict=True):
                for index, request in enumerate(_requests(case.family, task)):
                    answers[f"{model}/{index}"] = _infer(client, model, request)
                    if task == "hiddens" and index == 0 and "decodes" in manifest["tasks"]:
                        hidden = answers[f"{model}/0"]
                        answers["m_decodes/from_hiddens"] = _infer(
                            client, "m_decodes", {"hiddens": hidden["hiddens"], "mask": hidden["mask"]})
            client.close()
        arrays = {f"{key}:{name}": value for key, answer in answers.items() for name, value in answer.items()
                  if name != "error"}
        np.savez(out / f"{case.name}.answers.npz", **arrays)
        errors = {key: answer["error"] for key, answer in answers.items() if "error" in answer}
        (out / f"{case.name}.errors.json").write_text(json.dumps(errors, indent=1, sort_keys=True))
        print(f"[{case.name}] {len(arrays)} answers, {len(errors)} errors", flush=True)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


def _config(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A config.pbtxt as a dict without its parameters, and its parameters apart."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    config.ClearField("parameters")
    return json_format.MessageToDict(config), parameters


def compare_case(before: Path, after: Path) -> tuple[list[str], list[str]]:
    """(differences, notes) between the two builds of one case: differences fail the check; notes are
    the expected kind (model.py contents, config parameters)."""
    problems: list[str] = []
    notes: list[str] = []
    def files(root: Path) -> set[Path]:  # the Python backend's bytecode caches are the server's, not the build's
        return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}

    files_before, files_after = files(before), files(after)
    for kind, only in (("before", files_before - files_after), ("after", files_after - files_before)):
        for path in sorted(only):  # a served module added or dropped is a change of code, not of data
            (notes if path.suffix == ".py" else problems).append(f"file only {kind}: {path}")
    for path in sorted(files_before & files_after):
        a, b = (before / path).read_bytes(), (after / path).read_bytes()
        if a == b:
            continue
        if path.suffix == ".py":  # the served code: model.py and the modules copied beside it
            notes.append(f"served code differs: {path}")
        elif path.name == "config.pbtxt":
            (config_a, params_a), (config_b, params_b) = _config(before / path), _config(after / path)
            if config_a != config_b:
                problems.append(f"config differs beyond parameters: {path}")
            for key in sorted(set(params_a) | set(params_b)):
                if params_a.get(key) != params_b.get(key):
                    notes.append(f"{path} parameter {key}: {params_a.get(key)!r} -> {params_b.get(key)!r}")
        elif path.name == "manifest.json":
            flat_a, flat_b = (_flatten(json.loads((root / path).read_text())) for root in (before, after))
            for key in sorted(set(flat_a) | set(flat_b)):
                if key.startswith(IGNORED_MANIFEST_KEYS) or key.endswith(("seconds", "_s")):
                    continue
                if flat_a.get(key) != flat_b.get(key):
                    problems.append(f"manifest {key}: {flat_a.get(key)!r} -> {flat_b.get(key)!r}")
        else:
            problems.append(f"bytes differ: {path}")
    return problems, notes


def compare(before: Path, after: Path) -> int:
    failed = False
    for case in CASES:
        problems, notes = compare_case(before / case.name, after / case.name)
        answers_a = np.load(before / f"{case.name}.answers.npz", allow_pickle=True)
        answers_b = np.load(after / f"{case.name}.answers.npz", allow_pickle=True)
        for key in sorted(set(answers_a.files) | set(answers_b.files)):
            if key not in answers_a.files or key not in answers_b.files:
                problems.append(f"answer only {'after' if key in answers_b.files else 'before'}: {key}")
            elif not np.array_equal(answers_a[key], answers_b[key]):
                problems.append(f"answer differs: {key}")
        errors_a = json.loads((before / f"{case.name}.errors.json").read_text())
        errors_b = json.loads((after / f"{case.name}.errors.json").read_text())
        problems += [f"error differs for {key}: {errors_a.get(key)!r} -> {errors_b.get(key)!r}"
                     for key in sorted(set(errors_a) | set(errors_b)) if errors_a.get(key) != errors_b.get(key)]
        print(f"[{case.name}] {len(answers_a.files)} answers, {len(errors_a)} errors compared: "
              f"{'identical' if not problems else f'{len(problems)} differences'}"
              f"{f' ({len(notes)} expected: served code, parameters)' if notes else ''}")
        for line in problems:
            print(f"  DIFFERS {line}")
        for line in notes:
            print(f"  note    {line}")
        failed = failed or bool(problems)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("snapshot").add_argument("out", type=Path)
    compared = commands.add_parser("compare")
    compared.add_argument("before", type=Path)
    compared.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "snapshot":
        snapshot(args.out)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
