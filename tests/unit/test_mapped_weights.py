"""Loaded weights are pages of the checkpoint file, not copies (models/readers/mapped.py,
torch_files.py): a safetensors folder and a torch zip file named by path are memory-mapped, and a
build can hand a mapped model's pages back to the kernel without changing a value."""

from __future__ import annotations

import io

import torch

from bionemo_export.models import load_checkpoint
from bionemo_export.models.readers.mapped import mapped_bytes, mapped_file, page_out, resident_bytes
from bionemo_export.models.readers.torch_files import load_torch_weights
from bionemo_export.testing.large_checkpoints import write_random_checkpoint

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64}


def test_a_safetensors_checkpoint_is_loaded_as_pages_of_its_file(tmp_path):
    """Every encoder weight of a loaded fp32 ESM-2 is a view of model.safetensors' mapping: the
    model holds no copy of the weights (EsmModel's own contact head, which the encoder does not use,
    is zeroed memory; the contact predictor reads the checkpoint's)."""
    folder = write_random_checkpoint("esm2", tmp_path / "esm2", TINY)
    loaded = load_checkpoint(folder, "esm2")
    parameters = [p for name, p in loaded.encoder.named_parameters() if ".contact_head." not in name]
    in_files, anonymous = mapped_bytes(parameters)
    assert anonymous == 0 and in_files == sum(p.numel() * 4 for p in parameters)
    assert {mapped_file(p) for p in parameters} == {str((folder / "model.safetensors").resolve())}


def test_a_torch_file_named_by_path_is_mapped_and_a_buffer_is_read(tmp_path):
    """torch's zip format through open_torch_file's checks: by path, the tensors are pages of the
    file (mapped through the descriptor the checks read); from a buffer, ordinary memory."""
    weights = {"a": torch.randn(256, 256), "b": torch.randn(64)}
    path = tmp_path / "weights.pt"
    torch.save(weights, path)
    loaded, _ = load_torch_weights(path, str(path))
    assert all(torch.equal(loaded[key], weights[key]) for key in weights)
    assert mapped_file(loaded["a"]) == str(path.resolve())
    from_buffer, _ = load_torch_weights(io.BytesIO(path.read_bytes()), "buffer")
    assert mapped_file(from_buffer["a"]) is None and torch.equal(from_buffer["a"], weights["a"])


def test_paging_out_a_mapped_model_frees_its_pages_and_keeps_its_values(tmp_path):
    """page_out takes the mapped weights' pages out of the process (pagemap's present bit) and the
    next use reads the same values from the file; anonymous tensors are left alone."""
    path = tmp_path / "big.pt"
    torch.save({"w": torch.randn(2048, 2048)}, path)  # 16 MiB
    loaded, _ = load_torch_weights(path, str(path))
    tensor = loaded["w"]
    total = float(tensor.sum())
    before = resident_bytes([tensor])
    assert before >= 15 << 20
    assert page_out([tensor]) >= 15 << 20
    # The kernel may keep a few pages (ones it is still writing back); most must go.
    assert resident_bytes([tensor]) < before // 4
    assert float(tensor.sum()) == total
    anonymous = torch.randn(1024, 1024)
    assert page_out([anonymous]) == 0 and float(anonymous.sum()) == float(anonymous.sum())


def test_a_bf16_checkpoints_fp32_weights_are_pages_of_a_file_too(tmp_path, monkeypatch):
    """ESM C's released checkpoints are bf16 and compute in fp32: widened in memory, ESM C 6B's
    weights would be 25 GB of anonymous memory. Over the threshold they are widened into an unlinked
    file and mapped (readers/mapped.widened): pages a build can hand back, the same values as
    widening in memory; under it, plain memory."""
    from bionemo_export.models.readers import mapped

    weights = {"w": torch.randn(512, 512).bfloat16(), "b": torch.randn(512).bfloat16(), "n": torch.ones(3)}
    small = mapped.widened(weights)
    assert all(mapped_file(t) is None and t.dtype == torch.float32 for t in small.values())
    on_disk = mapped.widened(weights, directory=str(tmp_path), threshold=1 << 10)
    assert {key: t.dtype for key, t in on_disk.items()} == dict.fromkeys(weights, torch.float32)
    assert all(torch.equal(on_disk[key], weights[key].float()) for key in weights)
    assert mapped_file(on_disk["w"]) is not None and mapped_file(on_disk["b"]) is not None
    assert mapped_file(on_disk["n"]) is None  # fp32 already: left as it was
    assert not list(tmp_path.iterdir())  # unlinked: the disk is given back with the last tensor
    assert page_out([on_disk["w"]]) > 0 and torch.equal(on_disk["w"], weights["w"].float())

    folder = write_random_checkpoint("esmc", tmp_path / "esmc", TINY)  # bf16, as released
    monkeypatch.setattr(mapped, "WIDEN_ON_DISK_BYTES", 1 << 10)
    loaded = load_checkpoint(folder, "esmc")
    parameters = [p for name, p in loaded.encoder.named_parameters() if p.numel() > 64]
    assert parameters and all(mapped_file(p) is not None for p in parameters)


def test_a_deferred_widening_holds_each_blocks_fp32_weights_only_while_it_is_used(tmp_path, monkeypatch):
    """Under widening_deferred (a streamed build), a bf16 model's layer weights are not written to
    the widened file (ESM-2 15B's would need 60 GB of disk): each layer widens its own in memory
    while it computes, a weight read inside widened_while_used holds its values, and the answers
    are those of the model widened whole. The rest (embeddings, heads) is widened as before."""
    from bionemo_export.models.readers import mapped

    folder = write_random_checkpoint("esmc", tmp_path / "esmc", TINY)  # bf16, as released
    monkeypatch.setattr(mapped, "WIDEN_ON_DISK_BYTES", 1 << 10)
    whole = load_checkpoint(folder, "esmc")
    with mapped.widening_deferred():
        deferred = load_checkpoint(folder, "esmc")
    parameters = dict(deferred.encoder.named_parameters())
    blocks = mapped.block_parameter_names(deferred.encoder)
    assert blocks and all(name.startswith("backbone.layers.") for name in blocks)
    assert {name for name, p in parameters.items() if mapped.is_deferred(p)} == blocks
    expected = dict(whole.encoder.named_parameters())
    weight = parameters["backbone.layers.1.mlp.down_proj.weight"]
    assert weight.dtype == torch.float32 and not weight.detach().any()  # a placeholder: zeros, no disk
    with mapped.widened_while_used([weight]):
        assert torch.equal(weight, expected["backbone.layers.1.mlp.down_proj.weight"])
    assert not weight.detach().any()
    outside = [name for name in parameters if name not in blocks]
    assert outside and all(torch.equal(parameters[name], expected[name]) for name in outside)

    encoded = deferred.tokenizer.encode(["MKTAYIAKQRQISFVKSHF", "GSHM"])
    arguments = [torch.from_numpy(getattr(encoded, spec.name)) for spec in deferred.inputs]
    with torch.inference_mode():
        assert torch.equal(deferred.encoder(*arguments)[0], whole.encoder(*arguments)[0])
        with mapped.deferred_widening_paused():  # tracing: nothing widened, the placeholders answer
            assert not torch.equal(deferred.encoder(*arguments)[0], whole.encoder(*arguments)[0])
    assert not weight.detach().any()


def test_freed_memory_is_collected_only_for_weights_worth_a_full_collection(monkeypatch):
    """A full garbage collection walks every object torch and transformers made (about 0.4 s): a
    build pays it after each large graph, never after a tiny one's few MB."""
    import gc

    from bionemo_export.models.readers import mapped

    collections: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(1) or 0)
    mapped.return_freed_memory(mapped.WORTH_COLLECTING_BYTES - 1)
    assert collections == []
    mapped.return_freed_memory(mapped.WORTH_COLLECTING_BYTES)
    assert collections == [1]
