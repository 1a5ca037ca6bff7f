"""`modelkit distill`: train a small student on a teacher's soft targets, against the student alone."""
from __future__ import annotations

import click

from modelkit.cli.options import device_option, force_option, output_options, read_options
from modelkit.cli.output import Progress, emit_json, human_bytes, table


@click.command()
@click.option("--teacher", required=True, type=click.Path(dir_okay=True), help="The trained teacher checkpoint.")
@click.option("--student", required=True, metavar="ARCH[:CONFIG]",
              help="Student model: the teacher's kind, with a config, e.g. cnn:channels=[8,16],hidden=32 (ARCH alone: a default student).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for student/ (and scratch/) runs.")
@click.option("--temperature", type=float,
              help="Softening of both distributions (default: 4 for mlp and cnn, 1 for tinylm; measured).")
@click.option("--alpha", type=click.FloatRange(0.0, 1.0),
              help="Weight of the soft targets (default: 0.9 for mlp and cnn, 0.5 for tinylm).")
@click.option("--epochs", type=click.IntRange(1), help="Training epochs (default: the model's own recipe).")
@click.option("--seed", type=int, default=0, show_default=True)
@device_option
@click.option("--baseline/--no-baseline", default=True, show_default=True, help="Also train the student alone, same epochs and seed.")
@read_options()
@force_option
@output_options
def distill(teacher: str, student: str, out: str, temperature: float | None, alpha: float | None, epochs: int | None, seed: int,
            device: str, baseline: bool, source_format: str | None, trust: bool, key: str | None, arch: str | None,
            force: bool, as_json: bool) -> None:
    """Distill TEACHER into a smaller STUDENT and compare it with the student trained alone.

    loss = alpha * T^2 * KL(teacher/T || student/T) + (1 - alpha) * cross-entropy, on the teacher's
    own training data, through the zoo's training loop (torchrun DDP works).

    \b
    Examples:
      modelkit distill --teacher runs/cnn/model.safetensors --student cnn --out runs/cnn-distill
      modelkit distill --teacher runs/tinylm/model.safetensors --student tinylm:num_hidden_layers=2,hidden_size=96 --out runs/lm-small
    """
    from modelkit.api import load
    from modelkit.pipeline.compress import distill_file
    from modelkit.quantizers.distill import default_config

    spec = load(teacher, format=source_format, trust=trust, key=key).arch
    teacher_arch = arch if arch and ":" not in arch else (spec.name if spec else "")
    config = default_config(teacher_arch, temperature=temperature, alpha=alpha)
    with Progress("distill", enabled=not as_json) as progress:
        report = distill_file(teacher, student, out, config, epochs=epochs,
                              seed=seed, device=device, baseline=baseline, force=force, progress=progress,
                              source_format=source_format, trust=trust, key=key, arch=arch)
    if report is None:                  # a rank other than 0 under torchrun: rank 0 reports
        return
    if as_json:
        emit_json({"schema": "modelkit.distill/1", "ok": True, **report.to_dict()})
        return
    rows = [("teacher", report.teacher), ("distilled student", report.student)]
    if report.scratch:
        rows.append(("student alone", report.scratch))
    click.echo(table(["model", "parameters", "file", report.metric], [
        (label, f"{r['parameters']:,}", human_bytes(r["bytes"]), f"{r['value']:.4f}") for label, r in rows], align="lrrr"))
    if report.scratch:
        better = (report.student["value"] > report.scratch["value"]) == report.higher_is_better
        click.echo(f"distillation {'beat' if better else 'did not beat'} the student trained alone "
                   f"({report.student['value']:.4f} vs {report.scratch['value']:.4f}, {report.epochs} epochs, seed {seed})")
