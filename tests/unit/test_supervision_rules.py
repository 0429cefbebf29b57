"""What `serve`'s supervisor decides, without a server: the call graph it probes (ensemble steps
and BLS callees), its probe requests and what their answers mean, pending requests from Triton's
metrics, the instances it expects, the restart policy and reaped children (the supervisor against
real tritonservers: tests/e2e/test_serve_supervision.py)."""


from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest

from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.model_repository.reader import dependencies
from bionemo_export.runtime.probes import ProbeResult, instance_model, probe_inputs
from bionemo_export.runtime.stubs import Stub
from bionemo_export.runtime.supervisor import Observation, Supervisor, pending_requests


def _configs(plan) -> dict[str, dict]:
    """Each model's configuration as Triton's API serves it (protobuf JSON, snake_case)."""
    from google.protobuf.json_format import MessageToDict

    return {m.name: MessageToDict(m.to_config(), preserving_proto_field_name=True) for m in plan.models}


def _seq2seq_configs(tmp_path: Path, **options) -> dict[str, dict]:
    from bionemo_export.model_repository.seq2seq import plan_seq2seq_repository
    from bionemo_export.models.base import Seq2SeqModules, seq2seq_graph_specs
    from bionemo_export.tokenizers.character import CharacterTokenizer

    tokenizer = CharacterTokenizer(["<cls>", "<pad>", "<eos>", "C", "O"], residues="CO", pad_token="<pad>",
                                   bos_token="<cls>", eos_token="<eos>", unk_token=None, max_length=16)
    # the planner and seq2seq_graph_specs read only these shape fields of a Seq2SeqModules
    shapes = cast(Seq2SeqModules, SimpleNamespace(num_layers=1, num_heads=2, head_dim=4, vocab_size=5, begin_id=0,
                                                  end_id=2, max_decode_length=8))
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"not really onnx")
    plan = plan_seq2seq_repository(
        "mmb", family="megamolbart", hidden_size=8, tokenizer=tokenizer, seq2seq=shapes,
        graph_specs=seq2seq_graph_specs(shapes, 8), onnx_files={g: {"model.onnx": onnx} for g in
                                                                ("encoder", "cross_kv", "decoder_step")},
        options=ServingOptions(backend="python", **options),
    )
    return _configs(plan)


@pytest.mark.parametrize("layout", ["fused", "ensemble"])
def test_dependencies_cover_ensemble_steps_and_bls_callees(tmp_path, layout):
    configs = _seq2seq_configs(tmp_path, layout=layout)
    encoder_steps = ["mmb_encoder"] if layout == "fused" else ["mmb_tokenizer", "mmb_encoder"]
    assert dependencies("mmb_hiddens", configs.get) == encoder_steps
    # Fused: the decode loops run the decoder graphs themselves; ensemble: through BLS to their models.
    graphs = [] if layout == "fused" else ["mmb_cross_kv", "mmb_decoder_step"]
    assert dependencies("mmb_decodes", configs.get) == graphs
    assert dependencies("mmb_samplings", configs.get) == ["mmb_encoder", *graphs]


def test_probe_requests_are_tiny_and_valid():
    """Built from the task table's required inputs (optional ones keep their defaults)."""
    sequences = {"name": "x_embeddings", "inputs": [{"name": "sequences", "datatype": "BYTES", "shape": [-1, 1]}]}
    assert probe_inputs({}, sequences)["sequences"].tolist() == [[b"C"]]
    exact = {"parameters": {"health_probe": {"string_value": "MKV"}}}
    assert probe_inputs(exact, sequences)["sequences"].tolist() == [[b"MKV"]]
    sampling = {"name": "x_samplings",
                "inputs": [*sequences["inputs"], {"name": "num_samples", "datatype": "INT32", "shape": [-1, 1]}]}
    assert list(probe_inputs({}, sampling)) == ["sequences"]
    decodes = {"name": "x_decodes", "inputs": [{"name": "hiddens", "datatype": "FP32", "shape": [-1, -1, 8]},
                                               {"name": "mask", "datatype": "BOOL", "shape": [-1, -1]}]}
    probe = probe_inputs({}, decodes)
    assert probe["hiddens"].shape == (1, 1, 8) and probe["hiddens"].dtype == np.float32
    assert not probe["hiddens"].any() and probe["mask"].tolist() == [[True]]
    with pytest.raises(ValueError, match="x_encoder: not a public model"):
        probe_inputs({}, {"name": "x_encoder", "inputs": sequences["inputs"]})
    with pytest.raises(ValueError, match="no fixed size"):
        probe_inputs({}, {"name": "x_decodes", "inputs": [{"name": "hiddens", "datatype": "FP32",
                                                           "shape": [-1, -1, -1]}]})


def test_probe_results_tell_turned_away_and_dead_instances():
    busy = ProbeResult("m_embeddings", False, 0.01,
                       "m_embeddings: in ensemble 'm_embeddings', Exceeds maximum queue size")
    assert busy.turned_away and busy.dead_instance is None and busy.line().startswith("busy")
    dead = ProbeResult("m_samplings", False, 0.2, "m_samplings: Stub process 'm_decoder_step_0_1' is not healthy.")
    assert not dead.turned_away and dead.dead_instance == "m_decoder_step_0_1"
    assert instance_model(dead.dead_instance) == "m_decoder_step" and dead.line().startswith("FAIL")
    assert not ProbeResult("m", True, 0.01).turned_away


def test_progress_is_a_finished_request_or_cpu_used_by_a_stub():
    stub = Stub(pid=10, model="m_encoder", instance="m_encoder_0_0", region="", zombie=False, cpu_ticks=100)
    before = Observation({"m_encoder": 3}, {"m_encoder": 7}, [stub])
    assert not before.progressed_since(before, ["m_embeddings", "m_encoder"])
    finished = Observation({"m_encoder": 3}, {"m_encoder": 8}, [stub])
    assert finished.progressed_since(before, ["m_encoder"])
    working = Observation({"m_encoder": 3}, {"m_encoder": 7}, [replace(stub, cpu_ticks=104)])
    assert working.progressed_since(before, ["m_encoder"])
    assert not working.progressed_since(before, ["m_decodes"])  # another model's progress says nothing


def test_pending_requests_are_read_from_tritons_metrics(tmp_path):
    import http.server

    text = (b'# TYPE nv_inference_pending_request_count gauge\n'
            b'nv_inference_pending_request_count{model="m_encoder",version="1"} 12\n'
            b'nv_inference_pending_request_count{model="m_embeddings",version="1"} 0\n'
            b'nv_inference_count{model="m_encoder",version="1"} 99\n')

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.handle_request)
    thread.start()
    try:
        pending = pending_requests(f"http://127.0.0.1:{server.server_port}/metrics")
        assert pending == {"m_encoder": 12, "m_embeddings": 0}
    finally:
        thread.join(10)
        server.server_close()


def test_expected_instances_follow_the_config_triton_serves():
    supervisor = Supervisor("grpc://127.0.0.1:1")
    configs = {
        "m_encoder": {"backend": "python", "instance_group": [{"name": "m_encoder_0", "count": 2, "kind": "KIND_CPU"}]},
        "m_samplings": {"backend": "python", "instance_group": [{"count": 1}, {"name": "extra", "count": 1}]},
        "m_embeddings": {"platform": "ensemble"},
        "m_graph": {"platform": "onnxruntime_onnx", "instance_group": [{"count": 1}]},
    }
    supervisor.config_of = configs.get  # type: ignore[method-assign]
    assert supervisor.expected_instances("m_encoder") == {"m_encoder_0_0", "m_encoder_0_1"}
    assert supervisor.expected_instances("m_samplings") == {"m_samplings_0_0", "extra_0"}
    assert supervisor.expected_instances("m_embeddings") == set() == supervisor.expected_instances("m_graph")


def test_reaped_children_grows_when_a_child_ends_and_is_waited_for():
    """The signal for a stub killed and reaped between two looks at /proc."""
    import sys

    from bionemo_export.runtime.stubs import reaped_children

    before = reaped_children(os.getpid())
    subprocess.run([sys.executable, "-c", "pass"], check=True)  # a child that ran, ended, was waited for
    assert reaped_children(os.getpid()) > before
    assert reaped_children(2 ** 22 + 7) == 0  # no such process


# -- a load watched for a lost stub (supervisor.LoadWatch) ----------------------------------------------------------


def test_the_reload_reaping_the_stubs_it_replaces_is_not_a_lost_stub():
    """Both old stubs (zombies 11, 12) are reaped while the new ones (21, 22) start: the reaped count
    moves, and that is the reload working, not a stub lost (it once restarted tritonserver)."""
    from bionemo_export.runtime.supervisor import LoadWatch

    watch = LoadWatch(old={11, 12}, reaped_before=100)
    assert not watch.stub_lost(100, {21}, {11, 12}, 100)
    assert not watch.stub_lost(100, {21, 22}, {12}, 140)  # 11 reaped between the two reads
    assert not watch.stub_lost(140, {21, 22}, {12}, 140)
    assert not watch.stub_lost(140, {21, 22}, set(), 175)  # 12 reaped before the first read
    assert not watch.stub_lost(175, {21, 22}, set(), 175)
    assert watch.stub_lost(190, {21, 22}, set(), 190)  # then a child nobody saw go: lost


@pytest.mark.parametrize("look", [
    (100, {21}, set(), 100),  # the new stub 22, seen alive before, is gone
    (100, {21, 22}, {31}, 100),  # a stub turned zombie
    (130, {21, 22}, set(), 130),  # a child reaped that no look saw: a stub killed as it started
], ids=["new-stub-gone", "new-zombie", "unseen-child-reaped"])
def test_a_stub_dying_during_the_load_is_lost(look):
    from bionemo_export.runtime.supervisor import LoadWatch

    watch = LoadWatch(old=set(), reaped_before=100)
    assert not watch.stub_lost(100, {21, 22}, set(), 100)
    assert watch.stub_lost(*look)
    assert watch.reason


def test_the_live_instances_a_reload_replaces_ending_is_not_a_lost_stub():
    """Finding (CI): a reload that gives back an idle model's shared memory replaces live
    instances (stubs 11, 12); Triton ends them as the new ones (21, 22) come in. Their turning zombie
    and being reaped is the reload working; it once restarted tritonserver. A new stub ending after
    that is still lost."""
    from bionemo_export.runtime.supervisor import LoadWatch

    watch = LoadWatch(old={11, 12}, reaped_before=100)
    assert not watch.stub_lost(100, {11, 12, 21}, set(), 100)
    assert not watch.stub_lost(100, {12, 21, 22}, {11}, 100)  # 11 ended: a zombie
    assert not watch.stub_lost(100, {21, 22}, {11}, 130)  # 12 reaped at once
    assert not watch.stub_lost(130, {21, 22}, set(), 160)  # 11 reaped
    assert not watch.stub_lost(160, {21, 22}, set(), 160)
    assert watch.stub_lost(160, {21}, set(), 160)  # the new 22 ended: lost
    assert "22" in watch.reason


def test_a_stub_that_dies_after_the_rounds_watch_is_reloaded_before_a_probe_meets_it(monkeypatch):
    """Found under CI's load: a stub killed between the round's watch and its probes met the probe,
    and Triton 2.51 keeps an instance a request failed on (a tritonserver restart's worth). The
    supervisor looks at the stubs again just before each probe and reloads the dead instance first."""
    import bionemo_export.runtime.supervisor as supervision

    configs = {"m_embeddings": {"platform": "ensemble", "ensemble_scheduling": {"step": [{"model_name": "m_encoder"}]}},
               "m_encoder": {"backend": "python", "instance_group": [{"name": "m_encoder_0", "count": 1}]}}
    lines: list[str] = []
    supervisor = Supervisor("grpc://127.0.0.1:1", ["m_embeddings"], server_pid=1, log=lines.append)
    supervisor.config_of = configs.get  # type: ignore[method-assign]
    stub = Stub(pid=10, model="m_encoder", instance="m_encoder_0_0", region="", zombie=False, cpu_ticks=1)
    state = {"stubs": [stub], "looks": 0}

    def observe() -> Observation:
        state["looks"] += 1
        if state["looks"] == 2:  # the stub is killed right after the round's watch looked
            state["stubs"] = []
        return Observation({}, {}, list(state["stubs"]))

    def reload(models: list[str]) -> None:
        assert models == ["m_encoder"]
        state["stubs"] = [replace(stub, pid=11)]

    probed: list[bool] = []

    def probe(client, model: str) -> ProbeResult:
        probed.append(bool(state["stubs"]))  # a probe through the dead stub would fail and keep it
        return ProbeResult(model, bool(state["stubs"]), 0.01)

    monkeypatch.setattr(supervisor, "observe", observe)
    monkeypatch.setattr(supervisor, "reload", reload)
    monkeypatch.setattr(supervision, "probe_model", probe)
    supervisor.check()
    assert probed and all(probed), "a probe was sent through the dead stub"
    assert lines[0] == ("health: m_encoder: instance m_encoder_0_0 died (its stub process is gone); "
                        "reloading m_encoder alone")
    assert "health: m_embeddings answers again (0.01 s)" in lines
