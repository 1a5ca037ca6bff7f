"""pth (torch.save) reading and writing: plain torch users read our files, we read theirs safely."""
from __future__ import annotations

import hashlib
import logging
import os
import zipfile

import pytest
import torch

import modelkit
from modelkit.checkpoint import ALIASES_KEY, Checkpoint, LazyTensor, QuantizedTensor
from modelkit.errors import FormatError, UnsafeFileError
from modelkit.formats import detect_format, load_format
from modelkit.models import build, config_to_dict, load_model_module

pth = load_format("pth")     # modelkit.converters.pth


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def mlp():
    return build("mlp", seed=0).eval()


def test_round_trip_of_every_reference_model_is_bit_exact(small_model, tmp_path):
    ckpt = Checkpoint.from_module(small_model, metadata={"note": "hello", "origin": "test"})
    path = modelkit.save(ckpt, tmp_path / "m.pt")
    assert detect_format(path) == "pth"
    back = modelkit.load(path)
    assert back.arch == ckpt.arch
    assert back.metadata == ckpt.metadata
    assert _same(back.materialize(), small_model.state_dict())


def test_plain_torch_load_gives_exactly_the_state_dict(small_model, model_name, tmp_path):
    path = modelkit.save(Checkpoint.from_module(small_model), tmp_path / "m.pth")
    loaded = torch.load(path, weights_only=True)                   # what a torch user does
    assert list(loaded) == list(small_model.state_dict())
    fresh = build(model_name, config_to_dict(small_model.config), seed=1).eval()
    fresh.load_state_dict(loaded)                                   # strict: no stray keys
    inputs = load_model_module(model_name).example_inputs(2)
    modelkit.assert_same_outputs(small_model, fresh, inputs)       # atol 0: identical


def test_arch_and_metadata_live_in_the_state_dicts_own_metadata_slot(mlp, tmp_path):
    path = modelkit.save(Checkpoint.from_module(mlp, metadata={"note": "x"}), tmp_path / "m.pt")
    stored = torch.load(path, weights_only=True)._metadata["__modelkit__"]
    assert stored["format"] == "modelkit.pth/1" and stored["metadata"] == {"note": "x"}
    assert modelkit.ArchSpec.from_json(stored["arch"]).name == "mlp"


def test_foreign_state_dict_reads_without_arch(mlp, tmp_path):
    path = tmp_path / "plain.bin"
    torch.save(mlp.state_dict(), path)
    back = modelkit.load(path)
    assert back.arch is None and back.metadata == {}
    assert _same(back.materialize(), mlp.state_dict())
    assert modelkit.load_module(path, arch="mlp").net[0].weight.equal(mlp.net[0].weight)


def test_legacy_format_reads(small_model, tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save(small_model.state_dict(), path, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path) and detect_format(path) == "pth"
    assert _same(modelkit.load(path).materialize(), small_model.state_dict())


def test_legacy_claims_are_checked_against_the_file_size(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.zeros(100_000)}, path, _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:2000])                        # the pickles survive, the data does not
    with pytest.raises(FormatError, match="claims 400000 bytes of tensor data"):
        modelkit.load(path)


def test_well_known_nested_entry_is_chosen_and_recorded(mlp, tmp_path, caplog):
    optimizer = torch.optim.AdamW(mlp.parameters())
    mlp(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    path = tmp_path / "train.ckpt"
    torch.save({"model": mlp.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}, path)
    with caplog.at_level(logging.INFO, logger="modelkit"):
        back = modelkit.load(path)
    assert back.metadata[pth.SOURCE_KEY] == "model"
    assert "using the state_dict under 'model'" in caplog.text
    assert _same(back.materialize(), mlp.state_dict())


def test_lightning_style_checkpoint(mlp, tmp_path):
    path = tmp_path / "epoch=3.ckpt"
    wrapped = {f"model.{k}": v for k, v in mlp.state_dict().items()}
    torch.save({"state_dict": wrapped, "epoch": 3, "global_step": 120, "hyper_parameters": {"lr": 0.01}}, path)
    assert list(modelkit.load(path).tensors) == list(wrapped)
    stripped = modelkit.load(path, key="state_dict.model")          # into the entry, then strip `model.`
    assert _same(stripped.materialize(), mlp.state_dict())
    assert stripped.metadata[pth.SOURCE_KEY] == "state_dict.model"


def test_ambiguous_nested_checkpoint_lists_candidates_and_key_picks(mlp, tmp_path):
    other = build("mlp", seed=1).state_dict()
    path = tmp_path / "two.pt"
    torch.save({"model": mlp.state_dict(), "ema": other, "step": 7}, path)
    with pytest.raises(FormatError, match=r"--key NAME.*candidates: model \(6 tensors\), ema \(6 tensors\)"):
        modelkit.load(path)
    assert _same(modelkit.load(path, key="ema").materialize(), other)
    with pytest.raises(FormatError, match="--key 'emma' names no state_dict here; top-level entries: model"):
        modelkit.load(path, key="emma")


def test_unknown_single_entry_is_not_guessed(mlp, tmp_path):
    path = tmp_path / "odd.pt"
    torch.save({"encoder_weights": mlp.state_dict(), "step": 7}, path)
    with pytest.raises(FormatError, match=r"candidates: encoder_weights \(6 tensors\)"):
        modelkit.load(path)


def test_ddp_prefix_is_reported_and_key_strips_it(mlp, tmp_path, caplog):
    path = tmp_path / "ddp.pt"
    torch.save({f"module.{k}": v for k, v in mlp.state_dict().items()}, path)
    with caplog.at_level(logging.INFO, logger="modelkit"):
        assert all(n.startswith("module.") for n in modelkit.load(path).tensors)
    assert "pass --key module" in caplog.text
    assert _same(modelkit.load(path, key="module").materialize(), mlp.state_dict())


def test_non_tensor_leaves_are_a_format_error(tmp_path):
    path = tmp_path / "mixed.pt"
    torch.save({"w": torch.ones(2), "step": 3}, path)
    with pytest.raises(FormatError, match=r"an entry that is not a named tensor: 'step' \(int\)"):
        modelkit.load(path)
    nested = tmp_path / "nested.pt"
    torch.save({"model": {"w": torch.ones(2), "note": "x"}}, nested)
    with pytest.raises(FormatError, match=r"under 'model'.*'note' \(str\)"):
        modelkit.load(nested, key="model")


def test_whole_module_pickle_is_refused_without_trust(mlp, tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(mlp, path)                                           # a benign module of our own
    with pytest.raises(UnsafeFileError, match=r"loading it runs code from the file: .*modelkit\.models\.mlp\.MLP.*pass --trust"):
        modelkit.load(path)                                         # the scanner's gate refuses it first


def test_whole_module_pickle_reads_with_trust(mlp, tmp_path, caplog):
    path = tmp_path / "whole.pt"
    torch.save(mlp, path)
    with caplog.at_level(logging.WARNING, logger="modelkit"):
        back = modelkit.load(path, trust=True)
    assert "runs code from the file; scanner gate: scanned" in caplog.text
    assert back.arch.name == "mlp"
    assert back.metadata[pth.SOURCE_KEY] == "whole-module pickle of modelkit.models.mlp.MLP"
    assert _same(back.materialize(), mlp.state_dict())


def test_trust_does_not_relax_plain_state_dicts(mlp, tmp_path, monkeypatch):
    """A plain state_dict is read by modelkit's own reader, trust or not: nothing is unpickled."""
    path = modelkit.save(Checkpoint.from_module(mlp), tmp_path / "m.pt")
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert _same(modelkit.load(path, trust=True).materialize(), mlp.state_dict())
    assert calls == []


def test_torchscript_archives_are_not_pth(mlp, tmp_path):
    path = modelkit.save(Checkpoint.from_module(mlp), tmp_path / "m.ts")
    assert not pth.detect(path)
    with pytest.raises(FormatError, match="TorchScript"):
        pth.read(path)


@pytest.mark.parametrize("content", [b"", b"PK\x05\x06" + bytes(18), b"\x80\x02}q\x00.", b"not a model"])
def test_detect_is_false_for_other_files(tmp_path, content):
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    assert not pth.detect(path)
    assert not pth.detect(tmp_path / "missing.pt") and not pth.detect(tmp_path)


def test_detect_rejects_zips_without_data_pkl(tmp_path):
    path = tmp_path / "arrays.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a.npy", b"\x93NUMPY")
    assert not pth.detect(path)


def test_read_is_lazy_views_into_the_mapped_file(tmp_path):
    path = modelkit.save(Checkpoint.from_state_dict({"w": torch.zeros(4)}), tmp_path / "m.pt")
    ckpt = modelkit.load(path)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("archive/data/0")
    with path.open("r+b") as f:                                     # change the bytes after opening
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(torch.tensor([1.0, 2, 3, 4]).numpy().tobytes())
    assert ckpt.tensors["w"].load().tolist() == [1, 2, 3, 4]        # read from the file only now


def test_inputs_never_change(mlp, tmp_path):
    path = modelkit.save(Checkpoint.from_module(mlp), tmp_path / "m.pt")
    os.chmod(path, 0o444)                                            # read-only input works
    before = _digest(path)
    for tensor in modelkit.load(path).materialize().values():
        tensor.add_(1)                                               # private mapping: the file is untouched
    modelkit.convert(path, tmp_path / "out.safetensors")
    assert _digest(path) == before


def test_tied_weights_are_saved_once_and_come_back_tied(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    safetensors_path = modelkit.save(Checkpoint.from_module(model), tmp_path / "tied.safetensors")
    path = modelkit.save(modelkit.load(safetensors_path), tmp_path / "tied.pt")   # aliases, not ties, in between
    loaded = torch.load(path, weights_only=True)
    assert loaded["0.weight"].untyped_storage().data_ptr() == loaded["1.weight"].untyped_storage().data_ptr()
    with zipfile.ZipFile(path) as zf:
        assert len([n for n in zf.namelist() if "/data/" in n]) == 1
    assert modelkit.load(path).metadata[ALIASES_KEY] == '{"1.weight": "0.weight"}'


def test_views_of_larger_buffers_store_only_their_own_bytes(tmp_path):
    flat = torch.arange(1000, dtype=torch.float32)
    path = modelkit.save(Checkpoint.from_state_dict({"a": flat[:10], "b": flat[500:510]}), tmp_path / "v.pt")
    assert path.stat().st_size < 4000
    assert modelkit.load(path).tensors["b"].load().tolist() == list(range(500, 510))


def test_quantized_tensors_are_stored_as_their_parts(tmp_path):
    part = LazyTensor.of(torch.tensor([[1, -2], [3, 4]], dtype=torch.int8))
    scale = LazyTensor.of(torch.full((1, 1), 0.5))
    q = QuantizedTensor("int8", "affine", (2, 2), torch.float32, {"qdata": part, "scale": scale}, {"bits": 8})
    path = modelkit.save(Checkpoint({"w": q, "b": LazyTensor.of(torch.ones(2))}), tmp_path / "q.pt")
    state = torch.load(path, weights_only=True)                          # compressed-tensors' pack-quantized
    assert list(state) == ["w_packed", "w_scale", "w_shape", "b"]
    assert state["w_packed"].tolist() == [[0x7E81], [0x8483]]             # values + 128, 4 an int32, zero-padded
    assert state["w_scale"].shape == (1,) and state["w_shape"].tolist() == [2, 2]
    back = modelkit.load(path).tensors
    assert list(back) == ["w", "b"] and isinstance(back["w"], QuantizedTensor) and back["w"].params == {"bits": 8}
    assert torch.equal(back["w"].parts["qdata"].load(), part.load()) and back["w"].load().tolist() == [[0.5, -1], [1.5, 2]]
    assert back["w"].parts["scale"].shape == (1, 1)


@pytest.mark.parametrize("source", ["safetensors", "memory"])
def test_storages_filled_file_to_file_give_torch_save_archives(tmp_path, monkeypatch, source):
    """Above _FILL_MIN the writer lets torch.save reserve the records (skip_data) and fills them
    itself: the archive loads in torch, every CRC-32 checks out in Python's zipfile, and tied,
    bf16, 0-d, empty and sliced tensors survive."""
    import zipfile

    from modelkit.checkpoint import Checkpoint

    monkeypatch.setattr("modelkit.converters.pth._FILL_MIN", 0)
    base = torch.randn(6, 8)
    state = {"w": torch.randn(300, 70), "tied": None, "bf16": torch.randn(33, 5).to(torch.bfloat16),
             "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "rows": base[2:4], "ints": torch.arange(10)}
    state["tied"] = state["w"]
    ckpt = Checkpoint.from_state_dict(state)
    if source == "safetensors":
        ckpt = modelkit.load(modelkit.save(ckpt, tmp_path / "src.safetensors"))
        assert any(t.span is not None for t in ckpt.tensors.values())
    out = modelkit.save(ckpt, tmp_path / "out.pt")
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None
    loaded = torch.load(out, weights_only=True)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert loaded["tied"].data_ptr() == loaded["w"].data_ptr()
