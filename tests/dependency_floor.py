"""The runtime dependencies' version ranges (pyproject's [project] dependencies) checked against what is installed.

pip enforces them on an install; a run that imports the checkout without installing it (the GPU machine's
`PYTHONPATH=$PWD` runs over its own packages) does not, and there a transformers below the floor showed up as dozens
of unrelated-looking failures (session 69). tests/conftest.py stops the session at once with this list instead.
Packages that are not installed are left to the tests that import them (their ImportError names them).
"""
from __future__ import annotations

import os
import tomllib
from importlib import metadata
from typing import Callable, Iterable, Optional

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


def runtime_requirements(pyproject: str = PYPROJECT) -> list[str]:
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def installed_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def out_of_range(requirements: Iterable[str],
                 version_of: Callable[[str], Optional[str]] = installed_version) -> list[str]:
    """One line per installed package whose version the requirement excludes ("transformers 5.17.0: needs
    >=5.18,<6"). Local version labels (torch's "+cpu") and pre-releases count as their release."""
    lines = []
    for text in requirements:
        req = Requirement(text)
        found = version_of(req.name)
        if found is None or not req.specifier:
            continue
        try:
            release = Version(Version(found).base_version)
        except InvalidVersion:
            continue
        if not req.specifier.contains(release, prereleases=True):
            lines.append(f"{req.name} {found}: needs {req.specifier}")
    return lines
