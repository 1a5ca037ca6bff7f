"""Scanner speed and memory on a ~1 GiB torch checkpoint and on 1,000 small ones, against picklescan and modelscan.

    .venv/bin/python bench/scan.py [--dir /tmp/scan-bench] [--size-mib 1024] [--count 1000]
                                   [--peers /tmp/peers-venv] [--repeat 3]

The peers are whole commands from their own virtualenv, never project dependencies:

    python3 -m venv /tmp/peers-venv && /tmp/peers-venv/bin/pip install picklescan modelscan

It prints, from one run:

- the 1 GiB checkpoint: `modelkit.scan.scan()` time inside a warm process (bar: < 0.1 s), the whole
  `modelkit scan` command (bar: < 0.3 s) and its peak RSS (bar: < 100 MiB; tensor data is never read);
- one `modelkit scan` over a folder of 1,000 small checkpoints (bar: < 5 s);
- `picklescan -p` and `modelscan -p` on the same files, and the ratios (bars: faster than picklescan,
  at least 5x faster than modelscan).

Whole commands are compared as users install them: modelkit is built as a wheel and installed
(without dependencies; `modelkit scan` needs none, and click, which the other commands need,
comes with modelscan) into the peers' virtualenv beside them. The editable development install in
.venv is printed too, for information: its import finder (setuptools' editable mode for our
package-dir mapping) imports pathlib and more at every Python start, and where
PYTHONDONTWRITEBYTECODE is set (as on the development VM) its modules are compiled from source at
every run, which doubles the command's time there.

Every figure is the median of `--repeat` runs with a warm page cache; each command runs in a fresh
process and its peak RSS comes from wait4(). Figures, not a timed test: the bars are reported, never asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

BARS = {"api_s": 0.1, "command_s": 0.3, "rss_mib": 100, "folder_s": 5.0, "picklescan_ratio": 1.0,
        "modelscan_ratio": 5.0}


def make_big(path: Path, size_mib: int) -> None:
    """A Llama-shaped state_dict of about `size_mib` MiB (float32), written by torch.save."""
    if path.exists() and abs(path.stat().st_size - size_mib * 2**20) < 2**24:
        return
    import torch
    hidden, layers = 1024, 0
    tensors, total = {}, 0
    while total < size_mib * 2**20:
        for name, shape in (("q_proj", (hidden, hidden)), ("k_proj", (hidden, hidden)), ("v_proj", (hidden, hidden)),
                            ("o_proj", (hidden, hidden)), ("gate_proj", (4 * hidden, hidden)),
                            ("up_proj", (4 * hidden, hidden)), ("down_proj", (hidden, 4 * hidden)),
                            ("input_layernorm", (hidden,)), ("post_attention_layernorm", (hidden,))):
            t = torch.zeros(shape)
            tensors[f"model.layers.{layers}.{name}.weight"] = t
            total += t.numel() * 4
        layers += 1
    torch.save(tensors, path)


def make_folder(folder: Path, count: int) -> None:
    if folder.exists() and len(list(folder.iterdir())) == count:
        return
    import torch
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        state = {"net.0.weight": torch.full((30, 2), float(i)), "net.0.bias": torch.zeros(30),
                 "net.2.weight": torch.zeros(2, 30), "net.2.bias": torch.zeros(2)}
        torch.save(state, folder / f"ckpt_{i:04d}.pt")


def run(cmd: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit code) of one command in a fresh process."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    return wall, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def median_run(cmd: list[str], repeat: int) -> tuple[float, float, int]:
    runs = [run(cmd) for _ in range(repeat)]
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]


def install_modelkit(peers: Path) -> str | None:
    """Build modelkit's wheel and install it into the peers' virtualenv; its `modelkit` command, or None."""
    python = peers / "bin" / "python"
    if not python.exists():
        return None
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "--wheel-dir", wheels, str(root)], check=True, capture_output=True)
        wheel = next(Path(wheels).glob("modelkit-*.whl"))
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)],
                       check=True, capture_output=True)
    if subprocess.run([str(python), "-c", "import click"], capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "click>=8.2"], check=True, capture_output=True)
    return str(peers / "bin" / "modelkit")


_API = textwrap.dedent("""
    import resource, sys, time
    from modelkit.scan import scan
    scan(sys.argv[1])                      # warm: imports, page cache
    times = []
    for _ in range(int(sys.argv[2])):
        started = time.perf_counter(); report = scan(sys.argv[1]); times.append(time.perf_counter() - started)
    assert not report.errors, report.errors
    print(sorted(times)[len(times) // 2], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/scan-bench"))
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--peers", type=Path, default=Path("/tmp/peers-venv"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    big, folder = args.dir / "big.pt", args.dir / "small"
    if args.make:
        make_big(big, args.size_mib)
        make_folder(folder, args.count)
        return
    # Make the files in a child process: this one stays small (no torch), because a forked child's
    # peak RSS starts from its parent's, which would otherwise hide the scanner's own memory use.
    subprocess.run([sys.executable, __file__, "--make", "--dir", str(args.dir), "--size-mib", str(args.size_mib),
                    "--count", str(args.count)], check=True)
    dev_modelkit = str(Path(sys.executable).with_name("modelkit"))
    modelkit = install_modelkit(args.peers) or dev_modelkit
    out = subprocess.run([sys.executable, "-c", _API, str(big), str(args.repeat)], capture_output=True, text=True,
                         check=True).stdout.split()
    api_s, api_rss = float(out[0]), float(out[1])
    cmd_s, cmd_rss, cmd_rc = median_run([modelkit, "scan", str(big)], args.repeat)
    folder_s, folder_rss, folder_rc = median_run([modelkit, "scan", str(folder)], args.repeat)
    print(f"checkpoint: {big} ({big.stat().st_size / 2**30:.2f} GiB); folder: {args.count} files in {folder}")
    print(f"{'what':44} {'seconds':>9} {'peak RSS MiB':>13} {'exit':>5}")
    print(f"{'modelkit.scan.scan(big) in-process':44} {api_s:9.4f} {api_rss:13.1f} {'':>5}")
    print(f"{'modelkit scan big.pt (whole command)':44} {cmd_s:9.4f} {cmd_rss:13.1f} {cmd_rc:>5}")
    print(f"{'modelkit scan small/ (whole command)':44} {folder_s:9.4f} {folder_rss:13.1f} {folder_rc:>5}")
    if modelkit != dev_modelkit:
        dev_s, _, _ = median_run([dev_modelkit, "scan", str(big)], args.repeat)
        dev_folder_s, _, _ = median_run([dev_modelkit, "scan", str(folder)], args.repeat)
        print(f"{'  (editable dev install: big.pt, small/)':44} {dev_s:9.4f} {dev_folder_s:9.4f}")
    peers = {}
    for tool in ("picklescan", "modelscan"):
        exe = args.peers / "bin" / tool
        if not exe.exists():
            print(f"{tool}: not installed in {args.peers} (see this file's docstring); skipped")
            continue
        peers[tool] = (median_run([str(exe), "-p", str(big)], args.repeat),
                       median_run([str(exe), "-p", str(folder)], args.repeat))
        (b_s, b_rss, b_rc), (f_s, f_rss, f_rc) = peers[tool]
        print(f"{tool + ' -p big.pt':44} {b_s:9.4f} {b_rss:13.1f} {b_rc:>5}")
        print(f"{tool + ' -p small/':44} {f_s:9.4f} {f_rss:13.1f} {f_rc:>5}")
    print("\nratios (peer time / modelkit time; higher means modelkit is faster):")
    for tool, ((b_s, _, _), (f_s, _, _)) in peers.items():
        print(f"  {tool:11} big.pt {b_s / cmd_s:6.2f}x   small/ {f_s / folder_s:6.2f}x")
    print("\nbars:")
    checks = [("API scan of the 1 GiB checkpoint", api_s, "<", BARS["api_s"]),
              ("whole command on the 1 GiB checkpoint", cmd_s, "<", BARS["command_s"]),
              ("peak RSS of that command (MiB)", cmd_rss, "<", BARS["rss_mib"]),
              ("whole command on 1,000 checkpoints", folder_s, "<", BARS["folder_s"])]
    for tool, key in (("picklescan", "picklescan_ratio"), ("modelscan", "modelscan_ratio")):
        if tool in peers:
            (b_s, _, _), (f_s, _, _) = peers[tool]
            checks.append((f"{tool} / modelkit, big.pt", b_s / cmd_s, ">", BARS[key] if key == "modelscan_ratio"
                           else BARS[key]))
            checks.append((f"{tool} / modelkit, small/", f_s / folder_s, ">", BARS[key]))
    for label, value, op, bar in checks:
        ok = value < bar if op == "<" else value > bar
        print(f"  {'PASS' if ok else 'MISS'}  {label}: {value:.4g} ({op} {bar:g})")


if __name__ == "__main__":
    main()
