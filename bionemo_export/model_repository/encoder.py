"""The repository layout for encoder models (embeddings, hiddens).

For `--name N`, with `--backend python` (the "fused" layout, the default there):

    N_encoder     python    sequences BYTES [1] -> hiddens FP32 [-1, H], embeddings FP32 [H], mask BOOL [-1]
                            (tokenizes, then runs the exported graph with ONNX Runtime; requests of
                            any lengths batched together in length buckets)
    N_embeddings  ensemble  sequences -> embeddings       (one step: N_encoder)
    N_hiddens     ensemble  sequences -> hiddens, mask    (one step: N_encoder)

With `--backend native`, or `layout="ensemble"` (ServingOptions), a tokenizer model feeds the graph:

    N_tokenizer   python    sequences BYTES [1] -> input_ids, attention_mask INT64 [-1], mask BOOL [-1]
    N_encoder     onnx      input_ids, attention_mask, residue_mask -> hiddens FP32 [-1, H], embeddings FP32 [H]
                            (platform onnxruntime_onnx with --backend native; a Python-backend model
                            running ONNX Runtime, whose token inputs allow ragged batches, with --backend python)
    N_embeddings  ensemble  sequences -> embeddings       (tokenizer -> encoder)
    N_hiddens     ensemble  sequences -> hiddens, mask    (tokenizer -> encoder; mask from the tokenizer)

Pooling (masked mean over residues) happens inside the exported graph, so `N_embeddings` adds no
Python step after the encoder. Every model's settings come from its role in options.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from bionemo_export import __version__
from bionemo_export.templates import render

from .options import BACKENDS, RoleOptions, ServingOptions
from .plan import EnsembleStep, ModelPlan, RepositoryPlan, Tensor

__all__ = ["BACKENDS", "ENCODER_TASKS", "ServingOptions", "plan_encoder_repository"]

ENCODER_TASKS = ("embeddings", "hiddens")
# Numpy-only sources copied verbatim from here into the repository (one source of truth).
TOKENIZERS_DIR = Path(__file__).resolve().parent.parent / "tokenizers"
SERVING_DIR = Path(__file__).resolve().parent.parent / "serving"


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


def serving_files(*modules: str) -> dict[str, Path]:
    """Version-folder files for the serving helpers a generated model imports (batching, host)."""
    return {f"{module}.py": SERVING_DIR / f"{module}.py" for module in modules}


def describe_layout(tokenizer) -> str:
    """How a sequence becomes tokens, for the generated docstring: '<cls> + residues + <eos>, ...'."""
    parts = [t for t in (tokenizer.bos_token,) if t] + ["tokens"] + [t for t in (tokenizer.eos_token,) if t]
    return " + ".join(parts) + f", padded with {tokenizer.pad_token}"


def _tokenizer_json(tokenizer) -> str:
    return json.dumps(tokenizer.to_dict(), indent=2) + "\n"


def _instances(role: RoleOptions) -> dict:
    return dict(instance_count=role.instances, dynamic_batching=role.batching)


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
        **_instances(options.role("tokenizer")),
        parameters={"truncate": "true" if options.truncate else "false"},
        files={"model.py": code, **files, "tokenizer.json": _tokenizer_json(tokenizer)},
        description="tokenizer (Python backend)",
    )


def graph_model(model_name: str, family: str, inputs: list[Tensor], outputs: list[Tensor],
                onnx_files: dict[str, Path], *, role: RoleOptions, backend: str, what: str,
                axes: dict[str, tuple[str | int, ...]], axis_limits: dict[str, int] | None = None,
                token_inputs: dict[str, int] | None = None) -> ModelPlan:
    """A model that runs one exported ONNX graph whose batch is not its first axis (key/value
    caches laid out [layers, batch, ...]): max_batch_size 0 and full shapes in dims; its callers
    batch. Triton's onnxruntime_onnx platform with `--backend native`, ONNX Runtime inside a
    Python-backend model with `--backend python`, which checks a direct caller's inputs: `axes`
    (each input's axes, dynamic ones named) must agree by name and stay within `axis_limits`;
    `token_inputs` (input -> vocabulary size) hold ids in [0, size)."""
    plan = ModelPlan(name=model_name, inputs=inputs, outputs=outputs, max_batch_size=0,
                     instance_count=role.instances, files=dict(onnx_files))
    if backend == "native":
        _native(plan, role, what)
    else:
        plan.backend = "python"
        plan.parameters.update(role.session_parameters())
        plan.files.update(serving_files("host"))
        plan.files["model.py"] = render(
            "onnx_model.py.j2",
            model_name=plan.name, family=family, what=what, tool_version=__version__,
            io_lines=_io_lines(inputs, outputs, batched=False),
            input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
            axes=axes, axis_limits=axis_limits or {}, token_inputs=token_inputs or {},
        )
        plan.description = f"{what} (ONNX Runtime in the Python backend)"
    return plan


def _native(plan: ModelPlan, role: RoleOptions, what: str) -> None:
    plan.platform = "onnxruntime_onnx"
    plan.default_model_filename = "model.onnx"
    if role.threads:
        plan.parameters["intra_op_thread_count"] = str(role.threads)
    plan.description = f"{what} (onnxruntime_onnx)"


GRAPH_INPUTS = (("input_ids", "INT64"), ("attention_mask", "INT64"), ("residue_mask", "BOOL"))


def _encoder_model(name: str, family: str, hidden_size: int, tokenizer, onnx_files: dict[str, Path],
                   options: ServingOptions) -> ModelPlan:
    """N_encoder: the encoder graph; in the fused layout it takes the sequences and tokenizes."""
    role = options.role("encoder")
    fused = options.fused
    if fused:
        inputs = [Tensor("sequences", "BYTES", (1,))]
    else:  # Python: requests of different lengths may be batched together (the model joins them).
        inputs = [Tensor(n, dtype, (-1,), ragged=options.backend == "python") for n, dtype in GRAPH_INPUTS]
    outputs = [Tensor("hiddens", "FP32", (-1, hidden_size)), Tensor("embeddings", "FP32", (hidden_size,))]
    if fused:
        outputs.append(Tensor("mask", "BOOL", (-1,)))
    plan = ModelPlan(name=f"{name}_encoder", inputs=inputs, outputs=outputs,
                     max_batch_size=options.max_batch_size, **_instances(role), files=dict(onnx_files))
    if options.backend == "native":
        _native(plan, role, "encoder")
        if options.warmup:
            plan.warmup = [_zero_warmup(inputs)]
        return plan
    module, class_name, files = tokenizer_files(tokenizer)
    plan.backend = "python"
    plan.parameters.update(role.graph_parameters(), warmup="true" if options.warmup else "false")
    if fused:
        plan.parameters["truncate"] = "true" if options.truncate else "false"
        plan.files.update(files, **{"tokenizer.json": _tokenizer_json(tokenizer)})
    else:
        plan.parameters["pad_id"] = str(tokenizer.pad_id)
    plan.files.update(serving_files("batching", "host"))
    plan.files["model.py"] = render(
        "encoder_model.py.j2",
        model_name=plan.name, family=family, tool_version=__version__, tokenize=fused,
        io_lines=_io_lines(inputs, outputs), output_names=[t.name for t in outputs],
        tokenizer_module=module, tokenizer_class=class_name, layout=describe_layout(tokenizer),
        tokenizer_sources=", ".join(files), public_prefix=name, vocab_size=tokenizer.vocab_size,
        max_length=tokenizer.max_length,
    )
    plan.description = ("tokenizer + encoder" if fused else "encoder") + " (ONNX Runtime in the Python backend)"
    return plan


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
    encoder = f"{name}_encoder"
    if options.fused:  # one step: the encoder model tokenizes
        steps = [EnsembleStep(encoder, {"sequences": "sequences"}, encoder_outputs)]
    else:  # the tokenizer's mask is the public mask
        steps = [
            EnsembleStep(
                model=f"{name}_tokenizer",
                input_map={"sequences": "sequences"},
                output_map={"input_ids": "input_ids", "attention_mask": "attention_mask", "mask": "mask"},
            ),
            EnsembleStep(
                model=encoder,
                input_map={"input_ids": "input_ids", "attention_mask": "attention_mask", "residue_mask": "mask"},
                output_map={k: v for k, v in encoder_outputs.items() if k != "mask"},
            ),
        ]
    return ModelPlan(
        name=f"{name}_{task}",
        inputs=[Tensor("sequences", "BYTES", (1,))],
        outputs=outputs,
        max_batch_size=options.max_batch_size,
        platform="ensemble",
        response_cache=options.role(task).response_cache,
        steps=steps,
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
    models = [] if options.fused else [_tokenizer_model(name, tokenizer, options)]
    models.append(_encoder_model(name, family, hidden_size, tokenizer, onnx_files, options))
    if "embeddings" in tasks:
        models.append(_ensemble(name, "embeddings", [Tensor("embeddings", "FP32", (hidden_size,))], options,
                                {"embeddings": "embeddings"}))
    if "hiddens" in tasks:
        models.append(_ensemble(name, "hiddens",
                                [Tensor("hiddens", "FP32", (-1, hidden_size)), Tensor("mask", "BOOL", (-1,))],
                                options, {"hiddens": "hiddens", "mask": "mask"}))
    plan = RepositoryPlan(models)
    plan.validate()
    return plan
