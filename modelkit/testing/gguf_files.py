"""GGUF files as other tools write them, made from modelkit's own for tests."""
from __future__ import annotations

from pathlib import Path


def as_llama_cpp_writes_it(path: Path, out: Path) -> Path:
    """`path` rewritten to `out` without modelkit's own keys: what llama.cpp's converter writes, so a reader
    takes the config from llama.cpp's keys and the family from general.architecture. Tensors unchanged."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "modelkit.", "general.architecture")):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
