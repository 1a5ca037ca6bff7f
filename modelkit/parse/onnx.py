"""ONNX ModelProto facts from the wire format: is this a model, and its field numbers (onnx/onnx.proto).

Two questions, asked with different care: `looks_like_model` is the scanner's (any ModelProto-shaped
message must be scanned, so it is generous), `is_model` is the converter's detect (claims a file
only when its fields are in the order and of the wire types every ONNX writer produces). Both read
field headers only. Standard library only.
"""
from __future__ import annotations

from modelkit.errors import ParseError
from modelkit.parse.protobuf import LEN, VARINT, fields, varint

# Field numbers (onnx.proto).
MODEL = {"ir_version": 1, "graph": 7, "opset_import": 8, "metadata_props": 14, "training_info": 20,
         "functions": 25}
GRAPH = {"node": 1, "initializer": 5, "sparse_initializer": 15}
NODE = {"op_type": 4, "domain": 7, "attribute": 5}
ATTRIBUTE = {"t": 5, "g": 6, "tensors": 10, "graphs": 11, "sparse_tensor": 22, "sparse_tensors": 23}
TENSOR = {"dims": 1, "data_type": 2, "segment": 3, "name": 8, "raw_data": 9, "external_data": 13,
          "data_location": 14}
TYPED_TENSOR_FIELDS = frozenset({4, 5, 6, 7, 10, 11})  # float, int32, string, int64, double, uint64 data
SPARSE = {"values": 1, "indices": 2}
FUNCTION = {"name": 1, "node": 7, "opset_import": 9, "domain": 10}
TRAINING = {"initialization": 1, "algorithm": 2}

MODEL_FIELDS = frozenset({1, 2, 3, 4, 5, 6, 7, 8, 14, 20, 21, 25, 26})
# Wire type of each ModelProto field; `is_model` rejects a known field with another one.
MODEL_WIRE = {1: VARINT, 2: LEN, 3: LEN, 4: LEN, 5: VARINT, 6: LEN, 7: LEN, 8: LEN, 14: LEN, 20: LEN, 25: LEN,
              26: LEN}
GRAPH_FIELDS = frozenset({1, 2, 5, 10, 11, 12, 13, 14, 15, 16})
MAX_FIELDS_SCANNED = 10_000      # top-level fields looks_like_model walks
MAX_FIELDS_DETECTED = 64         # top-level fields is_model walks before it gives up


def looks_like_model(buf, start: int, end: int) -> bool:
    """A ModelProto at top level: only ModelProto field numbers, an ir_version and a graph or opset."""
    if end - start < 4 or buf[start] != 0x08:
        return False
    seen = set()
    try:
        for count, (number, wire, _) in enumerate(fields(buf, start, end)):
            if number not in MODEL_FIELDS or count > MAX_FIELDS_SCANNED:
                return False
            if number == 1 and wire != VARINT:
                return False
            seen.add(number)
    except ParseError:
        return False
    return 1 in seen and (7 in seen or 8 in seen)


def is_model(buf) -> bool:
    """A ModelProto as writers order it: ir_version (1..100) first, known fields with their wire
    types, up to a graph whose first field is a GraphProto field."""
    try:
        for count, (number, wire, value) in enumerate(fields(buf, 0, len(buf))):
            if number in MODEL_WIRE and wire != MODEL_WIRE[number]:
                return False
            if count == 0 and (number != MODEL["ir_version"] or not 1 <= value <= 100):
                return False
            if number == MODEL["graph"]:
                start, stop = value
                if start == stop:
                    return True
                first, _ = varint(buf, start, stop)
                return first >> 3 in GRAPH_FIELDS and first & 7 == LEN
            if count >= MAX_FIELDS_DETECTED:
                return False
    except ParseError:
        return False
    return False
