"""Launch profiles: named sets of flags for common set-ups (`voltllm serve MODEL --profile NAME`).

Each profile is a YAML file in this directory: `description` (what it is for, and what it costs, with the measurements
behind it) and `flags` (a mapping of flag names to values, the format of a `--config` file, without `model`). A path
to such a file works as a NAME too, for profiles of one's own. The command line and `--config` win over a profile; a
later `--profile` over an earlier one (voltllm.cli_config.merge_config).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from voltllm.config import ConfigError

PROFILE_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class LaunchProfile:
    name: str
    description: str
    flags: dict = field(default_factory=dict)


def profile_names() -> list[str]:
    """The profiles shipped with voltllm."""
    return sorted(f[: -len(".yaml")] for f in os.listdir(PROFILE_DIR) if f.endswith(".yaml"))


def load_profile(name: str) -> LaunchProfile:
    """A shipped profile by name, or a profile file by path."""
    from voltllm.cli_config import load_yaml

    path = name if name.endswith((".yaml", ".yml")) else os.path.join(PROFILE_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        where = "no such file" if name.endswith((".yaml", ".yml")) else \
            f"no such profile; the profiles are: {', '.join(profile_names())} (or a path to a .yaml file)"
        raise ConfigError(f"--profile {name}: {where}")
    data = load_yaml(path, f"--profile {name}")
    if not isinstance(data, dict) or not isinstance(data.get("flags"), dict) \
            or not isinstance(data.get("description", ""), str) or set(data) - {"description", "flags"}:
        raise ConfigError(f"--profile {name}: expected a mapping with `description` (text) and `flags` (a mapping of "
                          "flag names to values) and nothing else")
    return LaunchProfile(name, " ".join(data.get("description", "").split()), data["flags"])
