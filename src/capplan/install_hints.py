"""The `pip install` command that installs this capplan (or one of its extras) again.

capplan is not published on a package index, so `pip install capplan` finds
nothing there, or another project's package of that name. Every install hint
capplan prints names the source the running capplan was installed from, as
pip recorded it (PEP 610's `direct_url.json`): an editable checkout, a local
folder or archive, or a git URL and commit. Without such a record (capplan
run from a source tree, or the source since removed) the hint names the
repository at this version's release tag.
"""

from __future__ import annotations

import json
import os
import shlex
from urllib.parse import unquote, urlsplit

from capplan import __version__

# Placeholder: the URL capplan's git repository is served from. It is the
# `Repository` URL in pyproject.toml too (a test keeps the two equal).
REPOSITORY = "https://git.example.invalid/capplan.git"


def release_requirement(extra: str | None = None) -> str:
    """The documented source: the repository at this version's tag (`docs/releasing.md`)."""
    return f"{_name(extra)} @ git+{REPOSITORY}@v{__version__}"


def install_args(extra: str | None = None) -> list[str]:
    """pip's arguments (after `pip install`) that install this capplan from where it came from."""
    record = _direct_url()
    if record is None:
        return [release_requirement(extra)]
    url = record.get("url")
    if not isinstance(url, str) or not url:
        return [release_requirement(extra)]
    vcs = record.get("vcs_info")
    if isinstance(vcs, dict):
        commit = vcs.get("commit_id") or vcs.get("requested_revision")
        if vcs.get("vcs") != "git" or not isinstance(commit, str):
            return [release_requirement(extra)]
        if url.startswith("file:///"):
            # The pip Python 3.11 ships (23.2) refuses `git+file:///path` (a URL without a host).
            url = "file://localhost/" + url.removeprefix("file:///")
        subdirectory = record.get("subdirectory")
        fragment = f"#subdirectory={subdirectory}" if isinstance(subdirectory, str) and subdirectory else ""
        return [f"{_name(extra)} @ git+{url}@{commit}{fragment}"]
    path = _local_path(url)
    if path is not None and not os.path.exists(path):
        return [release_requirement(extra)]  # the folder or archive it was installed from is gone
    dir_info = record.get("dir_info")
    if isinstance(dir_info, dict) and dir_info.get("editable") and path is not None:
        return ["-e", f"{path}[{extra}]" if extra else path]
    return [f"{_name(extra)} @ {url}"]


def pip_install(extra: str | None = None, python: str | None = None) -> str:
    """A shell command: `[PYTHON -m] pip install ...`, quoted for a POSIX shell."""
    prefix = f"{shlex.quote(python)} -m pip install" if python else "pip install"
    return " ".join([prefix, *(shlex.quote(arg) for arg in install_args(extra))])


def _name(extra: str | None) -> str:
    return f"capplan[{extra}]" if extra else "capplan"


def _direct_url() -> dict | None:
    """The PEP 610 record of the installed capplan distribution, if pip wrote one."""
    from importlib import metadata

    try:
        text = metadata.distribution("capplan").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _local_path(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme != "file":
        return None
    return unquote(parts.path)
