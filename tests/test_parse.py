"""modelkit.parse, module by module: what each reads, and each bounds check with its exact message and offset."""
from __future__ import annotations

import os
import pickle
import pickletools
import struct

import pytest

from modelkit.errors import FormatError, ModelkitError, ParseError
from modelkit.parse import gguf, hdf5, keras, npy, onnx, paths, pickle_opcodes, safetensors, sniff, zipdir
from modelkit.parse import pickle as pk
from modelkit.parse.protobuf import fields, int64s, string_pairs, text, varint
from modelkit.testing import payloads

# ---------------------------------------------------------------------------------------------
# errors


def test_parse_error_is_a_format_error_with_source_and_offset():
    e = ParseError("a field claims 9 bytes, 2 remain", offset=5, source="m.onnx")
    assert isinstance(e, FormatError) and isinstance(e, ModelkitError) and isinstance(e, ValueError)
    assert str(e) == "m.onnx: a field claims 9 bytes, 2 remain (at byte 5)"
    assert e.reason == "a field claims 9 bytes, 2 remain" and e.offset == 5 and e.path.name == "m.onnx"
    assert str(ParseError("no graph")) == "no graph"


# ---------------------------------------------------------------------------------------------
# protobuf


def test_fields_walks_every_wire_type():
    data = (payloads.proto_field(1, 300) + payloads.proto_field(2, b"abc") + payloads.varint(3 << 3 | 5) + b"\0" * 4
            + payloads.varint(4 << 3 | 1) + b"\0" * 8)
    assert list(fields(data, 0, len(data))) == [(1, 0, 300), (2, 2, (5, 8)), (3, 5, 9), (4, 1, 14)]


@pytest.mark.parametrize(("data", "message", "offset"), [
    (b"\x08", "truncated varint", 1),
    (b"\x08" + b"\xff" * 10, "varint longer than 10 bytes", 11),
    (b"\x00\x01", "field number 0", 1),
    (b"\x0b", "wire type 3 (groups or invalid)", 1),
    (b"\x12\x09ab", "a field claims 9 bytes, 2 remain", 2),
    (b"\x0d\x00\x00", "a fixed-width field needs 4 bytes, 2 remain", 1),
])
def test_fields_bounds(data, message, offset):
    with pytest.raises(ParseError) as info:
        list(fields(data, 0, len(data)))
    assert info.value.reason == message and info.value.offset == offset


def test_varint_text_int64s_and_pairs():
    assert varint(payloads.varint(2**63), 0, 10) == (2**63, 10)
    assert int64s(b"", 0, 2**64 - 1) == [-1]
    packed = payloads.varint(3) + payloads.varint(2**64 - 2)
    assert int64s(packed, 2, (0, len(packed))) == [3, -2]
    with pytest.raises(ParseError, match="an int64 field with wire type 5"):
        int64s(b"", 5, 0)
    with pytest.raises(ParseError) as info:
        text(b"ab\xff", (0, 3))
    assert info.value.reason == "a string field is not UTF-8 (invalid start byte)" and info.value.offset == 2
    assert text(b"ab\xff", (0, 3), strict=False) == "ab\ufffd"
    entry = payloads.proto_field(1, b"location") + payloads.proto_field(2, b"w.bin")
    assert string_pairs(entry, (0, len(entry))) == ("location", "w.bin")


# ---------------------------------------------------------------------------------------------
# onnx


def test_onnx_model_detection():
    model = payloads.onnx_external_model("w.bin")
    assert onnx.looks_like_model(model, 0, len(model)) and onnx.is_model(model)
    assert not onnx.looks_like_model(b"\x08\x01", 0, 2) and not onnx.is_model(b"\x08\x00")   # ir_version 0
    not_model = payloads.proto_field(1, 8) + payloads.proto_field(99, b"x")
    assert not onnx.looks_like_model(not_model, 0, len(not_model))
    wrong_wire = payloads.proto_field(1, 8) + payloads.proto_field(2, 5)                   # producer_name as varint
    assert not onnx.is_model(wrong_wire)


# ---------------------------------------------------------------------------------------------
# paths


@pytest.mark.parametrize(("name", "problem"), [
    ("archive/data.pkl", None), ("a/..b/c", None),
    ("../x", "climbs out of the extraction folder with '..'"), ("a\\..\\x", "climbs out of the extraction folder with '..'"),
    ("/etc/passwd", "is an absolute path"), ("\\\\server\\share", "is an absolute path"), ("C:x", "is an absolute path"),
    ("a\x00b", "contains a NUL byte"),
])
def test_member_problem(name, problem):
    assert paths.member_problem(name) == problem


def test_location_rules(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"\0" * 8)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "v.bin").write_bytes(b"\0")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    outside.write_bytes(b"x")
    os.symlink(outside, tmp_path / "link.bin")
    folder = str(tmp_path)
    assert paths.location_problem("w.bin", folder) is None and paths.location_problem("sub/v.bin", folder) is None
    assert paths.location_problem("", folder) == "is empty"
    assert paths.location_problem("../w.bin", None) == "climbs out of the model's folder with '..'"
    assert paths.location_problem("/etc/passwd", None) == "is an absolute path"
    assert paths.location_problem("link.bin", folder) == "resolves (through a symlink) outside the model's folder"
    assert paths.location_problem("link.bin", None) is None                # text only: the link is not followed
    assert paths.resolve_location(folder, "sub\\v.bin", what="initializer 'v'") == str(tmp_path / "sub" / "v.bin")
    with pytest.raises(ParseError, match=r"^initializer 'w' has external data at '\.\./w\.bin'; only file names inside"):
        paths.resolve_location(folder, "../w.bin", what="initializer 'w'")
    with pytest.raises(ParseError, match=r"^initializer 'w' has external data 'link\.bin', which links outside"):
        paths.resolve_location(folder, "link.bin", what="initializer 'w'")
    with pytest.raises(ParseError, match=r"^initializer 'w' has external data 'gone\.bin', which is missing or not a file$"):
        paths.resolve_location(folder, "gone.bin", what="initializer 'w'")
    with pytest.raises(ParseError, match=r"^initializer 'w' has external data without a location$"):
        paths.resolve_location(folder, "", what="initializer 'w'")
    assert paths.plain_name_problem("m-1.safetensors", folder) is None
    assert paths.plain_name_problem("sub/v.bin", folder) == "is not a plain file name"
    assert paths.plain_name_problem("..", folder) == "is not a plain file name"
    assert paths.plain_name_problem("link.bin", folder) == "resolves (through a symlink) outside the folder"


# ---------------------------------------------------------------------------------------------
# gguf


def _gguf(*, kv=b"", n_kv=0, tensors=b"", n_tensors=0, tail=b"", version=3) -> bytes:
    return payloads.gguf_bytes(version=version, kv=kv, n_kv=n_kv, tensors=tensors, n_tensors=n_tensors, tail=tail)


def test_gguf_header_reads_values_tensors_and_extents():
    kv = (payloads.gguf_string("general.name") + struct.pack("<I", 8) + payloads.gguf_string("tiny")
          + payloads.gguf_string("tokens") + struct.pack("<IIQ", 9, 8, 2) + payloads.gguf_string("a") + payloads.gguf_string("b")
          + payloads.gguf_string("general.alignment") + struct.pack("<II", 4, 64))
    tensors = payloads.gguf_tensor_info("w", [4, 2], 0, 0) + payloads.gguf_tensor_info("q", [32], 2, 64)
    head = _gguf(kv=kv, n_kv=3, tensors=tensors, n_tensors=2)
    data = head + bytes(-len(head) % 64) + bytes(64 + 18)
    header = gguf.read_header(data)
    assert header.version == 3 and header.alignment == 64 and header.kv_count == 3
    assert header.values == {"general.name": "tiny", "general.alignment": 64}      # arrays are checked, not kept
    assert [(t.name, t.dims, t.ggml_type, t.offset, t.nbytes) for t in header.tensors] == [
        ("w", (4, 2), 0, 0, 32), ("q", (32,), 2, 64, 18)]
    assert header.data_start % 64 == 0 and header.data_end == header.data_start + 64 + 18 == len(data)
    assert gguf.plausible(data) and not gguf.plausible(data[:23]) and not gguf.plausible(b"GGUF" + bytes(20))


@pytest.mark.parametrize(("data", "message", "offset"), [
    (b"GGUF\x03\x00", "a GGUF file has a 24-byte header; this file has 6 bytes", None),
    (b"GGML" + bytes(20), "not a GGUF file: it starts with b'GGML', not b'GGUF'", None),
    (b"GGUF" + struct.pack("<I", 1) + bytes(20), "GGUF version 1 is not supported (2, 3 are)", None),
    (_gguf(n_kv=10**12, tail=bytes(64)),
     "the header claims 0 tensors and 1000000000000 metadata entries, more than the file holds; the file is truncated or corrupt", 24),
    (_gguf(n_kv=1, kv=payloads.gguf_string("k") + struct.pack("<IQ", 8, 2**60) + b"abc"),
     f"a string needs {2**60} bytes but only 3 remain; the file is truncated or corrupt", 45),
    (_gguf(n_kv=1, kv=payloads.gguf_string("k") + struct.pack("<IIQ", 9, 0, 2**60) + b"abc"),
     f"an array claims {2**60} items, more than the file can hold; the file is truncated or corrupt", 49),
    (_gguf(n_kv=1, kv=payloads.gguf_string("k") + struct.pack("<I", 99) + bytes(8)),
     "unknown metadata value type 99; the file is truncated or corrupt", 37),
    (_gguf(n_kv=1, kv=payloads.gguf_string("general.alignment") + struct.pack("<II", 4, 48) + bytes(8)),
     "general.alignment 48 is not a power of two; the file is truncated or corrupt", 57),
    (_gguf(n_tensors=1, tensors=struct.pack("<Q", 1) + b"w" + struct.pack("<I", 9), tail=bytes(64)),
     "tensor 'w' has 9 dimensions; GGUF allows 4; the file is truncated or corrupt", 37),
    (_gguf(n_tensors=1, tensors=payloads.gguf_tensor_info("w", [4], 77), tail=bytes(64)),
     "tensor 'w' has unknown tensor type 77; the file is truncated or corrupt", 57),
    (_gguf(n_tensors=1, tensors=payloads.gguf_tensor_info("w", [33], 2), tail=bytes(64)),
     "tensor 'w': rows of 33 do not fill whole blocks of 32; the file is truncated or corrupt", 57),
    (_gguf(n_tensors=1, tensors=payloads.gguf_tensor_info("w", [4], 0, 3), tail=bytes(64)),
     "tensor 'w': data at offset 3 is misaligned (alignment 32); the file is truncated or corrupt", 57),
    (_gguf(n_tensors=1, tensors=payloads.gguf_tensor_info("w", [2**62]), tail=bytes(64)),
     f"tensor 'w': {2**64} bytes at offset 0 lie past the end of the file; the file is truncated or corrupt", 57),
    (_gguf(n_tensors=2, tensors=payloads.gguf_tensor_info("a", [16]) + payloads.gguf_tensor_info("b", [8], 0, 32),
           tail=bytes(128)),
     "tensor 'b' overlaps the tensor before it; the file is truncated or corrupt", 90),
])
def test_gguf_header_bounds(data, message, offset):
    with pytest.raises(ParseError) as info:
        gguf.read_header(data)
    assert info.value.reason == message and info.value.offset == offset


def test_gguf_version_1_has_32_bit_counts():
    data = b"GGUF" + struct.pack("<III", 1, 0, 1) + struct.pack("<I", 1) + b"k" + struct.pack("<II", 4, 7) + bytes(8)
    assert gguf.read_header(data, versions=(1, 2, 3)).values == {"k": 7}


def test_gguf_array_items_are_capped(monkeypatch):
    monkeypatch.setattr(gguf, "MAX_ARRAY_ITEMS", 3)
    data = _gguf(n_kv=1, kv=payloads.gguf_string("k") + struct.pack("<IIQ", 9, 0, 4) + bytes(4))
    with pytest.raises(ParseError, match="^metadata arrays hold over 3 items; refusing to read them"):
        gguf.read_header(data)


# ---------------------------------------------------------------------------------------------
# safetensors


def test_safetensors_header_and_tensor_problems():
    data = payloads.safetensors_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                       "__metadata__": {"k": "v"}}, bytes(8))
    header = safetensors.read_header(data)
    assert header.entries["__metadata__"] == {"k": "v"} and not header.duplicate_keys
    assert header.data_start == len(data) - 8 and safetensors.plausible(data[:9], len(data))
    assert safetensors.read_header(b'\x1c\x00\x00\x00\x00\x00\x00\x00{"a":{"x":1},"a":{"x":2}}   ').duplicate_keys
    assert safetensors.tensor_problem({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, 8) is None
    assert safetensors.tensor_problem({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, 8) == \
        "F32 x [3] needs 12 bytes, the offsets span 8"
    assert safetensors.tensor_problem({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, 4) == \
        "data_offsets [0, 8] fall outside the 4 data bytes"
    assert safetensors.tensor_problem({"dtype": "Q9", "shape": [], "data_offsets": [0, 0]}, 0) == "unknown dtype 'Q9'"


@pytest.mark.parametrize(("data", "message"), [
    (b"\x01\x00", "a safetensors file starts with an 8-byte header length; this one has 2 bytes"),
    (struct.pack("<Q", 2**63) + b"{}", f"header length {2**63} does not fit a 10-byte file"),
    (struct.pack("<Q", 200_000_000) + b"{}", "header length 200000000 does not fit a 10-byte file"),
    (struct.pack("<Q", 2) + b"{x", "header is not valid UTF-8 JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (struct.pack("<Q", 2) + b"[]", "header is not a JSON object"),
])
def test_safetensors_header_bounds(data, message):
    with pytest.raises(ParseError) as info:
        safetensors.read_header(data)
    assert info.value.reason == message


def test_safetensors_index():
    assert safetensors.read_index(b'{"weight_map": {"w": "a.safetensors"}}') == {"w": "a.safetensors"}
    with pytest.raises(ParseError, match="^weight_map must map tensor names to shard file names$"):
        safetensors.read_index(b'{"weight_map": {"w": 3}}')
    with pytest.raises(ParseError, match=r"^not a safetensors index \(needs a JSON object with weight_map: 'weight_map'\)$"):
        safetensors.read_index(b"{}")


# ---------------------------------------------------------------------------------------------
# npy


def test_npy_header():
    text = b"{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }"
    data = npy.MAGIC + b"\x01\x00" + struct.pack("<H", len(text)) + text + bytes(48)
    header = npy.read_header(data)
    assert (header.descr, header.shape, header.numel, header.itemsize, header.has_object) == ("<f8", (2, 3), 6, 8, False)
    assert header.data_start == 10 + len(text) and header.fortran_order is False
    assert npy.read_header(data.replace(b"False", b"True ")).fortran_order is True
    assert npy.has_object([("a", "<f4"), ("b", "|O")]) and npy.itemsize("<U5") == 20 and npy.itemsize([("a", "<f4")]) is None


@pytest.mark.parametrize(("data", "message", "offset"), [
    (npy.MAGIC + b"\x01", "truncated .npy header", 0),
    (npy.MAGIC + b"\x02\x00\x05\x00", "truncated .npy header", 0),
    (npy.MAGIC + b"\x09\x00" + bytes(8), "unknown .npy version 9", 6),
    (npy.MAGIC + b"\x01\x00" + struct.pack("<H", 0xFFFF) + b"{", "header length 65535 does not fit the file", 8),
    (npy.MAGIC + b"\x02\x00" + struct.pack("<I", 2**31) + b"{", f"header length {2**31} does not fit the file", 8),
    (npy.MAGIC + b"\x01\x00" + struct.pack("<H", 2) + b"{}", "header is not a valid dict literal ('descr')", 10),
    (npy.MAGIC + b"\x01\x00" + struct.pack("<H", 32) + b"{'descr': '<f4', 'shape': (-1,)}",
     "header is not a valid dict literal (bad dimension -1)", 10),
    (b"\x93NUMPX\x01\x00" + struct.pack("<H", 2) + b"{}", "not a .npy array (no \\x93NUMPY magic)", 0),
    (npy.MAGIC + b"\x01\x00" + struct.pack("<H", 49) + b"{'descr': '<f4', 'fortran_order': 1, 'shape': ()}",
     "header is not a valid dict literal (fortran_order is 1, not True or False)", 10),
])
def test_npy_header_bounds(data, message, offset):
    with pytest.raises(ParseError) as info:
        npy.read_header(data)
    assert info.value.reason == message and info.value.offset == offset


# ---------------------------------------------------------------------------------------------
# keras


def test_keras_json_and_configs_in_hdf5_bytes(monkeypatch):
    config = b'{"class_name": "Sequential", "config": {"layers": []}}'
    assert keras.load_json(config) == {"class_name": "Sequential", "config": {"layers": []}}
    with pytest.raises(ParseError, match=r"^not valid JSON \(Expecting value: line 1 column 1 \(char 0\)\)$"):
        keras.load_json(b"nope")
    blob = b"\x89HDF junk" + b'{"class_name": broken' + b"\x00pad" + config + b"\x00" + b'{"module": "keras"}\x00'
    assert [(at, doc.get("class_name", doc.get("module"))) for at, doc in keras.configs_in(blob)] == [
        (blob.index(config), "Sequential"), (blob.rindex(b'{"module"'), "keras")]
    monkeypatch.setattr(keras, "MAX_JSON", 4)
    with pytest.raises(ParseError, match="^JSON larger than 4 bytes was not read$"):
        keras.load_json(config)


# ---------------------------------------------------------------------------------------------
# hdf5, sniff


def test_hdf5_superblock():
    v0 = hdf5.SIGNATURE + bytes([0, 0, 0, 0, 0, 8, 8, 0])
    v2 = hdf5.SIGNATURE + bytes([2, 8, 8, 0]) + bytes(4)
    assert hdf5.plausible_superblock(v0) and hdf5.plausible_superblock(v2)
    assert not hdf5.plausible_superblock(hdf5.SIGNATURE + b"\x07" * 8)
    assert not hdf5.plausible_superblock(v0[:15]) and hdf5.is_signature(v0) and not hdf5.is_signature(b"\x89HDF")


@pytest.mark.parametrize(("data", "name"), [
    (payloads.torch_zip(b"\x80\x02}."), "zip"), (b"\x80\x04\x95", "pickle"), (b"\x93NUMPY\x01\x00", "npy"),
    (b"GGUF\x03", "gguf"), (hdf5.SIGNATURE, "hdf5"), (payloads.safetensors_bytes({}), "safetensors"),
    (b"\x1f\x8b\x08", "gzip"), (payloads.onnx_external_model("w.bin"), "onnx"), (b"hello", None), (b"", None),
])
def test_sniff(data, name):
    assert sniff.sniff(data, 0, len(data)) == name


def test_describe_and_zip_roots(tmp_path):
    assert sniff.describe(b"GGUF") == "a GGUF file" and sniff.describe(b"") == "an empty file"
    path = tmp_path / "x.bin"
    path.write_bytes(b"\x80\x02}q\x00.")
    assert sniff.read_head(path, 2) == b"\x80\x02" and sniff.read_head(str(path), 2) == b"\x80\x02"
    names = ["m/data.pkl", "m/constants.pkl", "m/code/__torch__.py", "a/data.pkl"]
    assert list(sniff.torch_zip_roots(names)) == [("m", True, True), ("a", False, False)]


# ---------------------------------------------------------------------------------------------
# zipdir


def test_zip_directory_and_member_data(tmp_path):
    data = payloads.zip_bytes({"archive/data.pkl": b"\x80\x02}.", "archive/version": b"3\n"})
    entries = zipdir.read_directory(data)
    assert [e.filename for e in entries] == ["archive/data.pkl", "archive/version"]
    start = zipdir.member_data(data, entries[0])
    assert data[start:start + entries[0].compress_size] == b"\x80\x02}."
    (tmp_path / "a.zip").write_bytes(data)
    assert zipdir.member_names(tmp_path / "a.zip") == ["archive/data.pkl", "archive/version"]
    (tmp_path / "empty.zip").write_bytes(b"")
    with pytest.raises(zipdir.ZipDirectoryError, match="^empty file: not a zip archive$"):
        zipdir.member_names(tmp_path / "empty.zip")


def test_zip_member_data_bounds():
    data = bytearray(payloads.zip_bytes({"a": b"xyz"}))
    entry = zipdir.read_directory(bytes(data))[0]
    renamed = bytes(data).replace(b"PK\x03\x04\x14\x00\x00\x00\x00\x00", b"PK\x03\x04\x14\x00\x00\x00\x00\x00", 1)
    data[30] = ord("b")                                             # the local header's name, not the directory's
    with pytest.raises(ParseError) as info:
        zipdir.member_data(bytes(data), entry)
    assert info.value.reason == "local header names b'b', the central directory 'a'" and info.value.offset == 0
    with pytest.raises(ParseError, match="^no local header where the central directory points"):
        zipdir.member_data(renamed[4:], entry)
    with pytest.raises(ParseError, match="^member data runs past the end of the archive"):
        zipdir.member_data(renamed, entry, end=33)


def test_zip_archive_reads_members_checked(tmp_path):
    import zipfile
    path = tmp_path / "a.zip"
    path.write_bytes(payloads.zip_bytes({"s": b"stored", "d": b"deflated" * 100}))
    path.with_name("d.zip").write_bytes(payloads.zip_bytes({"d": b"deflated" * 100}, compression=zipfile.ZIP_DEFLATED))
    assert zipdir.Archive(path).read("s") == b"stored"
    assert zipdir.Archive(path.with_name("d.zip")).read("d") == b"deflated" * 100
    with pytest.raises(zipdir.ZipDirectoryError, match="^s is 6 bytes; refusing more than 5$"):
        zipdir.Archive(path).read("s", limit=5)
    with pytest.raises(KeyError):
        zipdir.Archive(path).read("missing")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"stored", b"STORED", 1))         # the bytes change, the CRC does not
    with pytest.raises(zipdir.ZipDirectoryError, match="^s does not match its size or CRC-32 in the directory$"):
        zipdir.Archive(path).read("s")
    path.with_name("b.zip").write_bytes(payloads.zip_bytes({"b": b"x" * 50}, compression=zipfile.ZIP_BZIP2))
    with pytest.raises(zipdir.ZipDirectoryError, match="^b uses compression method 12; only stored and deflated"):
        zipdir.Archive(path.with_name("b.zip")).read("b")


def test_zip_directory_errors():
    with pytest.raises(zipdir.ZipDirectoryError, match="^no end-of-central-directory record: not a zip archive, or truncated$"):
        zipdir.read_directory(b"not a zip" * 10)
    data = bytearray(payloads.zip_bytes({"\u00e9": b"x"}))
    at = data.find(b"PK\x01\x02")
    data[at + 46] = 0xFF                                            # the UTF-8 flagged name in the directory
    with pytest.raises(zipdir.ZipDirectoryError, match=r"^a member name flagged UTF-8 is not \(invalid start byte\)") as info:
        zipdir.read_directory(bytes(data))
    assert info.value.offset == at


# ---------------------------------------------------------------------------------------------
# pickle


def test_pickle_walk_names_globals_in_order_and_storages():
    data = (b"\x80\x02ccollections\nOrderedDict\n)R}(X\x01\x00\x00\x00w"
            b"ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000"
            b"X\x03\x00\x00\x00cpuK\x04tQK\x00K\x04\x85K\x01\x85\x89)tRu.")
    result = pk.walk(data, 0, len(data))
    assert result.complete and result.end == len(data)
    assert list(result.globals) == [("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
                                    ("torch", "FloatStorage")]
    assert result.persistent_ids == [("storage", pk.Global("torch", "FloatStorage"), "0", "cpu", 4)]


def test_pickle_walk_records_build_keys_and_skips_large_payloads():
    data = b"\x80\x02c__main__\nM\n)\x81}(X\x08\x00\x00\x00_modulesNX\x0b\x00\x00\x00_parametersNub."
    assert pk.walk(data, 0, len(data)).build_keys == {"_modules", "_parameters"}
    big = pickle.dumps(b"x" * 10_000, protocol=4)
    assert pk.walk(big, 0, len(big)).value == pk.Blob(10_000)


@pytest.mark.parametrize(("data", "message", "offset"), [
    (b"\x80\x02K", "argument of 1 bytes runs past the end of the data", 3),
    (b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"x", f"argument of {2**62} bytes runs past the end of the data", 11),
    (b"\x80\x02", "data ends before STOP", 2),
    (b"\x80\x02\xff", "unknown opcode 0xff", 2),
    (b"\x80\x02.", "stack underflow", 2),
    (b"\x80\x02e.", "no MARK on the stack", 2),
    (b"\x80\x09N.", "unsupported pickle protocol 9", 0),
    (b"ccollections OrderedDict", "text argument without a newline", 1),
    (b"\x80\x02(K\x01K\x02K\x03d.", "DICT with an odd number of items", 9),
])
def test_pickle_bounds(data, message, offset):
    with pytest.raises(pk.PickleError) as info:
        pk.walk(data, 0, len(data))
    assert info.value.reason == message and info.value.offset == offset


def test_pickle_limits():
    data = b"\x80\x02" + b"N0" * 100 + b"N."
    with pytest.raises(pk.PickleLimit) as info:
        pk.walk(data, 0, len(data), pk.Bounds(max_opcodes=50))
    assert info.value.rule == "scan.limit.opcodes" and info.value.reason == "more than 50 opcodes"
    with pytest.raises(pk.PickleLimit, match="MARK nesting deeper than 3"):
        pk.walk(b"((((N.", 0, 6, pk.Bounds(max_depth=3))


def test_pickle_opcode_table_matches_pickletools():
    # parse.pickle keeps a literal copy so that `modelkit scan` need not import pickletools; it must not drift.
    assert pickle_opcodes._OPS == {ord(op.code): (op.name, op.arg.name if op.arg is not None else None) for op in pickletools.opcodes}
    assert pk.looks_like_pickle(b"\x80\x05") and not pk.looks_like_pickle(b"\x80\x06") and not pk.looks_like_pickle(b"(")
