"""Spans copied file to file are compared with their source while the writer goes on (storage.copy_check):
the check after the writer then skips them (small ones are left to it), and a copy that went wrong is still
caught."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import modelkit
from modelkit.errors import VerificationError
from modelkit.pipeline import verify
from modelkit.storage import mapped
from modelkit.storage.copy_check import checking_copies, copied_equal
from modelkit.storage.mapped import FileSpan, copy_span


@pytest.fixture
def source(tmp_path):
    """Tensors of 1.5 MiB (copied through splice), one of 40 KiB (copy_file_range) and an int64 vector."""
    rng = np.random.default_rng(0)
    path = tmp_path / "src.safetensors"
    save_file({"a.weight": rng.standard_normal((384, 1024), dtype=np.float32),
               "b.weight": rng.standard_normal((1024, 384), dtype=np.float32),
               "small": rng.standard_normal((100, 100), dtype=np.float32),
               "ids": np.arange(7, dtype=np.int64)}, str(path))
    return path


@pytest.mark.parametrize("target, options", [("out.gguf", {}), ("out.h5", {}), ("shards", {"shard_size": "2MB"})])
def test_copied_tensors_are_not_compared_again_after_the_write(source, tmp_path, monkeypatch, target, options):
    compared = []
    original = verify._same_bits
    monkeypatch.setattr(verify, "_same_bits", lambda a, b: compared.append(a.nbytes) or original(a, b))
    report = modelkit.convert(source, tmp_path / target, **options)
    assert report.verify["passed"] and report.verify["tensors_checked"] == 4
    assert sorted(compared) == [7 * 8, 100 * 100 * 4]    # the 1.5 MiB copies were compared while writing
    back = modelkit.load(tmp_path / target)
    assert np.array_equal(back.tensors["b.weight"].array(), modelkit.load(source).tensors["b.weight"].array())


@pytest.mark.parametrize("target", ["out.gguf", "out.h5"])
def test_a_wrong_copy_fails_verification_and_leaves_no_output(source, tmp_path, monkeypatch, target):
    good = mapped._splice

    def flip_one_byte(src: int, dst: int, span: FileSpan, at: int | None) -> int:
        done = good(src, dst, span, at)
        if done:                                   # one bit of the copy's middle byte flipped in the output
            where = (os.lseek(dst, 0, os.SEEK_CUR) - done if at is None else at) + done // 2
            os.pwrite(dst, bytes([os.pread(src, 1, span.offset + done // 2)[0] ^ 1]), where)
        return done

    monkeypatch.setattr(mapped, "_splice", flip_one_byte)
    with pytest.raises(VerificationError, match="differs"):
        modelkit.convert(source, tmp_path / target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def test_copied_equal_names_the_exact_source_and_place(source, tmp_path):
    span = modelkit.load(source).tensors["a.weight"].span
    out = tmp_path / "folder" / "out.bin"
    out.parent.mkdir()
    with checking_copies(out.parent):
        with out.open("wb") as f:
            f.write(b"12345678")
            copy_span(span, f)
        written = FileSpan(out, 8, span.nbytes)
        assert copied_equal(written, span)
        assert not copied_equal(FileSpan(out, 0, span.nbytes), span)                 # not where it was copied
        assert not copied_equal(written, FileSpan(span.path, span.offset + 4, span.nbytes))   # another source
    assert not copied_equal(written, span)                 # the check ended with its block


def test_the_console_script_runs_atexit_handlers_and_keeps_exit_codes(tmp_path):
    code = ("import atexit, sys\nfrom modelkit.cli import run\n"
            "atexit.register(lambda: print('atexit ran'))\nrun(sys.argv[1:])\n")
    ok = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.splitlines() == ["modelkit, version " + modelkit.__version__, "atexit ran"]
    bad = subprocess.run([sys.executable, "-c", code, "inspect", str(tmp_path / "missing")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "atexit ran" in bad.stdout and "missing" in bad.stderr
