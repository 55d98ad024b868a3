from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import pytest

from tests.conformance import coverage

# Hypothesis keeps an example database and a constants cache (owner-only files) in
# .hypothesis/ under the working folder; the tests leave nothing in the checkout.
# The GPU suite runs without Hypothesis (tests/gpu/README.md installs only pytest),
# so the setting is made only where Hypothesis is installed.
try:
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:
    pass
else:
    _HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="capplan-tests-hypothesis-")
    set_hypothesis_home_dir(_HYPOTHESIS_HOME)
    atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)

    from tests import hypothesis_profiles

    def pytest_configure(config):
        try:
            config.capplan_hypothesis_profile = hypothesis_profiles.load(os.environ.get("HYPOTHESIS_PROFILE"))
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None

    def pytest_collection_modifyitems(config, items):
        if config.capplan_hypothesis_profile == "deep":
            hypothesis_profiles.scale((getattr(item, "obj", None) for item in items), hypothesis_profiles.DEEP_FACTOR)

    def pytest_report_header(config):
        return f"hypothesis profile: {config.capplan_hypothesis_profile} (tests/hypothesis_profiles.py)"


# What the conformance tier compared (tests/conformance/coverage.py), summed over the xdist
# workers and printed at the end of the run.
def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["capplan_conformance"] = json.dumps(coverage.snapshot())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    data = getattr(node, "workeroutput", {}).get("capplan_conformance")
    if data:
        coverage.merge(json.loads(data))


def pytest_terminal_summary(terminalreporter):
    for line in coverage.summary():
        terminalreporter.write_line(line)


def make_spec(**sections):
    """Spec from keyword sections, e.g. make_spec(lora={"enabled": True}, fixes=[])."""
    # Imported here: the GPU suite's recipe installs capplan without its dependencies
    # into vLLM's environment, and collection must not need pydantic.
    from capplan.schemas.spec import Spec

    return Spec.model_validate(sections)


@pytest.fixture
def spec_factory():
    return make_spec
