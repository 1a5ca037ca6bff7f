"""Every ordered pair of formats converts, verified; the conversion command's promises hold."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import modelkit
from modelkit.checkpoint import ALIASES_KEY, Checkpoint
from modelkit.cli import EXIT_ERROR, EXIT_OK, main
from modelkit.errors import ConfigError, OutputExistsError, UnsupportedConversionError, VerificationError
from modelkit.formats import FORMATS, WRITABLE
from modelkit.models import build, load_model_module
from modelkit.pipeline.convert import parse_size

# A Hugging Face folder holds Hugging Face families only (tests/test_hf.py): the zoo's mlp cannot be one.
# Read-only formats (TensorFlow's, legacy ggml) are sources only (tests/test_tensorflow.py, test_ggml.py); as targets
# they are refused before the source is read, whatever it is: one source suffices.
# OpenVINO IR is written by OpenVINO's converter (about 0.5 s a write, against milliseconds for the weight formats;
# an ONNX export on either side adds seconds): its pairs are the ones to and from safetensors and keras, its reader
# and writer being the same for every other format.
SLOW_WRITERS = {"openvino": ("safetensors", "keras")}
PAIRS = [(a, b) for a in sorted(WRITABLE) for b in sorted(FORMATS)
         if a != b and not FORMATS[a].folder and (not FORMATS[b].read_only or a == "safetensors")
         and all(f not in SLOW_WRITERS or other in SLOW_WRITERS[f] for f, other in ((a, b), (b, a)))]
UNSUPPORTED: dict[tuple[str, str], str] = {
    **{(a, b): "not a Hugging Face family" for a, b in PAIRS if b == "hf"},
    **{(a, b): "modelkit does not write it" for a, b in PAIRS if FORMATS[b].read_only},
}


def _source(tmp_path, fmt, model):
    path = tmp_path / f"src{FORMATS[fmt].suffixes[0]}"
    modelkit.save(Checkpoint.from_module(model, metadata={"origin": "test"}), path, format=fmt)
    return path


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def mlp():
    return build("mlp", seed=0).eval()


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_every_pair_converts_and_verifies(src, dst, mlp, tmp_path):
    source = _source(tmp_path, src, mlp)
    before = _digest(source)
    target = tmp_path / f"out{(*FORMATS[dst].suffixes, '')[0]}"   # hf: a folder, no suffix; tfjs: out/model.json
    if FORMATS[dst].folder_file:
        target = tmp_path / "out" / FORMATS[dst].folder_file
    if (src, dst) in UNSUPPORTED:
        with pytest.raises(UnsupportedConversionError):
            modelkit.convert(source, target, to=dst)
        return
    report = modelkit.convert(source, target, to=dst)
    assert report.verify["passed"] and report.target["format"] == dst
    assert _digest(source) == before                                   # inputs never change
    rebuilt = modelkit.load_module(target, trust=True)
    modelkit.assert_same_outputs(mlp, rebuilt, load_model_module("mlp").example_inputs(5), atol=0)
    assert modelkit.load(target, trust=True).metadata.get("origin") == "test"


@pytest.mark.parametrize("dst", sorted(f for f in FORMATS if FORMATS[f].has_graph))
def test_graph_target_without_arch_says_how_to_pass_one(dst, tmp_path):
    state = build("mlp", seed=0).state_dict()
    source = tmp_path / "plain.safetensors"
    modelkit.save(Checkpoint.from_state_dict(state), source)
    with pytest.raises(UnsupportedConversionError, match="--arch"):
        modelkit.convert(source, tmp_path / f"x{FORMATS[dst].suffixes[0]}", to=dst)
    report = modelkit.convert(source, tmp_path / f"x{FORMATS[dst].suffixes[0]}", to=dst, arch="mlp")
    assert report.verify["passed"]


@pytest.mark.parametrize("dtype, torch_dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_dtype_cast_is_exactly_the_cast(dtype, torch_dtype, mlp, tmp_path):
    source = _source(tmp_path, "safetensors", mlp)
    report = modelkit.convert(source, tmp_path / "half.safetensors", dtype=dtype)
    assert report.target["dtype"] == str(torch_dtype).removeprefix("torch.")
    back = modelkit.load(tmp_path / "half.safetensors").materialize()
    for name, tensor in mlp.state_dict().items():
        assert back[name].dtype == torch_dtype and torch.equal(back[name], tensor.to(torch_dtype))


def test_sharded_safetensors_round_trip_and_index(tmp_path):
    model = build("tinylm", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2}, seed=0)
    source = _source(tmp_path, "safetensors", model)
    out = tmp_path / "sharded"
    report = modelkit.convert(source, out, shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    for shard in out.glob("model-*.safetensors"):          # within the size, or one oversized tensor alone
        tensors = modelkit.load(shard).tensors
        assert sum(t.nbytes for t in tensors.values()) <= 100_000 or len(tensors) == 1
    assert report.verify["passed"]
    for path in (out, out / "model.safetensors.index.json"):               # folder or index file
        back = modelkit.load(path)
        assert back.arch.name == "tinylm"
        assert all(torch.equal(back.tensors[k].load(), v) for k, v in model.state_dict().items())
    single = modelkit.convert(out, tmp_path / "single.safetensors")          # and back to one file
    assert single.source["format"] == "safetensors"


def test_small_model_with_shard_size_is_one_file_in_a_folder(tmp_path, mlp):
    out = tmp_path / "one"
    modelkit.convert(_source(tmp_path, "safetensors", mlp), out, shard_size="2GB")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_shard_names_cannot_escape_the_folder(tmp_path, mlp):
    out = tmp_path / "sharded"
    modelkit.convert(_source(tmp_path, "safetensors", mlp), out, shard_size="1KB")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../src.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(modelkit.FormatError, match="not a file name inside"):
        modelkit.load(out)


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    ckpt = Checkpoint.from_module(model)
    assert json.loads(ckpt.metadata[ALIASES_KEY]) == {"1.weight": "0.weight"}
    path = modelkit.save(ckpt, tmp_path / "tied.safetensors")
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == ["0.weight"]                             # stored once
    back = modelkit.load(path).materialize()
    assert torch.equal(back["1.weight"], model[0].weight)


def test_parse_size():
    assert parse_size("2GB") == 2_000_000_000 and parse_size("1GiB") == 2**30 and parse_size("500") == 500
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_existing_output_needs_force_and_input_is_never_the_output(tmp_path, mlp):
    source = _source(tmp_path, "safetensors", mlp)
    modelkit.convert(source, tmp_path / "a.safetensors")
    with pytest.raises(OutputExistsError):
        modelkit.convert(source, tmp_path / "a.safetensors")
    modelkit.convert(source, tmp_path / "a.safetensors", force=True)
    with pytest.raises(ConfigError, match="is the input file"):
        modelkit.convert(source, source, force=True)


def test_failed_verification_leaves_no_output(tmp_path, mlp, monkeypatch):
    from modelkit.pipeline import write as conversion

    def broken(expected, written, *, label):
        raise VerificationError(f"{label}: tensor differs", max_abs_err=1.0, atol=0.0)

    source = _source(tmp_path, "safetensors", mlp)           # written (and verified) before the check breaks
    monkeypatch.setattr(conversion, "verify_weights", broken)
    with pytest.raises(VerificationError):
        modelkit.convert(source, tmp_path / "out.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def _broken_weights(monkeypatch):
    """Every bit-exact check of the one write path fails from here on."""
    from modelkit.pipeline import write

    def broken(expected, written, *, label):
        raise VerificationError(f"{label}: tensor differs", max_abs_err=1.0, atol=0.0)

    monkeypatch.setattr(write, "verify_weights", broken)


def test_save_verifies_and_a_failure_leaves_no_output(tmp_path, mlp, monkeypatch):
    """api.save goes through the write path: weights read back bit for bit, a graph also run."""
    from modelkit.pipeline import verify

    def broken(module, run, inputs, *, atol=0.0, rtol=0.0, label):
        raise VerificationError(f"{label}: outputs differ", max_abs_err=1.0, atol=atol)

    monkeypatch.setattr(verify, "verify_outputs", broken)      # what write's verify_graph calls
    with pytest.raises(VerificationError, match="outputs differ"):
        modelkit.save(Checkpoint.from_module(mlp), tmp_path / "m.onnx")
    _broken_weights(monkeypatch)
    with pytest.raises(VerificationError, match="tensor differs"):
        modelkit.save(Checkpoint.from_module(mlp), tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_failed_verification_of_a_pruned_model_leaves_no_output(tmp_path, mlp, monkeypatch):
    from modelkit.pipeline.compress import prune_file
    from modelkit.quantizers.prune import PruneConfig

    source = _source(tmp_path, "safetensors", mlp)
    _broken_weights(monkeypatch)
    with pytest.raises(VerificationError):
        prune_file(source, tmp_path / "pruned.safetensors", PruneConfig(method="magnitude", sparsity=0.5), device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def test_failed_verification_of_a_training_checkpoint_leaves_no_output(tmp_path, monkeypatch):
    from modelkit.pipeline.train import TrainConfig, train

    _broken_weights(monkeypatch)
    with pytest.raises(VerificationError):
        train("mlp", tmp_path / "run", config=TrainConfig(epochs=1, steps_per_epoch=1, device="cpu"))
    assert list((tmp_path / "run").iterdir()) == []


def test_failed_verification_of_an_onnx_quantization_leaves_no_output(tmp_path, mlp, monkeypatch):
    from modelkit.pipeline import onnx_quantize

    source = _source(tmp_path, "onnx", mlp)
    real = onnx_quantize.compare_outputs
    monkeypatch.setattr(onnx_quantize, "compare_outputs", lambda *a, **k: real(*a, **{**k, "rtol": 0.0}))
    with pytest.raises(VerificationError, match="quantized session"):
        modelkit.quantize(source, tmp_path / "q.onnx", scheme="int8-dynamic")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.onnx"]


@pytest.mark.parametrize("verification_fails", [False, True])
def test_fsync_failure_during_verification_leaves_no_output(tmp_path, mlp, monkeypatch, verification_fails):
    """The output is fsynced while it is verified: an fsync error (a full disk shows up there) fails
    the conversion; when verification fails too, its error is the one reported."""
    import errno
    import os

    from modelkit.pipeline import write as conversion

    real_fsync = os.fsync

    def failing_fsync(fd):
        # the single file's write-back thread, or the fsync threads of a folder's files
        if __import__("threading").current_thread().name.startswith(("modelkit-write-back", "modelkit-fsync")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    source = _source(tmp_path, "safetensors", mlp)
    monkeypatch.setattr(os, "fsync", failing_fsync)
    if verification_fails:
        def broken(expected, written, *, label):
            raise VerificationError(f"{label}: tensor differs", max_abs_err=1.0, atol=0.0)
        monkeypatch.setattr(conversion, "verify_weights", broken)
    with pytest.raises(VerificationError if verification_fails else OSError):
        modelkit.convert(source, tmp_path / "out.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


@pytest.mark.parametrize("entry", ["api", "cli"])
def test_full_disk_leaves_no_output(tmp_path, entry):
    """RLIMIT_FSIZE makes writes fail past a size, as a full disk would: no output either way, and
    the CLI says so in one line (exit 2, no traceback)."""
    model = build("cnn", seed=0)
    source, out = _source(tmp_path, "safetensors", model), tmp_path / "out.safetensors"
    call = (f"modelkit.convert({str(source)!r}, {str(out)!r})" if entry == "api" else
            f"from modelkit.cli import run; run(['convert', {str(source)!r}, {str(out)!r}])")
    code = ("import resource, signal, modelkit\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
            f"signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n{call}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "File too large" in result.stderr
    if entry == "cli":
        last = result.stderr.strip().splitlines()[-1]        # after the progress lines
        assert result.returncode == EXIT_ERROR and "Traceback" not in result.stderr and last.startswith("Error:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def test_export_any_module(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).eval()
    report = modelkit.export(net, tmp_path / "net.safetensors", metadata={"author": "me"})
    assert report.verify["passed"] and report.source["arch"] is None
    back = modelkit.load(tmp_path / "net.safetensors")
    assert back.metadata["author"] == "me" and back.arch is None


def test_cli_convert_human_and_json(tmp_path, mlp):
    source = _source(tmp_path, "safetensors", mlp)
    runner = CliRunner()
    human = runner.invoke(main, ["convert", str(source), str(tmp_path / "b.safetensors"), "--dtype", "f16"])
    assert human.exit_code == EXIT_OK, human.output
    assert "verified: weights bit-exact" in human.stdout
    result = runner.invoke(main, ["convert", str(source), str(tmp_path / "c.safetensors"), "--json"])
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.convert/1" and doc["ok"] and doc["verify"]["passed"]
    assert doc["target"]["bytes"] == (tmp_path / "c.safetensors").stat().st_size
    again = runner.invoke(main, ["convert", str(source), str(tmp_path / "c.safetensors"), "--json"])
    assert again.exit_code == EXIT_ERROR and json.loads(again.stdout)["error"]["type"] == "OutputExistsError"


@pytest.mark.parametrize("args, message", [
    (["{src}", "{tmp}/x.weird"], "pass --to"),
    (["{src}", "{tmp}/x.gguf", "--shard-size", "1GB"], "safetensors, hf and tfjs output only"),
    (["{src}", "{tmp}/x.safetensors", "--shard-size", "lots"], "cannot read size"),
    (["{tmp}/missing.pt", "{tmp}/x.safetensors"], "no such file"),
])
def test_cli_convert_errors_are_one_line(tmp_path, mlp, args, message):
    source = _source(tmp_path, "safetensors", mlp)
    args = [a.format(src=source, tmp=tmp_path) for a in args]
    result = CliRunner().invoke(main, ["convert", *args])
    assert result.exit_code == EXIT_ERROR
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_interrupt_mid_write_leaves_no_output(tmp_path, mlp):
    """Ctrl-C while tensors are being written: neither the output nor a temporary file remains."""
    from modelkit.checkpoint import LazyTensor

    source = Checkpoint.from_module(mlp)
    tensors = dict(source.tensors)
    last = list(tensors)[-1]

    def interrupt():
        raise KeyboardInterrupt

    tensors[last] = LazyTensor(tensors[last].dtype, tensors[last].shape, interrupt)
    with pytest.raises(KeyboardInterrupt):
        modelkit.save(Checkpoint(tensors, {}, source.arch), tmp_path / "out.safetensors")
    assert list(tmp_path.iterdir()) == []
