"""Record keeping shared by every `voltllm bench` scenario: the command line, the commit, the software
environment, the GPU's name, and writing the result JSON (fixed key order)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Any, Optional

# top-level keys of a result file, in this order (others are dropped)
REPORT_KEYS = ("name", "gpu", "commit", "commit_dirty", "command", "created", "model", "metrics", "limit",
               "baseline", "profile", "env", "config")


def command(args: argparse.Namespace) -> str:
    argv = getattr(args, "bench_argv", None)
    if argv is None:
        prog = os.path.basename(sys.argv[0]) or "voltllm"
        # `python -m voltllm.cli bench ...` (no console script, e.g. PYTHONPATH=$PWD on the GPU machine)
        head = ["python", "-m", "voltllm.cli"] if prog in ("cli.py", "__main__.py") else [prog]
        argv = head + sys.argv[1:]
    return shlex.join(argv)


def _git(*cmd: str) -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "-C", here, *cmd], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit(args: argparse.Namespace) -> tuple[str, Optional[bool]]:
    if args.commit:
        return args.commit, None
    head = _git("rev-parse", "HEAD")
    if not head:
        return "unknown", None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head, bool(status) if status is not None else None


def env() -> dict:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "platform": platform.platform()}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: record that
            out[mod] = None
    out["driver"] = None
    if torch.cuda.is_available():
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            out["driver"] = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            pass
        out["gpu_count"] = torch.cuda.device_count()
    return out


def gpu_name(device: Any) -> str:
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def finish(report: dict, args: argparse.Namespace, default_name: str) -> dict:
    """Add command, commit, env and name; return the report in REPORT_KEYS order."""
    report = {"command": command(args), **report}
    report["commit"], report["commit_dirty"] = commit(args)
    report["env"] = env()
    report["name"] = args.name or default_name
    return {k: report[k] for k in REPORT_KEYS if k in report}


def write_json(obj: Any, output_dir: str, file_name: str) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, file_name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    return path
