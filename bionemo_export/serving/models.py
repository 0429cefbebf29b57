"""The Python-backend models a repository serves, and the one class every generated model.py imports.

Every Python model's model.py is the same few lines (a docstring written for the model, then
`from bionemo_serving.models import TritonPythonModel`), and this package is copied whole beside
it as `bionemo_serving/`. `TritonPythonModel` reads the config parameter `served_model` and hands
the model to the ServedModel class it names ("models.EncoderModel"; a task's own module may hold
its class: "norms.NormsModel"); each class reads its settings from the
config's `parameters` (parameters.py) and answers through a `Responder` (responses.py), which
fails a bad request alone and words the error. A class imports what it runs when it is chosen, so
a model that runs no graph never imports onnxruntime.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from typing import Any

from .parameters import config_file, flag_parameter, model_config, model_parameters, number_parameter, tensor_names
from .responses import Responder

SERVED_MODEL = "served_model"
"""The config parameter naming a Python model's class: a key of SERVED_MODELS."""
Args = Mapping[str, str]


class ServedModel:
    """A served model: `initialize` sets `responder` and `model` (whose `execute` answers a batch of
    requests), from Triton's `args` and the model's version folder `folder`."""

    responder: Responder
    model: Any

    def initialize(self, args: Args, folder: str) -> None:
        raise NotImplementedError

    def execute(self, requests: list) -> list:
        return self.responder.answer_all(requests, self.model.execute)


class EncoderModel(ServedModel):
    """N_encoder: the encoder graph over requests' joined rows (encoding.py), tokenizing them first
    in the fused layout; the graphs it hosts over its weights file answer their own outputs."""

    def initialize(self, args: Args, folder: str) -> None:
        from .encoding import GraphEncoder, TokenCounters, TokenInputs, sequence_inputs
        from .hosted_graphs import HostedGraphs
        from .onnx_session import create_session

        session, parameters = create_session(args, folder)
        if flag_parameter(parameters, "tokenize"):  # the fused layout: sequences in, tokenized here
            read, pad_id, tokenization_errors = sequence_inputs(args, parameters, folder)
            input_prefix = parameters["public_prefix"]  # errors name the public model's input
        else:
            read = TokenInputs(number_parameter(args, parameters, "vocab_size"),
                               number_parameter(args, parameters, "max_length"))
            pad_id, tokenization_errors = number_parameter(args, parameters, "pad_id"), ()
            input_prefix = args["model_name"]
        self.responder = Responder(args["model_name"], tokenization_errors)
        # Graphs beside model.onnx over its weights.bin (the layers, contacts and attentions ones;
        # config parameter hosted_graphs): a request asking their outputs is theirs (hosted_graphs.py).
        self.hosted = HostedGraphs.open(
            args, parameters, self.responder,
            lambda graph, level: create_session(args, folder, graph, prepack=False, level=level)[0])
        outputs = [name for name in tensor_names(args, "output") if name not in self.hosted.outputs]
        self.model = GraphEncoder(
            session, read, outputs=outputs, pad_id=pad_id,
            length_bucket=number_parameter(args, parameters, "length_bucket", "0"),
            token_budget=number_parameter(args, parameters, "token_budget", "0"),
            max_sub_batch=number_parameter(args, parameters, "max_sub_batch", "0"),
            responder=self.responder, input_prefix=input_prefix, counters=TokenCounters(args["model_name"]))
        if flag_parameter(parameters, "warmup"):
            self.model.warm_up()

    def execute(self, requests: list) -> list:
        return self.responder.answer_all(
            requests, lambda batch: self.hosted.serve(batch, self.model.execute, self.responder))


class TokenizerModel(ServedModel):
    """N_tokenizer (the ensemble layout): sequences to the encoder's token inputs."""

    def initialize(self, args: Args, folder: str) -> None:
        from .encoding import Tokenizing, sequence_inputs

        parameters = model_parameters(args)
        read, _, tokenization_errors = sequence_inputs(args, parameters, folder)
        self.responder = Responder(args["model_name"], tokenization_errors)
        self.model = Tokenizing(read, number_parameter(args, parameters, "length_bucket", "0"), self.responder,
                                input_prefix=parameters["public_prefix"])


class GraphModelRunner(ServedModel):
    """A graph run by the Python backend as it stands (a head, a decoder graph: graph_model.py)."""

    def initialize(self, args: Args, folder: str) -> None:
        from .graph_model import GraphInputs, GraphModel
        from .onnx_session import create_session

        session, parameters = create_session(args, folder)
        self.responder = Responder(args["model_name"])
        self.model = GraphModel(session, tensor_names(args, "input"), tensor_names(args, "output"),
                                GraphInputs.from_parameters(args, parameters), self.responder)


class PositionwiseModel(ServedModel):
    """A position-wise graph (the masked-LM head) over the requests' joined positions (positionwise.py)."""

    def initialize(self, args: Args, folder: str) -> None:
        from .onnx_session import create_session
        from .positionwise import PositionwiseGraph

        session, parameters = create_session(args, folder)
        self.responder = Responder(args["model_name"])
        self.model = PositionwiseGraph(
            session, input_name=tensor_names(args, "input")[0], output_name=tensor_names(args, "output")[0],
            width=int(model_config(args)["input"][0]["dims"][-1]),
            token_budget=number_parameter(args, parameters, "token_budget"), responder=self.responder)


class LabelsModel(ServedModel):
    """N_labels: a fine-tuned head's logits named by its labels (labels.py)."""

    def initialize(self, args: Args, folder: str) -> None:
        from .labels import LabelModel

        parameters = model_parameters(args)
        self.responder = Responder(args["model_name"])
        self.model = LabelModel(json.loads(parameters["labels"]), parameters["problem_type"], self.responder)


class ScoresModel(ServedModel):
    """N_scores: variant effects and PLLs over BLS calls to N_logits (scores.py, scoring.py)."""

    def initialize(self, args: Args, folder: str) -> None:
        from .scores import VariantScorer, logits_caller, members_caller
        from .scoring import ScoringLimits

        parameters = model_parameters(args)
        self.responder = Responder(args["model_name"])
        members = number_parameter(args, parameters, "members", 0)  # a checkpoint ensemble's
        self.model = VariantScorer(
            logits_caller(parameters["logits_model"]), alphabet=json.loads(parameters["alphabet"]),
            mask_char=parameters["mask_char"], limits=ScoringLimits.from_parameters(parameters),
            chunk=number_parameter(args, parameters, "max_batch_size"), responder=self.responder,
            default_method=parameters.get("default_method") or "wt-marginal",
            structure_aware=parameters.get("structure_aware") == "true",
            run_members=members_caller(parameters["logits_model"]) if members else None, members=members)


class MemberMeanModel(ServedModel):
    """N_member_mean: a checkpoint ensemble's mean log-probabilities (member_mean.py)."""

    def initialize(self, args: Args, folder: str) -> None:
        from .member_mean import MemberMean

        parameters = model_parameters(args)
        self.responder = Responder(args["model_name"])
        self.model = MemberMean(number_parameter(args, parameters, "members"), responder=self.responder)


class DecodesModel(ServedModel):
    """N_decodes: greedy decoding of hidden states (decoding.py, search.py)."""

    def initialize(self, args: Args, folder: str) -> None:
        from .decoding import GreedyDecodes, decode_settings, decoder_from_parameters
        from .search import GenerationError
        from .tokenizer_file import load_tokenizer

        parameters = model_parameters(args)
        tokenizer = load_tokenizer(folder, parameters)
        decoder = decoder_from_parameters(args, parameters, folder)
        self.responder = Responder(args["model_name"], (GenerationError,))
        self.model = GreedyDecodes(tokenizer, decoder, decode_settings(args), self.responder)


class SamplingsModel(ServedModel):
    """N_samplings: sequences sampled around each input (sampling.py, search.py)."""

    def initialize(self, args: Args, folder: str) -> None:
        from .decoding import decode_settings, decoder_from_parameters
        from .sampling import Samplings
        from .search import GenerationError
        from .tokenizer_file import load_tokenizer
        from .tokenizers.character import TokenizationError

        parameters = model_parameters(args)
        tokenizer = load_tokenizer(folder, parameters)
        decoder = decoder_from_parameters(args, parameters, folder)
        self.responder = Responder(args["model_name"], (TokenizationError, GenerationError))
        self.model = Samplings(tokenizer, decoder, decode_settings(args), self.responder,
                               encoder_model=parameters["encoder_model"],
                               encoder_tokenizes=flag_parameter(parameters, "encoder_tokenizes"))


class RowsThroughGraphModel(ServedModel):
    """A public model that tokenizes each row and calls its graph through BLS (row_calls.py):
    `rows` makes the model of its kind from the config parameters, the tokenizer and the graph call."""

    def initialize(self, args: Args, folder: str) -> None:
        from .tokenizer_file import load_tokenizer
        from .tokenizers.character import TokenizationError

        parameters = model_parameters(args)
        self.responder = Responder(args["model_name"], (TokenizationError,))
        self.model = self.rows(args, parameters, load_tokenizer(folder, parameters))

    def rows(self, args: Args, parameters: Mapping[str, str], tokenizer: Any) -> Any:
        raise NotImplementedError


class ContactsModel(RowsThroughGraphModel):
    """N_contacts: one contact map per sequence over BLS calls to the contacts graph (contacts.py)."""

    def rows(self, args: Args, parameters: Mapping[str, str], tokenizer: Any) -> Any:
        from .contacts import ContactMaps, graph_caller

        return ContactMaps(tokenizer, graph_caller(parameters["graph_model"]),
                           max_residues=number_parameter(args, parameters, "max_residues"),
                           pair_budget=number_parameter(args, parameters, "pair_budget"),
                           max_rows=number_parameter(args, parameters, "max_rows"), responder=self.responder)


class LayersModel(RowsThroughGraphModel):
    """N_layers: the layers and poolings a request names, over BLS calls to the layers graph (layers.py)."""

    def rows(self, args: Args, parameters: Mapping[str, str], tokenizer: Any) -> Any:
        from .layers import LayerEmbeddings, graph_caller

        return LayerEmbeddings(tokenizer, graph_caller(parameters["graph_model"]),
                               num_layers=number_parameter(args, parameters, "num_layers"),
                               has_bos=flag_parameter(parameters, "has_bos"),
                               token_budget=number_parameter(args, parameters, "token_budget"),
                               max_rows=number_parameter(args, parameters, "max_rows"), responder=self.responder)


class AttentionsModel(RowsThroughGraphModel):
    """N_attentions: the blocks and heads a request names, over BLS calls to the attentions graph
    (attentions.py)."""

    def rows(self, args: Args, parameters: Mapping[str, str], tokenizer: Any) -> Any:
        from .attentions import AttentionWeights, graph_caller

        return AttentionWeights(tokenizer, graph_caller(parameters["graph_model"]),
                                num_layers=number_parameter(args, parameters, "num_layers"),
                                num_heads=number_parameter(args, parameters, "num_heads"),
                                max_values=number_parameter(args, parameters, "max_attention_values"),
                                pair_budget=number_parameter(args, parameters, "pair_budget"),
                                max_rows=number_parameter(args, parameters, "max_rows"), responder=self.responder)


class TritonPythonModel:
    """What Triton's Python backend instantiates: the class that config parameter `served_model`
    names ("module.Class" of this package, a ServedModel), for the model whose version folder
    holds this package."""

    def initialize(self, args: Args) -> None:
        self.served = served_class(args, model_parameters(args).get(SERVED_MODEL, ""))()
        # This package lies in the model's version folder, beside model.py and the model's files.
        self.served.initialize(args, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def execute(self, requests: list) -> list:
        return self.served.execute(requests)


def served_class(args: Args, name: str) -> type[ServedModel]:
    """The ServedModel class `name` ("module.Class") of this package; ValueError naming the model's
    config.pbtxt for any other name."""
    module, _, class_name = name.rpartition(".")
    found = None
    if module and module.replace("_", "").isalnum():  # a module of this package, not a path
        try:
            found = getattr(importlib.import_module(f".{module}", __package__), class_name, None)
        except ImportError:
            found = None
    if not (isinstance(found, type) and issubclass(found, ServedModel)):
        raise ValueError(f"{config_file(args)}: parameter {SERVED_MODEL} is {name!r}, not a served model class "
                         "of bionemo_serving (module.Class); rebuild the repository")
    return found
