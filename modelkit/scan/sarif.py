"""SARIF 2.1.0 output, so CI systems (GitHub code scanning, GitLab, Azure DevOps) can show scan findings.

Spec: https://docs.oasis-open.org/sarif/sarif/v2.1.0/sarif-v2.1.0.html. One run, one rule per rule id
seen, one result per finding; archive members appear as a logical location under the file.
Standard library only.
"""
from __future__ import annotations

from typing import Any

from modelkit.scan.model import ScanReport, Severity

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://github.com/modelkit/modelkit/blob/main/docs/security.md"
_LEVEL = {Severity.SAFE: "note", Severity.SUSPICIOUS: "warning", Severity.DANGEROUS: "error"}

# rule id prefix -> what the rule family means (the SARIF rule's short description).
RULE_FAMILIES = {
    "pickle.global.denied": "A pickle imports a function that runs code, imports modules, or touches files or the network",
    "pickle.global.unknown": "A pickle imports something outside the checkpoint allowlist",
    "pickle.global": "A pickle names a callable in a way no legitimate checkpoint does",
    "pickle.module.needs_trust": "A whole-module pickle: loading it runs the model class's own code",
    "pickle.call": "A pickle calls a callable computed at load time",
    "pickle.build": "A pickle sets state that reaches interpreter internals or shared objects",
    "pickle.mutate": "A pickle modifies an importable object",
    "pickle.memo": "A pickle reads memo slots it never wrote (scanner-confusion)",
    "pickle.malformed": "A malformed opcode stream (treated as a bypass attempt)",
    "pickle.trailing": "Data after a pickle's STOP opcode",
    "torch": "A torch checkpoint whose layout does not match its pickles",
    "torchscript.code": "TorchScript code that runs on load",
    "pt2.aotinductor": "A torch.export archive carrying AOTInductor compiled code",
    "pt2.target": "A torch.export program whose graph calls something other than an operator",
    "pt2.config": "A torch.export payload config naming a member outside its folder",
    "pt2": "A torch.export archive with custom operators, pickled objects or malformed JSON",
    "archive.native_code": "An archive member that is a compiled shared library or executable",
    "archive.unsupported": "An archive the scanner cannot open, so its content is unknown",
    "zip": "A zip archive crafted to confuse loaders or extractors",
    "tar": "A tar archive crafted to escape its folder",
    "npy": "A numpy file with an object dtype or a lying header",
    "compressed": "A compressed stream that cannot be examined or expands absurdly",
    "keras": "A Keras model config with Lambda layers or code named from outside Keras",
    "json": "A JSON document that cannot be parsed",
    "onnx": "An ONNX model reading data outside its folder or using custom operator domains",
    "safetensors": "A safetensors header that does not match the file",
    "gguf": "A GGUF header that does not match the file, or a chat template that reaches Python internals",
    "polyglot": "A file that reads as two formats",
    "container": "Container-level observations",
    "code": "Source code shipped with a model",
    "scan.limit": "A scan limit was reached, so part of the file was not examined",
}


def _describe(rule: str) -> str:
    best = max((prefix for prefix in RULE_FAMILIES if rule == prefix or rule.startswith(prefix + ".")
                or rule.startswith(prefix)), key=len, default="")
    return RULE_FAMILIES.get(best, rule)


def _location(path: str, offset: int | None) -> dict[str, Any]:
    file, _, member = path.partition(":") if not _is_drive(path) else (path, "", "")
    physical: dict[str, Any] = {"artifactLocation": {"uri": file.replace("\\", "/")}}
    if offset is not None and not member:
        physical["region"] = {"byteOffset": offset}
    location: dict[str, Any] = {"physicalLocation": physical}
    if member:
        location["logicalLocations"] = [{"fullyQualifiedName": member, "kind": "member"}]
    return location


def _is_drive(path: str) -> bool:
    return len(path) > 2 and path[1] == ":" and path[2] in "\\/"


def to_sarif(report: ScanReport, *, version: str) -> dict[str, Any]:
    """The report as a SARIF 2.1.0 log (a dict ready for json.dumps)."""
    rule_ids = sorted({f.rule for f in report.findings})
    index = {rule: i for i, rule in enumerate(rule_ids)}
    worst_level = {}
    for f in report.findings:
        worst_level[f.rule] = max(worst_level.get(f.rule, Severity.SAFE), f.severity)
    rules = [{"id": rule, "name": rule, "shortDescription": {"text": _describe(rule)},
              "helpUri": INFORMATION_URI, "defaultConfiguration": {"level": _LEVEL[worst_level[rule]]}}
             for rule in rule_ids]
    results = []
    for f in report.findings:
        where = f" ({f.callable})" if f.callable else ""
        results.append({"ruleId": f.rule, "ruleIndex": index[f.rule], "level": _LEVEL[f.severity],
                        "message": {"text": f"{f.severity.label}: {f.detail}{where}"},
                        "locations": [_location(f.path, f.offset)],
                        "properties": {"severity": f.severity.label, "module": f.module, "name": f.name}})
    notifications = [{"level": "error", "message": {"text": e.message},
                      "locations": [_location(e.path, None)]} for e in report.errors]
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "modelkit", "semanticVersion": version, "version": version,
                                "informationUri": INFORMATION_URI, "rules": rules}},
            "invocations": [{"executionSuccessful": not report.errors,
                             "toolExecutionNotifications": notifications}],
            "artifacts": [{"location": {"uri": s.path.replace("\\", "/")}, "description": {"text": s.format}}
                          for s in report.files],
            "results": results,
        }],
    }
