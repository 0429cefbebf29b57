"""The repository layout for encoder models (embeddings, hiddens).

For `--name N`:

    N_tokenizer   python    sequences BYTES [1] -> input_ids, attention_mask INT64 [-1], mask BOOL [-1]
    N_encoder     onnx      input_ids, attention_mask, residue_mask -> hiddens FP32 [-1, H], embeddings FP32 [H]
                            (platform onnxruntime_onnx with --backend native; a Python-backend model
                            running ONNX Runtime with --backend python)
    N_embeddings  ensemble  sequences -> embeddings       (tokenizer -> encoder)
    N_hiddens     ensemble  sequences -> hiddens, mask    (tokenizer -> encoder; mask from the tokenizer)

Pooling (masked mean over residues) happens inside the exported graph, so `N_embeddings` adds no
Python step after the encoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from bionemo_export import __version__
from bionemo_export.templates import render

from .plan import DynamicBatching, EnsembleStep, ModelPlan, RepositoryPlan, Tensor

BACKENDS = ("python", "native")
ENCODER_TASKS = ("embeddings", "hiddens")
# Tokenizer sources are copied verbatim from here into the repository (one source of truth).
TOKENIZERS_DIR = Path(__file__).resolve().parent.parent / "tokenizers"


@dataclass(frozen=True)
class ServingOptions:
    """How the repository's models are scheduled; every field has a sensible CPU default."""

    backend: str = "python"
    """python: ONNX Runtime inside a Python-backend model; native: Triton's onnxruntime_onnx."""
    max_batch_size: int = 32
    tokenizer_instances: int = 1
    encoder_instances: int = 1
    max_queue_delay_microseconds: int = 2000
    response_cache: bool = False
    truncate: bool = False
    """Cut sequences over the maximum length instead of refusing them."""
    intra_op_threads: int = 0
    """ONNX Runtime threads per encoder instance (0: ONNX Runtime's default, one per core)."""
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")

    def preferred_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({s for s in (8, 16, 32, 64) if s < self.max_batch_size} | {self.max_batch_size}))

    def dynamic_batching(self) -> DynamicBatching:
        return DynamicBatching(self.preferred_batch_sizes(), self.max_queue_delay_microseconds)


def _io_lines(inputs: list[Tensor], outputs: list[Tensor], batched: bool = True) -> list[str]:
    """Docstring lines describing the tensors, aligned like a table."""
    lines = []
    for label, tensors in (("Inputs", inputs), ("Outputs", outputs)):
        for i, tensor in enumerate(tensors):
            dims = ", ".join((["batch"] if batched else []) + [str(d) for d in tensor.dims])
            lines.append(f"{label if i == 0 else '':<8}{tensor.name:<16}{tensor.dtype:<6}[{dims}]")
    return lines


def tokenizer_files(tokenizer) -> tuple[str, str, dict[str, Path]]:
    """(module name, class name, version-folder files) that make `tokenizer` importable inside a
    generated model: its own module, plus character.py, which holds the shared Encoded and
    TokenizationError types."""
    module = type(tokenizer).__module__.rsplit(".", 1)[-1]
    files = {"character.py": TOKENIZERS_DIR / "character.py", f"{module}.py": TOKENIZERS_DIR / f"{module}.py"}
    return module, type(tokenizer).__name__, files


def describe_layout(tokenizer) -> str:
    """How a sequence becomes tokens, for the generated docstring: '<cls> + residues + <eos>, ...'."""
    parts = [t for t in (tokenizer.bos_token,) if t] + ["tokens"] + [t for t in (tokenizer.eos_token,) if t]
    return " + ".join(parts) + f", padded with {tokenizer.pad_token}"


def _tokenizer_model(name: str, tokenizer, options: ServingOptions) -> ModelPlan:
    sequences = Tensor("sequences", "BYTES", (1,))
    outputs = [Tensor("input_ids", "INT64", (-1,)), Tensor("attention_mask", "INT64", (-1,)),
               Tensor("mask", "BOOL", (-1,))]
    module, class_name, files = tokenizer_files(tokenizer)
    code = render(
        "tokenizer_model.py.j2",
        model_name=f"{name}_tokenizer", encoder_name=f"{name}_encoder", tool_version=__version__,
        tokenizer_module=module, tokenizer_class=class_name, layout=describe_layout(tokenizer),
        public_prefix=name,
    )
    return ModelPlan(
        name=f"{name}_tokenizer",
        inputs=[sequences], outputs=outputs,
        max_batch_size=options.max_batch_size,
        backend="python",
        instance_count=options.tokenizer_instances,
        dynamic_batching=options.dynamic_batching(),
        parameters={"truncate": "true" if options.truncate else "false"},
        files={
            "model.py": code,
            **files,
            "tokenizer.json": json.dumps(tokenizer.to_dict(), indent=2) + "\n",
        },
        description="tokenizer (Python backend)",
    )


def graph_model(model_name: str, family: str, inputs: list[Tensor], outputs: list[Tensor],
                onnx_files: dict[str, Path], options: ServingOptions, *, batched: bool = True,
                instances: int = 1, what: str = "encoder") -> ModelPlan:
    """A model that runs one exported ONNX graph: Triton's onnxruntime_onnx platform with
    `--backend native`, or ONNX Runtime inside a Python-backend model with `--backend python`.

    `batched=False` is for graphs whose batch is not their first axis (key/value caches laid out
    [layers, batch, ...]): max_batch_size 0 and full shapes in dims; their callers batch."""
    plan = ModelPlan(
        name=model_name,
        inputs=inputs, outputs=outputs,
        max_batch_size=options.max_batch_size if batched else 0,
        instance_count=instances,
        dynamic_batching=options.dynamic_batching() if batched else None,
        files=dict(onnx_files),
        warmup=[_zero_warmup(inputs)] if options.warmup and batched else [],
    )
    if options.backend == "native":
        plan.platform = "onnxruntime_onnx"
        plan.default_model_filename = "model.onnx"
        if options.intra_op_threads:
            plan.parameters["intra_op_thread_count"] = str(options.intra_op_threads)
        plan.description = f"{what} (onnxruntime_onnx)"
    else:
        plan.backend = "python"
        plan.parameters["intra_op_threads"] = str(options.intra_op_threads)
        plan.files["model.py"] = render(
            "onnx_model.py.j2",
            model_name=plan.name, family=family, what=what, tool_version=__version__,
            io_lines=_io_lines(inputs, outputs, batched),
            input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
            batched=batched,
        )
        plan.description = f"{what} (ONNX Runtime in the Python backend)"
    return plan


def _encoder_model(name: str, family: str, hidden_size: int, onnx_files: dict[str, Path],
                   options: ServingOptions) -> ModelPlan:
    inputs = [Tensor("input_ids", "INT64", (-1,)), Tensor("attention_mask", "INT64", (-1,)),
              Tensor("residue_mask", "BOOL", (-1,))]
    outputs = [Tensor("hiddens", "FP32", (-1, hidden_size)), Tensor("embeddings", "FP32", (hidden_size,))]
    return graph_model(f"{name}_encoder", family, inputs, outputs, onnx_files, options,
                       instances=options.encoder_instances)


def _zero_warmup(inputs: list[Tensor], length: int = 16) -> mc.ModelWarmup:
    """One all-zero request (token id 0 is a valid special token in every vocabulary here)."""
    warmup = mc.ModelWarmup(name="zeros", batch_size=1)
    for tensor in inputs:
        warmup.inputs[tensor.name].data_type = tensor.data_type
        warmup.inputs[tensor.name].dims.extend([length])
        warmup.inputs[tensor.name].zero_data = True
    return warmup


def _ensemble(name: str, task: str, outputs: list[Tensor], options: ServingOptions,
              encoder_outputs: dict[str, str]) -> ModelPlan:
    return ModelPlan(
        name=f"{name}_{task}",
        inputs=[Tensor("sequences", "BYTES", (1,))],
        outputs=outputs,
        max_batch_size=options.max_batch_size,
        platform="ensemble",
        response_cache=options.response_cache,
        steps=[
            EnsembleStep(
                model=f"{name}_tokenizer",
                input_map={"sequences": "sequences"},
                output_map={"input_ids": "input_ids", "attention_mask": "attention_mask", "mask": "mask"},
            ),
            EnsembleStep(
                model=f"{name}_encoder",
                input_map={"input_ids": "input_ids", "attention_mask": "attention_mask", "residue_mask": "mask"},
                output_map=encoder_outputs,
            ),
        ],
        description=f"public: {task}",
    )


def plan_encoder_repository(
    name: str,
    *,
    family: str,
    hidden_size: int,
    tokenizer,
    onnx_files: dict[str, Path],
    tasks: tuple[str, ...] = ENCODER_TASKS,
    options: ServingOptions = ServingOptions(),
) -> RepositoryPlan:
    """Plan the repository for an encoder family; `onnx_files` maps version-folder names
    (model.onnx, and its external data file if any) to the exported files."""
    unknown = set(tasks) - set(ENCODER_TASKS)
    if unknown:
        raise ValueError(f"encoder models serve {ENCODER_TASKS}; not {sorted(unknown)}")
    models = [
        _tokenizer_model(name, tokenizer, options),
        _encoder_model(name, family, hidden_size, onnx_files, options),
    ]
    if "embeddings" in tasks:
        models.append(_ensemble(name, "embeddings", [Tensor("embeddings", "FP32", (hidden_size,))], options,
                                {"embeddings": "embeddings"}))
    if "hiddens" in tasks:
        models.append(_ensemble(name, "hiddens",
                                [Tensor("hiddens", "FP32", (-1, hidden_size)), Tensor("mask", "BOOL", (-1,))],
                                options, {"hiddens": "hiddens"}))
    plan = RepositoryPlan(models)
    plan.validate()
    return plan
