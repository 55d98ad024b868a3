"""Install hints name where this capplan came from (PEP 610), never a package index;
`capplan --version` and the version written once."""

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan import __version__, install_hints
from capplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
TAG = f"v{__version__}"


def _installed_from(monkeypatch, tmp_path, record):
    """Make `capplan` look installed with this direct_url.json (None: installed without one)."""
    info = tmp_path / f"capplan-{__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: capplan\nVersion: {__version__}\n")
    if record is not None:
        (info / "direct_url.json").write_text(record if isinstance(record, str) else json.dumps(record))
    real = metadata.distribution
    monkeypatch.setattr(
        metadata, "distribution", lambda name: metadata.PathDistribution(info) if name == "capplan" else real(name)
    )


def test_editable_checkout(monkeypatch, tmp_path):
    checkout = tmp_path / "my checkout"
    checkout.mkdir()
    _installed_from(monkeypatch, tmp_path, {"url": checkout.as_uri(), "dir_info": {"editable": True}})
    assert install_hints.pip_install("plot") == f"pip install -e '{checkout}[plot]'"
    assert install_hints.pip_install(python="/venv/bin/python") == f"/venv/bin/python -m pip install -e '{checkout}'"


def test_git_url_at_the_installed_commit(monkeypatch, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    record = {"url": "https://git.corp/ml/capplan.git", "vcs_info": {"vcs": "git", "commit_id": commit}}
    _installed_from(monkeypatch, tmp_path, record)
    assert install_hints.pip_install("vllm", python="python3") == (
        f"python3 -m pip install 'capplan[vllm] @ git+https://git.corp/ml/capplan.git@{commit}'"
    )


def test_local_folder_and_archive(monkeypatch, tmp_path):
    wheel = tmp_path / f"capplan-{__version__}-py3-none-any.whl"
    wheel.write_bytes(b"")
    _installed_from(monkeypatch, tmp_path, {"url": wheel.as_uri(), "archive_info": {}})
    assert install_hints.install_args("plot") == [f"capplan[plot] @ {wheel.as_uri()}"]
    wheel.unlink()  # the archive is gone: the documented source instead
    assert install_hints.install_args("plot") == [
        f"capplan[plot] @ git+{install_hints.REPOSITORY}@{TAG}",
    ]


@pytest.mark.parametrize(
    "record",
    [None, "not json", "[]", {"url": "https://x/capplan.git", "vcs_info": {"vcs": "hg", "commit_id": "abc"}}],
    ids=["no-record", "unreadable", "not-an-object", "not-git"],
)
def test_without_a_usable_record_the_release_tag(monkeypatch, tmp_path, record):
    _installed_from(monkeypatch, tmp_path, record)
    assert install_hints.pip_install() == f"pip install 'capplan @ git+{install_hints.REPOSITORY}@{TAG}'"


def test_not_installed_at_all(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert install_hints.install_args("vllm") == [f"capplan[vllm] @ git+{install_hints.REPOSITORY}@{TAG}"]


def test_no_hint_in_the_source_names_the_package_index():
    """Every `pip install` capplan prints goes through install_hints."""
    for path in (ROOT / "src" / "capplan").rglob("*.py"):
        if path.name == "install_hints.py":
            continue
        for line in path.read_text().splitlines():
            assert "pip install capplan" not in line and "pip install 'capplan" not in line, f"{path}: {line}"


def test_the_png_hint_names_this_installation(monkeypatch, tmp_path):
    import capplan.present.plot as plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    out = CliRunner().invoke(
        app, ["show", str(ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"), "--plot", str(tmp_path / "p.png")]
    )
    assert out.exit_code == 2 and f"{install_hints.pip_install('plot')}, or give a .svg path" in out.stderr
    assert plot  # imported above, before matplotlib was hidden


def test_the_version_is_written_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "capplan.__version__"}
    assert project["project"]["urls"]["Repository"] == install_hints.REPOSITORY
    assert f"## [{__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_capplan_version():
    out = subprocess.run([sys.executable, "-m", "capplan", "--version"], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"capplan {__version__}\n", "")


def test_the_examples_pin_a_release_commit():
    """The examples pin the release commit (docs/releasing.md), never a version tag the repository
    may not have (tests/test_pins.py checks every pin resolves)."""
    for path in (".pre-commit-hooks.yaml", "examples/ci/capture-plans.yml", "README.md", "docs/releasing.md"):
        text = (ROOT / path).read_text()
        assert not re.findall(r"(?:capplan\.git@|rev: )(v\d+\.\d+\.\d+)", text), path
        assert re.search(r"(?:capplan\.git@|rev: )COMMIT\b", text), path
