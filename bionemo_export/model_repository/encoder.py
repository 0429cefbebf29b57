"""The repository layout for encoder models (embeddings, hiddens).

For `--name N`, with `--backend python` (the "fused" layout, the default there):

    N_encoder     python    sequences BYTES [1] -> hiddens FP32 [-1, H], embeddings FP32 [H], mask BOOL [-1]
                            (tokenizes, then runs the exported graph with ONNX Runtime; requests of
                            any lengths batched together in length buckets)
    N_embeddings  ensemble  sequences -> embeddings       (one step: N_encoder)
    N_hiddens     ensemble  sequences -> hiddens, mask    (one step: N_encoder)

With `--backend native` or `tensorrt`, or `layout="ensemble"` (ServingOptions), a tokenizer model
feeds the graph:

    N_tokenizer   python    sequences BYTES [1] -> input_ids, attention_mask INT64 [-1], mask BOOL [-1]
                            (native/tensorrt: padded to a multiple of the length bucket, so that
                            requests of close lengths have equal shapes and Triton batches them)
    N_encoder     graph     input_ids, attention_mask, residue_mask -> hiddens FP32 [-1, H], embeddings FP32 [H]
                            (run by the backend, backends.py: onnxruntime_onnx, tensorrt_plan, or a
                            Python-backend model running ONNX Runtime, whose token inputs allow
                            ragged batches)
    N_embeddings  ensemble  sequences -> embeddings       (tokenizer -> encoder)
    N_hiddens     ensemble  sequences -> hiddens, mask    (tokenizer -> encoder; mask from the tokenizer)

Pooling (masked mean over residues) happens inside the exported graph, so `N_embeddings` adds no
Python step after the encoder. Every model's settings come from its role in options.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from bionemo_export import __version__
from bionemo_export.errors import InvalidInputError
from bionemo_export.serving.parameters import UNOPTIMIZED_SERVING_LEVEL
from bionemo_export.serving.tokenizer_file import TOKENIZER_CLASSES, TOKENIZER_FILE
from bionemo_export.tasks import TASKS, Requirement
from bionemo_export.templates import render
from bionemo_export.tensors import DType, TensorSpec

from .backends import BACKENDS, GraphModel, ShapeRange
from .options import RoleOptions, ServingOptions
from .plan import EnsembleStep, ModelPlan, RepositoryPlan

__all__ = ["BACKENDS", "ENCODER_TASKS", "ServingOptions", "plan_encoder_repository"]

ENCODER_TASKS = ("embeddings", "hiddens")
"""The tasks whose models this module plans."""
# Numpy-only sources copied verbatim from here into the repository (one source of truth).
TOKENIZERS_DIR = Path(__file__).resolve().parent.parent / "tokenizers"
SERVING_DIR = Path(__file__).resolve().parent.parent / "serving"


def _io_lines(inputs: list[TensorSpec], outputs: list[TensorSpec], batched: bool = True) -> list[str]:
    """Docstring lines describing the tensors, aligned like a table."""
    lines = []
    for label, tensors in (("Inputs", inputs), ("Outputs", outputs)):
        for i, tensor in enumerate(tensors):
            dims = ", ".join((["batch"] if batched else []) + [str(d) for d in tensor.dims])
            lines.append(f"{label if i == 0 else '':<8}{tensor.name:<16}{tensor.dtype:<6}[{dims}]")
    return lines


def tokenizer_files(tokenizer) -> tuple[dict[str, str], dict[str, Path | str]]:
    """(config parameters, version-folder files) with which a generated model loads `tokenizer`
    (serving/tokenizer_file.py): the `tokenizer_class` parameter, and tokenizer.json, the
    tokenizer's module, character.py (the shared Encoded and TokenizationError types) and
    tokenizer_file.py."""
    module = type(tokenizer).__module__.rsplit(".", 1)[-1]
    name = f"{module}.{type(tokenizer).__name__}"
    if name not in TOKENIZER_CLASSES:  # a new tokenizer class is one entry there
        raise ValueError(f"tokenizer {name} is not in serving/tokenizer_file.TOKENIZER_CLASSES")
    files: dict[str, Path | str] = {
        f"{module}.py": TOKENIZERS_DIR / f"{module}.py", "character.py": TOKENIZERS_DIR / "character.py",
        **serving_files("tokenizer_file"), TOKENIZER_FILE: json.dumps(tokenizer.to_dict(), indent=2) + "\n"}
    return {"tokenizer_class": name}, files


SHARED_MODULES = {"numerics": SERVING_DIR.parent / "numerics.py"}
"""numpy-only modules outside serving/ that served code imports (the package's one cosine)."""


def serving_files(*modules: str) -> dict[str, Path | str]:
    """Version-folder files for the serving modules a generated model imports (serving/*.py, and
    SHARED_MODULES)."""
    return {f"{module}.py": SHARED_MODULES.get(module, SERVING_DIR / f"{module}.py") for module in modules}


RESPONDING = ("parameters", "responses")
"""The serving modules every generated Python model imports: its settings and error responses."""
RUNS_GRAPH = (*RESPONDING, "host", "numerics", "golden", "onnx_session")
"""... and those of a model that opens ONNX Runtime sessions itself."""
ENCODING = ("batching", "encoding", "windows")
"""... and those of the tokenizer and encoder models (encoding.py and what it imports)."""


def tokenizer_sources(files: dict[str, Path | str]) -> str:
    """The tokenizer's modules among `files`, for a generated docstring: "smiles.py, character.py"."""
    return ", ".join(name for name in files if name.endswith(".py") and name != "tokenizer_file.py")


def describe_layout(tokenizer) -> str:
    """How a sequence becomes tokens, for the generated docstring: '<cls> + residues + <eos>, ...'."""
    parts = [t for t in (tokenizer.bos_token,) if t] + ["tokens"] + [t for t in (tokenizer.eos_token,) if t]
    return " + ".join(parts) + f", padded with {tokenizer.pad_token}"


def _instances(role: RoleOptions) -> dict:
    return dict(instance_count=role.instances, dynamic_batching=role.batching)


def _tokenizer_model(name: str, tokenizer, options: ServingOptions) -> ModelPlan:
    sequences = TensorSpec("sequences", DType.BYTES, (1,))
    outputs = [TensorSpec("input_ids", DType.INT64, (-1,)), TensorSpec("attention_mask", DType.INT64, (-1,)),
               TensorSpec("mask", DType.BOOL, (-1,))]
    tokenizer_parameters, files = tokenizer_files(tokenizer)
    code = render(
        "tokenizer_model.py.j2",
        model_name=f"{name}_tokenizer", encoder_name=f"{name}_encoder", tool_version=__version__,
        tokenizer_sources=tokenizer_sources(files), layout=describe_layout(tokenizer),
    )
    return ModelPlan(
        name=f"{name}_tokenizer",
        inputs=[sequences], outputs=outputs,
        max_batch_size=options.max_batch_size,
        backend="python",
        **_instances(options.role("tokenizer")),
        # A Python encoder joins ragged rows itself; Triton's own runtimes batch equal shapes only.
        parameters={"truncate": "true" if options.truncate else "false",
                    "length_bucket": "0" if options.serving_backend.runs_python
                    else str(options.role("encoder").length_bucket),
                    **tokenizer_parameters, "public_prefix": name},
        files={"model.py": code, **files, **serving_files(*RESPONDING, *ENCODING)},
        description="tokenizer (Python backend)",
    )


def graph_model(model_name: str, family: str, inputs: list[TensorSpec], outputs: list[TensorSpec],
                onnx_files: dict[str, Path], *, role: RoleOptions, options: ServingOptions, what: str,
                shapes: ShapeRange, token_inputs: dict[str, int] | None = None) -> ModelPlan:
    """A model that runs one exported ONNX graph whose batch is not its first axis (key/value
    caches laid out [layers, batch, ...]): max_batch_size 0 and full shapes in dims; its callers
    batch. The backend decides what runs it; in the Python backend, model.py checks a direct
    caller's inputs: named axes agree and stay within `shapes`' largest sizes; `token_inputs`
    (input -> vocabulary size) hold ids in [0, size)."""
    plan = ModelPlan(name=model_name, inputs=inputs, outputs=outputs, max_batch_size=0)

    def python_model() -> str:
        return render("onnx_model.py.j2", model_name=model_name, family=family, what=what, tool_version=__version__,
                      io_lines=_io_lines(inputs, outputs, batched=False))

    python_files = serving_files(*RUNS_GRAPH, "graph_model")
    limits = {axis: high for axis, (_, high) in shapes.sizes.items() if axis != "batch"}
    return options.serving_backend.plan_graph(GraphModel(
        plan, role, what, dict(onnx_files), shapes, python_model, python_files=python_files,
        python_parameters=graph_input_parameters(shapes.axes, limits, token_inputs or {})))


def token_graph_model(model_name: str, family: str, tokenizer, outputs: list[TensorSpec], onnx_files: dict[str, Path],
                      *, role: RoleOptions, options: ServingOptions, what: str, min_length: int = 1) -> ModelPlan:
    """A graph that a Python model calls through BLS with the tokens of its rows, input_ids and
    attention_mask INT64 [rows, T] (the contacts, layers and attentions graphs): batched by its
    caller, at most max_batch_size rows of min_length..the tokenizer's limit tokens."""
    inputs = [TensorSpec("input_ids", DType.INT64, (-1, -1)), TensorSpec("attention_mask", DType.INT64, (-1, -1))]
    shapes = ShapeRange(axes={"input_ids": ("batch", "length"), "attention_mask": ("batch", "length")},
                        sizes={"batch": (1, options.max_batch_size), "length": (min_length, tokenizer.max_length)},
                        split_axis="length", bucket=options.length_bucket or 16, opt={"batch": 1})
    return graph_model(model_name, family, inputs, outputs, dict(onnx_files), role=role, options=options, what=what,
                       shapes=shapes, token_inputs={"input_ids": tokenizer.vocab_size})


def graph_input_parameters(axes: dict[str, tuple], axis_limits: dict[str, int],
                           token_inputs: dict[str, int]) -> dict[str, str]:
    """The config parameters from which a Python-backend graph model checks its callers' inputs
    (serving/graph_model.GraphInputs.from_parameters): each as JSON."""
    return {"axes": json.dumps({name: list(input_axes) for name, input_axes in axes.items()}),
            "axis_limits": json.dumps(axis_limits), "token_inputs": json.dumps(token_inputs)}


GRAPH_INPUTS = (("input_ids", DType.INT64), ("attention_mask", DType.INT64), ("residue_mask", DType.BOOL))


def encoder_shapes(tokenizer, options: ServingOptions) -> ShapeRange:
    """The shapes the tokenizer can send the encoder graph: up to max_batch_size rows of up to the
    tokenizer's limit (specials included); TensorRT profiles split the length at bucket multiples."""
    return ShapeRange(axes={name: ("batch", "length") for name, _ in GRAPH_INPUTS},
                      sizes={"batch": (1, options.max_batch_size), "length": (1, tokenizer.max_length)},
                      split_axis="length", bucket=options.length_bucket or 16,
                      opt={"batch": options.max_batch_size})  # a loaded server's batches are full


def _encoder_model(name: str, family: str, hidden_size: int, tokenizer, onnx_files: dict[str, Path],
                   options: ServingOptions, graph_optimization_level: str) -> ModelPlan:
    """N_encoder: the encoder graph; in the fused layout it takes the sequences and tokenizes."""
    role = options.role("encoder")
    fused = options.fused
    backend = options.serving_backend
    if fused:
        inputs = [TensorSpec("sequences", DType.BYTES, (1,))]
    else:  # Python: requests of different lengths may be batched together (the model joins them).
        inputs = [TensorSpec(n, dtype, (-1,), ragged=backend.runs_python) for n, dtype in GRAPH_INPUTS]
    outputs = [TensorSpec("hiddens", DType.FP32, (-1, hidden_size)),
               TensorSpec("embeddings", DType.FP32, (hidden_size,))]
    if fused:
        outputs.append(TensorSpec("mask", DType.BOOL, (-1,)))
    plan = ModelPlan(name=f"{name}_encoder", inputs=inputs, outputs=outputs,
                     max_batch_size=options.max_batch_size, dynamic_batching=role.batching)
    tokenizer_parameters, files = tokenizer_files(tokenizer)
    parameters = {**role.batching_parameters(), "warmup": "true" if options.warmup else "false",
                  "graph_optimization_level": graph_optimization_level,
                  "tokenize": "true" if fused else "false"}
    # graph_model, hosted_graphs: the graphs a build may fold into it (hosted_graphs.py)
    python_files: dict[str, Path | str] = serving_files(*RUNS_GRAPH, *ENCODING, "graph_model", "hosted_graphs")
    if fused:
        parameters.update(truncate="true" if options.truncate else "false", public_prefix=name,
                          **tokenizer_parameters)
        python_files.update(files)
        if options.max_residues:  # over-long sequences as overlapping windows (serving/windows.py)
            parameters.update(max_residues=str(options.max_residues), window_overlap=str(options.window_overlap))
    else:
        parameters.update(pad_id=str(tokenizer.pad_id), vocab_size=str(tokenizer.vocab_size),
                          max_length=str(tokenizer.max_length))

    def python_model() -> str:
        return render(
            "encoder_model.py.j2",
            model_name=plan.name, family=family, tool_version=__version__, tokenize=fused,
            io_lines=_io_lines(inputs, outputs), layout=describe_layout(tokenizer),
            tokenizer_sources=tokenizer_sources(files), max_length=tokenizer.max_length,
        )

    backend.plan_graph(GraphModel(plan, role, "encoder", dict(onnx_files), encoder_shapes(tokenizer, options),
                                  python_model, python_files=python_files, python_parameters=parameters,
                                  warmup=options.warmup))
    if backend.runs_python:
        plan.description = ("tokenizer + " if fused else "") + plan.description
    return plan


ENSEMBLE_VERSION_NOTE = """# {name}, version 1

An ensemble (see ../config.pbtxt) has no model file. This note keeps its version folder when the
repository is copied to object storage, where empty folders do not exist and Triton would refuse
the model for want of a version.
"""


def ensemble_model(name: str, task: str, outputs: list[TensorSpec], options: ServingOptions,
                   encoder_outputs: dict[str, str], after: Sequence[EnsembleStep] = ()) -> ModelPlan:
    """The public ensemble N_<task>: sequences through the encoder's steps (tokenizer first in the
    ensemble layout), whose `encoder_outputs` (encoder output -> ensemble tensor) go on to the
    steps `after` (e.g. the masked-LM head) or out as the ensemble's `outputs`."""
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
    steps += list(after)
    return ModelPlan(
        name=f"{name}_{task}",
        inputs=[TensorSpec("sequences", DType.BYTES, (1,))],
        outputs=outputs,
        max_batch_size=options.max_batch_size,
        platform="ensemble",
        response_cache=options.role(task).response_cache,
        steps=steps,
        # An ensemble has no model file, and an empty folder does not exist in object storage
        # (`aws s3 sync` and KServe's storage initializer drop it; Triton then refuses the model).
        files={"README.md": ENSEMBLE_VERSION_NOTE.format(name=f"{name}_{task}")},
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
    graph_optimization_level: str = UNOPTIMIZED_SERVING_LEVEL,
) -> RepositoryPlan:
    """Plan the repository for an encoder family; `onnx_files` maps version-folder names
    (model.onnx, and its external data file if any) to the exported files.
    `graph_optimization_level`: the ONNX Runtime level the stored graph is opened at (a graph
    stored optimized needs only the basic rewrites at load; see serving/parameters.py)."""
    # The masked-LM and fine-tuned heads' models (masked_lm.py, classifier.py) are added to this plan by the build.
    # Tasks of other planners that need no decoder add their models to this plan in the build.
    unknown = {t for t in tasks if t not in TASKS or Requirement.DECODER in TASKS[t].requires}
    if unknown:
        raise InvalidInputError(f"encoder models serve {ENCODER_TASKS}; not {sorted(unknown)}")
    models = [] if options.fused else [_tokenizer_model(name, tokenizer, options)]
    models.append(_encoder_model(name, family, hidden_size, tokenizer, onnx_files, options, graph_optimization_level))
    for task in (TASKS[t] for t in ENCODER_TASKS if t in tasks):  # the public models, as tasks.py declares them
        outputs = [TensorSpec(t.name, t.dtype, t.shape({"H": hidden_size})) for t in task.outputs]
        models.append(ensemble_model(name, task.name, outputs, options, {t.name: t.name for t in outputs}))
    plan = RepositoryPlan(models)
    plan.validate()
    return plan
