"""llama.cpp's verdict on the tokenizers modelkit writes into GGUF (issue 14).

For each family style of tests/test_gguf_vocab.py (tokenizers trained offline, saved with
save_pretrained), this writes a GGUF holding gguf_tokenizer_kv's keys and a small architecture
header, then has llama.cpp (llama-cpp-python, vocab_only) tokenize the test prompts and compares
the ids with the Hugging Face tokenizer's. llama-cpp-python lives in its own environment, so the
llama.cpp side runs there as a child process; nothing here is part of the pytest suite.

    PYTHONPATH=/path/to/llama-cpp-python .venv/bin/python bench/llamacpp_tokenizer.py [--llama-python PYTHON]

Prints one line per family (how many prompts agree: llama.cpp with the original; llama.cpp with the
folder tokenizer_assets writes from the file without modelkit's key, as for llama.cpp's own files;
transformers' GGUF reader with the original; the folder tokenizer_assets writes with the original;
llama.cpp given each prompt as gguf_vocab.llamacpp_prompt writes it: in NFC and with Metaspace(first)'s
leading space written out, which shows that nothing else differs), the other choice of
add_space_prefix for a Metaspace(first) tokenizer, and the first disagreements of llama.cpp, with both
id lists. Exit status 0 when every prompt of every family agrees, 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from gguf import GGUFValueType

ROOT = Path(__file__).resolve().parents[1]
STRING = GGUFValueType.STRING

# A header llama.cpp accepts for each architecture, so that it loads the file (vocab_only still reads
# the hyper-parameters). The numbers describe a tiny model; no tensors are needed to tokenize.
HEADER = {
    "context_length": 2048, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
    "attention.head_count": 4, "attention.head_count_kv": 4, "attention.layer_norm_rms_epsilon": 1e-6,
    "attention.layer_norm_epsilon": 1e-5, "rope.dimension_count": 16, "attention.key_length": 16,
    "attention.value_length": 16, "attention.sliding_window": 512,
}

LLAMA_SIDE = r"""
import json, sys
import llama_cpp
jobs = json.load(open(sys.argv[1]))
out = {}
for name, job in jobs.items():
    llm = llama_cpp.Llama(model_path=job["gguf"], vocab_only=True, verbose=False)
    out[name] = {k: [llm.tokenize(p.encode("utf-8"), add_bos=True, special=True) for p in job[k]]
                 for k in ("prompts", "forms")}
json.dump(out, sys.stdout)
"""


def _tests_module():
    spec = importlib.util.spec_from_file_location("test_gguf_vocab", ROOT / "tests" / "test_gguf_vocab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _more_prompts(name: str, marks: list[str], count: int = 150) -> list[str]:
    """Lines of standard-library sources the tokenizers were not trained on, and seeded random strings."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    lines = [ln for f in ("difflib.py", "csv.py", "fractions.py") for ln in (lib / f).read_text().splitlines() if ln]
    rng = random.Random(f"modelkit-{name}")
    pieces = [" ", "  ", "\t", "\n", "\n\n", "\r\n", "a", "The", "ing", "x1", "42", "1234567", "3.14", "'s", "'LL",
              "!?", "...", "==", "--", "é", "ß", "日本", "Ελ", "🙂", "👍🏽", "\u200d", "ﬁ", *marks]
    randoms = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(count)]
    # text that is not in NFC: Qwen2's tokenizer.json normalizes it, llama.cpp does not
    return rng.sample(lines, count) + randoms + ["decomposed: cafe\u0301 an\u0303o"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", default=sys.executable, help="a Python that imports llama_cpp")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from modelkit.models.gguf_vocab import PARTS_KEY, gguf_tokenizer_kv, llamacpp_prompt, tokenizer_assets

    t = _tests_module()
    with tempfile.TemporaryDirectory() as tmp:
        jobs, expected, reverse, by_reader, round_trip = {}, {}, {}, {}, {}
        for name, fam in t.FAMILIES.items():
            folder = Path(tmp) / name
            t.build_family(name, folder)
            original = AutoTokenizer.from_pretrained(folder)
            kv = gguf_tokenizer_kv(t.assets_of(folder), len(original))
            # general.name: llama.cpp keys a tokenizer quirk on it (Phi-3's rstrip needs "phi3" in the name)
            t.write_gguf(folder / "tok.gguf", fam.arch, {**kv, "general.name": (name, STRING, None)}, HEADER)
            # added tokens as a user types them: Gemma's whitespace tokens as spaces, not ▁
            marks = [m.replace("\u2581", " ") for m in (*fam.specials, *fam.extra, *fam.user) if m != "<unk>"]
            prompts = t.prompts(name) + _more_prompts(name, marks)
            tj = json.loads((folder / "tokenizer.json").read_text())
            forms = [llamacpp_prompt(tj, p) for p in prompts]
            jobs[name] = {"gguf": str(folder / "tok.gguf"), "prompts": prompts, "forms": forms}
            if fam.style == "metaspace":     # the other choice of add_space_prefix, to show why it is not taken
                other = {**kv, "tokenizer.ggml.add_space_prefix": (True, GGUFValueType.BOOL, None)}
                t.write_gguf(folder / "prefix.gguf", fam.arch, other, HEADER)
                jobs[f"{name} add_space_prefix=true"] = {**jobs[name], "gguf": str(folder / "prefix.gguf")}
            expected[name] = [original.encode(p) for p in prompts]
            # the reverse, as for a GGUF from llama.cpp's converter (no modelkit key): llama.cpp's way of splitting
            fields = {k: v for k, v in t.read_fields(folder / "tok.gguf").items() if k != PARTS_KEY}
            back = folder / "back"
            back.mkdir()
            for file, data in tokenizer_assets(fields).items():
                (back / file).write_bytes(data)
            reverse[name] = [AutoTokenizer.from_pretrained(back).encode(p) for p in prompts]
            exact = folder / "exact"           # the round trip: the folder from our own file
            exact.mkdir()
            for file, data in tokenizer_assets(t.read_fields(folder / "tok.gguf")).items():
                (exact / file).write_bytes(data)
            round_trip[name] = [AutoTokenizer.from_pretrained(exact).encode(p) for p in prompts]
            alone = folder / "gguf-only"      # transformers' GGUF reader, with no tokenizer.json beside the file
            alone.mkdir()
            shutil.copy(folder / "tok.gguf", alone / "tok.gguf")
            reader = AutoTokenizer.from_pretrained(alone, gguf_file="tok.gguf")
            by_reader[name] = [reader.encode(p) for p in prompts]
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        run = subprocess.run([args.llama_python, "-c", LLAMA_SIDE, str(Path(tmp) / "jobs.json")],
                             capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-4000:], file=sys.stderr)
            return 2
        got = json.loads(run.stdout)
    def count(a: list, b: list) -> int:
        return sum(x == y for x, y in zip(a, b, strict=True))

    print("prompts agreeing, per family style:\n  A: llama.cpp (our GGUF) with the original tokenizer\n"
          f"  B: llama.cpp with the folder tokenizer_assets writes from the GGUF less {PARTS_KEY} (llama.cpp's files)\n"
          "  C: transformers' GGUF reader with the original\n  D: the folder tokenizer_assets writes with the original\n"
          "  E: llama.cpp given llamacpp_prompt(prompt) (NFC, Metaspace(first)'s space), with the original\n")
    print(f"{'family':8s} {'pre':10s} {'prompts':>7s} {'A':>5s} {'B':>5s} {'C':>5s} {'D':>5s} {'E':>5s}")
    all_agree = True
    for name, want in expected.items():
        ids = got[name]["prompts"]
        agree = count(want, ids)
        all_agree &= agree == len(want)
        print(f"{name:8s} {t.FAMILIES[name].pre:10s} {len(want):7d} {agree:5d} {count(reverse[name], ids):5d} "
              f"{count(want, by_reader[name]):5d} {count(want, round_trip[name]):5d} "
              f"{count(want, got[name]['forms']):5d}")
    for job in got.keys() - expected.keys():
        name = job.split()[0]
        print(f"{job}: A {count(expected[name], got[job]['prompts'])}, E {count(expected[name], got[job]['forms'])}")
    for name, want in expected.items():
        shown = [(p, a, b) for p, a, b in zip(jobs[name]["prompts"], want, got[name]["prompts"], strict=True)
                 if a != b][:3]
        for prompt, a, b in shown:
            print(f"{name}: {prompt!r}\n    original:  {a}\n    llama.cpp: {b}")
    return 0 if all_agree else 1


if __name__ == "__main__":
    sys.exit(main())
