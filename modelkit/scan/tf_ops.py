"""TensorFlow ops that reach outside the model when a graph runs, each with its reason: the one table the
SavedModel scanner (scan/tensorflow.py) and the TF.js graph scanner (scan/tfjs.py) judge nodes by, and the ops
TensorFlow registers (an op outside them is a custom op). Standard library only.
"""
from __future__ import annotations

import os

from modelkit.scan.model import Severity

D, S = Severity.DANGEROUS, Severity.SUSPICIOUS
_PY = "calls a Python function of the process that runs the graph"
_READS = "reads a file at a path the graph computes"
_RECORDS = "opens record files at paths the graph computes"
_NET = "opens a network connection or serves one (tf.distribute.experimental.rpc)"
_SUMMARY = "creates a summary writer that writes files at a path the graph computes"

# Op -> (severity, what it does). Our own list: the ops TensorFlow 2.21 registers that reach outside the
# model when run, each checked against the registry by fixtures/tensorflow/generate.py (ops.json). Sources:
# modelscan's SavedModel op denylist (ReadFile, WriteFile); TensorFlow's own `saved_model_cli scan` denylist
# (ReadFile, WriteFile, PrintV2); the TensorAbuse study (ZJU-SEC, 2024: file read/write, directory listing and
# network ops as primitives in SavedModels); tf.py_function / numpy_function, which run the host's Python.
RISKY_OPS: dict[str, tuple[Severity, str]] = {
    "PyFunc": (D, f"{_PY} (tf.numpy_function / tf.py_func)"),
    "PyFuncStateless": (D, f"{_PY} (tf.numpy_function, stateless)"),
    "EagerPyFunc": (D, f"{_PY} (tf.py_function)"),
    "ReadFile": (D, _READS),
    "WriteFile": (D, "writes a file at a path the graph computes"),
    "MatchingFiles": (D, "lists files matching a pattern the graph computes"),
    "ImmutableConst": (D, "maps a file named in the graph into memory"),
    "WholeFileReader": (D, f"{_READS} (queue reader)"),
    "WholeFileReaderV2": (D, f"{_READS} (queue reader)"),
    "TextLineReader": (D, f"{_READS} (queue reader)"),
    "TextLineReaderV2": (D, f"{_READS} (queue reader)"),
    "FixedLengthRecordReader": (D, f"{_READS} (queue reader)"),
    "FixedLengthRecordReaderV2": (D, f"{_READS} (queue reader)"),
    "TFRecordReader": (D, f"{_READS} (queue reader)"),
    "TFRecordReaderV2": (D, f"{_READS} (queue reader)"),
    "LMDBReader": (D, f"{_READS} (queue reader)"),
    "TextLineDataset": (D, _RECORDS),
    "TFRecordDataset": (D, _RECORDS),
    "TFRecordDatasetV2": (D, _RECORDS),
    "FixedLengthRecordDataset": (D, _RECORDS),
    "FixedLengthRecordDatasetV2": (D, _RECORDS),
    "LMDBDataset": (D, _RECORDS),
    "ExperimentalLMDBDataset": (D, _RECORDS),
    "CSVDataset": (D, _RECORDS),
    "CSVDatasetV2": (D, _RECORDS),
    "ExperimentalCSVDataset": (D, _RECORDS),
    "SqlDataset": (D, "opens a database at a path the graph computes and runs a query"),
    "ExperimentalSqlDataset": (D, "opens a database at a path the graph computes and runs a query"),
    "LoadDataset": (D, "reads a saved dataset at a path the graph computes"),
    "SaveDataset": (D, "writes a dataset at a path the graph computes"),
    "SaveDatasetV2": (D, "writes a dataset at a path the graph computes"),
    "SnapshotDataset": (D, "writes and reads dataset snapshots at a path the graph computes"),
    "SnapshotDatasetV2": (D, "writes and reads dataset snapshots at a path the graph computes"),
    "DatasetToTFRecord": (D, "writes a TFRecord file at a path the graph computes"),
    "ExperimentalDatasetToTFRecord": (D, "writes a TFRecord file at a path the graph computes"),
    "CreateSummaryFileWriter": (D, _SUMMARY),
    "CreateSummaryDbWriter": (D, _SUMMARY),
    "LoadAndRemapMatrix": (D, "reads a checkpoint at a path the graph computes"),
    "GenerateVocabRemapping": (D, "reads vocabulary files at paths the graph computes"),
    "RpcClient": (D, _NET), "RpcCall": (D, _NET), "RpcServer": (D, _NET), "RpcServerStart": (D, _NET),
    "RpcServerRegister": (D, _NET), "RpcGetValue": (D, _NET), "RpcCheckStatus": (D, _NET),
    "InitializeTableFromTextFile": (S, "reads a text file (a vocabulary, normally a SavedModel asset)"),
    "InitializeTableFromTextFileV2": (S, "reads a text file (a vocabulary, normally a SavedModel asset)"),
}
# The saver's ops: expected in the functions saver_def names, flagged anywhere else.
CHECKPOINT_OPS: dict[str, str] = {
    "SaveV2": "writes a checkpoint at a path the graph computes",
    "Save": "writes a checkpoint at a path the graph computes",
    "SaveSlices": "writes a checkpoint at a path the graph computes",
    "MergeV2Checkpoints": "moves and deletes checkpoint files at paths the graph computes",
    "RestoreV2": "reads a checkpoint at a path the graph computes",
    "Restore": "reads a checkpoint at a path the graph computes",
    "RestoreSlice": "reads a checkpoint at a path the graph computes",
}
# Ops whose string attributes can send data out: attribute -> the values that are harmless.
ATTR_CHECKS = {
    "PrintV2": ("output_stream", ("stderr", "stdout", "log(info)", "log(warning)", "log(error)")),
    "DecodeProtoV2": ("descriptor_source", ("local://",)),
    "EncodeProto": ("descriptor_source", ("local://",)),
}
DEBUG_OPS = ("DebugIdentity", "DebugIdentityV2", "DebugIdentityV3", "DebugNanCount", "DebugNumericSummary",
             "DebugNumericSummaryV2")

# Every op TensorFlow 2.21 registers (fixtures/tensorflow/generate.py writes it from TF_GetAllOpList). An op
# outside it, and not a function of the graph's library, is a custom op: it runs only where the loading process
# has loaded a native library that registers it (tf.load_op_library), so the file relies on native code.
OPS_FILE = os.path.join(os.path.dirname(__file__), "tensorflow_ops.txt")
_KNOWN_OPS: set[str] = set()


def known_ops() -> set[str]:
    """TensorFlow's registered op names (read once)."""
    if not _KNOWN_OPS:
        with open(OPS_FILE, encoding="utf-8") as f:
            _KNOWN_OPS.update(line.strip() for line in f if line.strip() and not line.startswith("#"))
    return _KNOWN_OPS
