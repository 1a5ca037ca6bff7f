"""Keras model configs as stored: a JSON document (`config.json` in .keras zips, tokenizer configs) and
the JSON of a legacy .h5 file's `model_config` attribute, found in the HDF5 bytes without h5py.

HDF5 stores a string attribute's bytes contiguously, so a config is found by searching for where a
Keras config starts (`{"class_name"` / `{"module"`), bounded by the NUL that ends the attribute, and
decoded with json. Sizes and the number of candidates are capped before anything is decoded.
Standard library only.
"""
from __future__ import annotations

import json

from modelkit.errors import ParseError

MAX_JSON = 64 << 20
MAX_CANDIDATES = 10_000
CONFIG_STARTS = (b'{"class_name"', b'{"module"')


def load_json(buf, start: int = 0, end: int | None = None):
    """The JSON document in buf[start:end].

    Raises:
        ParseError: larger than MAX_JSON, not UTF-8, or not JSON.
    """
    end = len(buf) if end is None else end
    if end - start > MAX_JSON:
        raise ParseError(f"JSON larger than {MAX_JSON} bytes was not read")
    try:
        return json.loads(bytes(buf[start:end]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ParseError(f"not valid JSON ({e})") from None


def configs_in(buf, start: int = 0, end: int | None = None):
    """Yield (offset, document) for each JSON object in buf[start:end] that starts like a Keras config.

    Candidates that do not decode are skipped; at most MAX_CANDIDATES are tried.
    """
    end = len(buf) if end is None else end
    pos, candidates = start, 0
    while candidates < MAX_CANDIDATES:
        hits = [h for h in (buf.find(s, pos, end) for s in CONFIG_STARTS) if h >= 0]
        if not hits:
            return
        at = min(hits)
        candidates += 1
        stop = buf.find(b"\x00", at, min(end, at + MAX_JSON))
        stop = stop if stop >= 0 else min(end, at + MAX_JSON)
        try:
            doc, used = json.JSONDecoder().raw_decode(bytes(buf[at:stop]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            pos = at + 1
            continue
        yield at, doc
        pos = at + max(used, 1)
