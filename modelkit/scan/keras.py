"""Keras model configs (in .h5 files and .keras archives) and JSON files: Lambda layers and named code.

Keras stores a model's architecture as JSON: the `model_config` attribute of a legacy .h5 file,
`config.json` in a .keras zip. A `Lambda` layer carries Python bytecode that runs on load (Keras 3
refuses it unless safe_mode=False; Keras 2 runs it), and `module`/`class_name` pairs name classes
and functions to import. The configs are found and decoded by modelkit.parse.keras (no h5py); the
raw bytes are also searched here for a Lambda class name, so a config that cannot be parsed still
cannot hide one.
"""
from __future__ import annotations

from modelkit.errors import ParseError
from modelkit.parse import keras as keras_json
from modelkit.scan import headers
from modelkit.scan.model import Severity
from modelkit.scan.policy import classify

TYPE_CHECKING = False    # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

    from modelkit.scan.containers import Context

MAX_NODES = 1_000_000
_LAMBDA_MARKERS = (b'"class_name": "Lambda"', b'"class_name":"Lambda"', b'"class_name": "__lambda__"',
                   b'"class_name":"__lambda__"')
_SAFE_MODULES = ("keras", "tf_keras", "tensorflow.keras", "tensorflow.python.keras")
_OP_LAMBDAS = frozenset({"TFOpLambda", "SlicingOpLambda"})


def _module_ok(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _SAFE_MODULES)


def analyse_config(config: Any, ctx: Context, label: str) -> int:
    """Walk a Keras config tree (any JSON value: a bare config, a wrapper, a whole TF.js model.json);
    returns the number of layers/objects seen.

    Code is found three ways: a Lambda (or Keras 3 `__lambda__`) object; any object whose
    `function_type` is "lambda" (Keras 2 unmarshals its function, whatever the class); and any string
    that is a marshalled code object (parse.keras.marshalled_code) outside an object already reported.
    """
    sink = ctx.sink(label)
    stack, seen, objects = [(config, 0, False)], 0, 0
    while stack:
        node, depth, reported = stack.pop()
        seen += 1
        if seen > MAX_NODES or depth > 500:
            sink.add(Severity.DANGEROUS, "scan.limit.json", "the Keras config is too large or deep to examine")
            return objects
        if isinstance(node, str):
            if not reported and keras_json.marshalled_code(node):
                sink.add(Severity.DANGEROUS, "keras.lambda",
                         "the config holds marshalled Python bytecode, which Keras runs when it loads the model",
                         name="marshal")
            continue
        if isinstance(node, list):
            stack.extend((item, depth + 1, reported) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        class_name = node.get("class_name")
        layer = (node.get("config") or {}).get("name", "") if isinstance(node.get("config"), dict) else ""
        code = class_name in ("Lambda", "__lambda__") or node.get("function_type") == "lambda"
        if code and not reported:
            what = f"Lambda layer {layer!r}" if class_name in ("Lambda", "__lambda__") else \
                f"{str(class_name)[:80]} object {layer!r} (function_type 'lambda')"
            sink.add(Severity.DANGEROUS, "keras.lambda",
                     f"{what} carries Python bytecode that runs when the model is loaded", name="Lambda")
        stack.extend((value, depth + 1, reported or code) for value in node.values())
        if not isinstance(class_name, str):
            continue
        objects += 1
        if class_name in _OP_LAMBDAS:
            sink.add(Severity.SUSPICIOUS, "keras.config.op_lambda",
                     f"{class_name} layer {layer!r} calls a TensorFlow function named in the file", name=layer)
        module = node.get("module")
        if isinstance(module, str) and not _module_ok(module):
            target = node.get("config") if class_name == "function" and isinstance(node.get("config"), str) else class_name
            verdict = classify(module, str(target))
            if verdict.severity == Severity.DANGEROUS:
                sink.add(Severity.DANGEROUS, "keras.config.module", f"the config names {module}.{target}: "
                         f"{verdict.detail}", module=module, name=str(target))
            else:
                sink.add(Severity.SUSPICIOUS, "keras.config.custom_object",
                         f"the config names {module}.{target}, code outside Keras that loads only when "
                         "registered as a custom object", module=module, name=str(target))
        registered = node.get("registered_name")
        if isinstance(registered, str) and ">" in registered:
            sink.add(Severity.SUSPICIOUS, "keras.config.custom_object",
                     f"registered custom object {registered!r} runs the user's own code", name=registered)
    return objects


def scan_json(buf, start: int, end: int, ctx: Context, label: str, *, keras_archive: bool = False) -> str:
    """A JSON file: Keras configs however wrapped, TF.js model.json files, chat templates in tokenizer
    configs. Returns the format name: "tfjs" for a TF.js model, else "json"."""
    sink = ctx.sink(label)
    if end - start > keras_json.MAX_JSON:
        sink.add(Severity.SUSPICIOUS, "scan.limit.json", f"JSON larger than {keras_json.MAX_JSON} bytes was not examined")
        return "json"
    try:
        doc = keras_json.load_json(buf, start, end)
    except ParseError as e:
        severity = Severity.DANGEROUS if keras_archive else Severity.SUSPICIOUS
        sink.add(severity, "json.malformed", e.reason)
        return "json"
    from modelkit.parse import tfjs as tfjs_json  # here: only JSON files need it (start-up time)

    what, fmt = [], "json"
    is_tfjs = tfjs_json.looks_like_model(doc)
    if isinstance(doc, dict) and ("class_name" in doc or keras_archive or is_tfjs
                                  or keras_json.model_config(doc) is not None):
        objects = analyse_config(_config_part(doc) if is_tfjs else doc, ctx, label)
        if objects or not is_tfjs:
            what.append(f"Keras config, {objects} objects")
    if is_tfjs:
        from modelkit.scan import tfjs

        what.append(tfjs.scan_model(doc, ctx, label))
        fmt = "tfjs"
    if isinstance(doc, dict) and "chat_template" in doc:
        templates = doc["chat_template"]
        if isinstance(templates, str):
            templates = [{"name": "default", "template": templates}]
        for item in templates if isinstance(templates, list) else []:
            if isinstance(item, dict) and isinstance(item.get("template"), str):
                headers.check_template(item["template"], f"chat_template[{item.get('name')}]", ctx, label)
        what.append("chat template")
    ctx.examined.append(f"{label}: JSON" + (f" ({', '.join(what)})" if what else ""))
    return fmt


def _config_part(doc: dict) -> dict:
    """What of a TF.js model.json may hold Keras objects: all of it but the weights manifest and a graph
    model's nodes, which scan.tfjs checks with their own bounds (a large graph would otherwise reach
    this walk's node limit)."""
    part = {key: value for key, value in doc.items() if key != "weightsManifest"}
    topology = doc.get("modelTopology")
    if isinstance(topology, dict) and "node" in topology:
        part["modelTopology"] = {key: value for key, value in topology.items() if key not in ("node", "library")}
    return part


def scan_hdf5(buf, start: int, end: int, ctx: Context, label: str) -> None:
    """An HDF5 file: look for a Keras model config; HDF5 itself holds no pickles."""
    sink = ctx.sink(label)
    configs = objects = 0
    for _, doc in keras_json.configs_in(buf, start, end):
        configs += 1
        objects += analyse_config(doc, ctx, label)
    for marker in _LAMBDA_MARKERS:   # a backstop for configs the JSON search could not parse
        at = buf.find(marker, start, end)
        if at >= 0:
            sink.add(Severity.DANGEROUS, "keras.lambda",
                     "the file holds a Keras Lambda layer, whose bytecode runs when the model is loaded",
                     offset=at - start, name="Lambda")
            break
    ctx.examined.append(f"{label}: HDF5 file" + (f", {configs} Keras config(s) with {objects} objects" if configs
                                                  else ", no Keras config"))
