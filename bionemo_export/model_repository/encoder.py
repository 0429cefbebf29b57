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
from bionemo_export.serving.models import SERVED_MODEL
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
SERVING_DIR = Path(__file__).resolve().parent.parent / "serving"
SERVED_PACKAGE = "bionemo_serving"
"""The name the served package (bionemo_export/serving/) has in a version folder."""


def served_package() -> dict[str, Path | str | bytes]:
    """Version-folder files: the whole served package, each module under SERVED_PACKAGE/ (numpy-only
    code with relative imports, the same in every Python model: one source of truth)."""
    return {f"{SERVED_PACKAGE}/{path.relative_to(SERVING_DIR).as_posix()}": path
            for path in sorted(SERVING_DIR.rglob("*.py")) if "__pycache__" not in path.parts}


def python_model(served_class: str, template: str | None = None, **docstring: object
                 ) -> tuple[dict[str, str], dict[str, Path | str | bytes]]:
    """(config parameters, version-folder files) of a Python model served by the class
    `served_class` ("module.Class" of the served package, a serving/models.ServedModel): the
    `served_model` parameter naming it, the static model.py and the served package. model.py's
    docstring is written for the model from templates/<template>_model.py.j2 with `docstring`, or,
    without a template, names the model (`model_name`) and its class."""
    if template is None:
        text = f'"""{docstring["model_name"]}: served by bionemo_serving/{served_class.replace(".", ".py: ")}."""'
    else:
        text = render(f"{template}_model.py.j2", tool_version=__version__, **docstring).rstrip("\n")
    return {SERVED_MODEL: served_class}, {"model.py": render("model.py.j2", docstring=text), **served_package()}


def tokenizer_files(tokenizer) -> tuple[dict[str, str], dict[str, Path | str]]:
    """(config parameters, version-folder files) with which a generated model loads `tokenizer`
    (serving/tokenizer_file.py): the `tokenizer_class` parameter and tokenizer.json."""
    module = type(tokenizer).__module__.rsplit(".", 1)[-1]
    name = f"{module}.{type(tokenizer).__name__}"
    if name not in TOKENIZER_CLASSES:  # a new tokenizer class is one entry there
        raise ValueError(f"tokenizer {name} is not in serving/tokenizer_file.TOKENIZER_CLASSES")
    return {"tokenizer_class": name}, {TOKENIZER_FILE: json.dumps(tokenizer.to_dict(), indent=2) + "\n"}


def _io_lines(inputs: list[TensorSpec], outputs: list[TensorSpec], batched: bool = True) -> list[str]:
    """Docstring lines describing the tensors, aligned like a table."""
    lines = []
    for label, tensors in (("Inputs", inputs), ("Outputs", outputs)):
        for i, tensor in enumerate(tensors):
            dims = ", ".join((["batch"] if batched else []) + [str(d) for d in tensor.dims])
            lines.append(f"{label if i == 0 else '':<8}{tensor.name:<16}{tensor.dtype:<6}[{dims}]")
    return lines


def tokenizer_sources(tokenizer) -> str:
    """The tokenizer's module in the served package, for a generated docstring."""
    return f"{SERVED_PACKAGE}/tokenizers/{type(tokenizer).__module__.rsplit('.', 1)[-1]}.py"


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
    served, code = python_model("models.TokenizerModel", "tokenizer", model_name=f"{name}_tokenizer",
                                encoder_name=f"{name}_encoder", tokenizer_sources=tokenizer_sources(tokenizer),
                                layout=describe_layout(tokenizer))
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
                    **tokenizer_parameters, "public_prefix": name, **served},
        files={**code, **files},
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

    limits = {axis: high for axis, (_, high) in shapes.sizes.items() if axis != "batch"}
    return options.serving_backend.plan_graph(GraphModel(
        plan, role, what, dict(onnx_files), shapes,
        lambda: python_model("models.GraphModelRunner", "onnx", model_name=model_name, family=family,
                             what=what, io_lines=_io_lines(inputs, outputs, batched=False)),
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
    python_files: dict[str, Path | str] = {}
    if fused:
        parameters.update(truncate="true" if options.truncate else "false", public_prefix=name,
                          **tokenizer_parameters)
        python_files.update(files)
        if options.max_residues:  # over-long sequences as overlapping windows (serving/windows.py)
            parameters.update(max_residues=str(options.max_residues), window_overlap=str(options.window_overlap))
    else:
        parameters.update(pad_id=str(tokenizer.pad_id), vocab_size=str(tokenizer.vocab_size),
                          max_length=str(tokenizer.max_length))

    def encoder_python_model() -> tuple[dict[str, str], dict[str, Path | str | bytes]]:
        return python_model("models.EncoderModel", "encoder", model_name=plan.name, family=family, tokenize=fused,
                            io_lines=_io_lines(inputs, outputs), layout=describe_layout(tokenizer),
                            tokenizer_sources=tokenizer_sources(tokenizer), max_length=tokenizer.max_length)

    backend.plan_graph(GraphModel(plan, role, "encoder", dict(onnx_files), encoder_shapes(tokenizer, options),
                                  encoder_python_model, python_files=python_files, python_parameters=parameters,
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
