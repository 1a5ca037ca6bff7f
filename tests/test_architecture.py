"""Layout and import rules from docs/architecture.md."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from modelkit.formats import FORMATS, load_format
from modelkit.models import MODELS, load_model_module
from modelkit.models.plugin import (
    PLUGIN_NAMES,
    DistillDefaults,
    GGUFLayout,
    HFFamily,
    KerasLayout,
    PruneGroup,
    QualityBar,
)

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")


def test_import_modelkit_does_not_import_torch():
    result = _run("import modelkit, sys; modelkit.__version__; print('torch' in sys.modules, 'onnx' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False False"


# Which modules may import torch (docs/architecture.md, "Which layers may import torch"): every module of
# these folders and these modules never does at import; the weight-file commands run on them alone.
TORCH_FREE_FOLDERS = ("parse", "scan", "storage", "cli")
TORCH_USERS = {"modelkit.storage.qdq"}      # ONNX's QDQ layouts, in torch ops: only the ONNX converter uses them
TORCH_FREE = (
    "modelkit", "modelkit.errors", "modelkit.metadata", "modelkit.checkpoint", "modelkit.formats", "modelkit.schemes",
    "modelkit.api", "modelkit.models", "modelkit.models.plugin", "modelkit.models.keras_map", "modelkit.models.keras_plan", "modelkit.models._hf",
    *(f"modelkit.models.{family}" for family in ("gemma2", "gemma3", "gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3")),
    "modelkit.pipeline.convert", "modelkit.pipeline.inputs", "modelkit.pipeline.load", "modelkit.pipeline.quantize", "modelkit.pipeline.quantize_weights",
    "modelkit.pipeline.reports", "modelkit.pipeline.verify", "modelkit.pipeline.write",
    "modelkit.converters.gguf", "modelkit.converters.hdf5", "modelkit.converters.hf", "modelkit.converters.npz",
    "modelkit.converters.pt2", "modelkit.converters.pth",
    "modelkit.converters.safetensors", "modelkit.converters.tfjs", "modelkit.converters.torchscript", "modelkit.quantizers.gguf_arrays",
    "modelkit.quantizers.tfjs_uint",
)


def test_torch_free_layers_import_no_torch():
    modules = [*TORCH_FREE, *(f"modelkit.{folder}.{p.stem}" for folder in TORCH_FREE_FOLDERS
                              for p in sorted((ROOT / "modelkit" / folder).glob("*.py"))
                              if p.stem != "__init__" and f"modelkit.{folder}.{p.stem}" not in TORCH_USERS)]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "    if 'torch' in sys.modules:\n"
            "        print(name)\n"
            "        break\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing {result.stdout.strip()} imports torch"


def test_cli_help_does_not_import_torch():
    code = ("import sys\nfrom click.testing import CliRunner\nfrom modelkit.cli import main\n"
            "for args in ([], ['--help'], ['train', '--help'], ['inspect', '--help'], ['models']):\n"
            "    r = CliRunner().invoke(main, args)\n    assert r.exit_code in (0, 2), (args, r.output)\n"
            "print('torch' in sys.modules)")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["converters", "quantizers"])
def test_plugin_folders_are_not_top_level_packages(name):
    result = _run(f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {name}")
    assert result.returncode != 0
    assert f"import modelkit.{name}, not '{name}'" in result.stderr


@pytest.mark.parametrize("name", ["converters", "quantizers"])
def test_plugin_folders_import_under_modelkit(name):
    module = importlib.import_module(f"modelkit.{name}")
    assert Path(module.__file__).resolve().parent == ROOT / name


def test_console_script_and_python_m_agree():
    exe = Path(sys.executable).with_name("modelkit")
    assert exe.exists(), "pip install -e . should install the modelkit console script"
    a = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    b = subprocess.run([sys.executable, "-m", "modelkit", "--version"], capture_output=True, text=True)
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and "modelkit" in a.stdout


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_module_has_detect_read_write(name):
    module = load_format(name)
    for attribute in ("detect", "read", "write"):
        assert callable(getattr(module, attribute, None)), f"{name} lacks {attribute}"


@pytest.mark.parametrize("name", sorted(n for n, info in MODELS.items() if not info.hf and not info.topology))
def test_every_model_module_has_the_plugin_names(name):
    module = load_model_module(name)
    for attribute in PLUGIN_NAMES:
        assert hasattr(module, attribute), f"{name} lacks {attribute}"
    assert module.MODEL.arch == name
    config = module.CONFIG()
    for function in ("example_inputs", "keras_layers", "onnx_axes", "prune_groups"):
        assert callable(getattr(module, function)), f"{name}.{function} is not a function"
    assert isinstance(module.onnx_axes(config), dict)
    assert isinstance(module.keras_layers(config), (KerasLayout, type(None)))
    groups = module.prune_groups(config)
    assert groups is None or all(isinstance(g, PruneGroup) for g in groups)
    assert isinstance(module.DISTILL, DistillDefaults) and isinstance(module.QUALITY, QualityBar)
    assert isinstance(module.STUDENT, dict) and isinstance(module.GGUF, (GGUFLayout, type(None)))
    module.CONFIG(**module.STUDENT)                          # the default student builds


@pytest.mark.parametrize("name", sorted(n for n, info in MODELS.items() if info.hf))
def test_every_hf_family_declares_its_family_as_data(name):
    """A Hugging Face family module is plain data (FAMILY); the registry gives it the zoo's other names."""
    module = load_model_module(name)
    family = module.FAMILY
    assert isinstance(family, HFFamily) and family.model_types and family.architecture
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in family.tensors.items())
    assert {"embedding_length", "block_count", "attention.head_count"} <= set(family.hparams)
    assert all(hasattr(module, attribute) for attribute in PLUGIN_NAMES) and module.TRAINING is None
    assert "torch" not in _imports(Path(module.__file__))


def test_model_modules_import_nothing_above_the_models_layer():
    for path in (ROOT / "modelkit" / "models").glob("*.py"):
        bad = {n for n in _imports(path) if n.startswith(("modelkit.converters", "modelkit.quantizers",
                                                           "modelkit.pipeline", "modelkit.checkpoint"))}
        assert not bad, f"{path.name} imports {bad}"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


# The layer rule (docs/architecture.md): bottom first; a module imports its own layer and the layers
# before it, never a later one. Within a layer, modules import each other without circles.
LAYERS = [
    ("core", ("modelkit.errors", "modelkit.metadata")),
    ("parse", ("modelkit.parse",)),
    ("scan", ("modelkit.scan",)),
    ("storage", ("modelkit.storage",)),
    ("models", ("modelkit.models",)),
    ("checkpoint", ("modelkit.checkpoint", "modelkit.formats", "modelkit.schemes", "modelkit.testing")),
    ("quantizers", ("modelkit.quantizers",)),
    ("converters", ("modelkit.converters",)),
    ("pipeline", ("modelkit.pipeline",)),
    ("api", ("modelkit.api",)),
    ("cli", ("modelkit.cli", "modelkit.__main__")),
]
ROOT_MODULES_MAX = 10
# Issue 13 removes these in its next commits (the parse layer, the CLI); the tuple must end empty.
_CIRCLES_BEING_REMOVED: tuple[str, ...] = ()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("converters", "quantizers"):
        parts.insert(0, "modelkit")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_files() -> dict[str, Path]:
    files = [*(ROOT / "modelkit").rglob("*.py"), *(ROOT / "converters").glob("*.py"), *(ROOT / "quantizers").glob("*.py")]
    return {_module_name(p): p for p in files}


def _runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modelkit modules `path` imports at run time, at any depth (imports inside functions count;
    `if TYPE_CHECKING:` blocks, which never run, do not)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
               for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("modelkit"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("modelkit"))
    found.discard(_module_name(path))
    found.discard("modelkit")    # the package root only resolves names lazily
    return found


def _layer(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and docs/architecture.md)")


def test_every_module_imports_only_its_layer_and_those_below():
    modules = _source_files()
    upward = []
    for name, path in sorted(modules.items()):
        if name == "modelkit":
            continue
        for dep in sorted(_runtime_imports(path, modules)):
            if _layer(dep) > _layer(name):
                upward.append(f"{name} ({LAYERS[_layer(name)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})")
    assert not upward, "imports that reach up a layer:\n" + "\n".join(upward)


def test_no_import_circles():
    modules = _source_files()
    graph = {name: _runtime_imports(path, modules) & set(modules) for name, path in modules.items()}
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                circles.append(" -> ".join(trail[trail.index(dep):] + [node, dep]) if dep in trail else f"{node} -> {dep}")
            elif dep not in state:
                visit(dep, trail + [node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    circles = [c for c in circles if not c.startswith(_CIRCLES_BEING_REMOVED)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_root_of_modelkit_stays_small():
    root = sorted(p.name for p in (ROOT / "modelkit").glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, f"{len(root)} modules at modelkit/: {root}; put new ones in a layer package"


@pytest.mark.parametrize("layer", ["modelkit.parse", "modelkit.scan"])
def test_parse_and_scan_never_import_torch(layer):
    result = _run(f"import sys, {layer}, pkgutil, importlib\n"
                  f"for m in pkgutil.iter_modules({layer}.__path__):\n"
                  f"    importlib.import_module('{layer}.' + m.name)\n"
                  "print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_converters_do_not_import_each_other_or_quantizers():
    for path in (ROOT / "converters").glob("*.py"):
        bad = {n for n in _imports(path) if n.startswith(("modelkit.converters", "modelkit.quantizers"))}
        assert not bad, f"{path.name} imports {bad}"


def test_library_never_imports_cli():
    for path in (ROOT / "modelkit").rglob("*.py"):
        if "cli" in path.relative_to(ROOT / "modelkit").parts or path.name == "__main__.py":
            continue
        bad = {n for n in _imports(path) if n.startswith("modelkit.cli")}
        assert not bad, f"{path} imports {bad}"


def test_library_never_prints():
    for path in list((ROOT / "modelkit").rglob("*.py")) + list((ROOT / "converters").glob("*.py")):
        if "cli" in path.relative_to(ROOT).parts or path.name == "demo.py":
            continue
        calls = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("print", "exit")]
        assert not calls, f"{path} calls print/exit"


def test_fixtures_and_tests_are_not_packages():
    assert not (ROOT / "fixtures" / "__init__.py").exists()
    assert not (ROOT / "tests" / "__init__.py").exists()


def test_readme_quick_start_and_ci_agree():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
