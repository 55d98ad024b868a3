from __future__ import annotations

import atexit
import shutil
import tempfile

import pytest

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


def make_spec(**sections):
    """Spec from keyword sections, e.g. make_spec(lora={"enabled": True}, fixes=[])."""
    # Imported here: the GPU suite's recipe installs capplan without its dependencies
    # into vLLM's environment, and collection must not need pydantic.
    from capplan.schemas.spec import Spec

    return Spec.model_validate(sections)


@pytest.fixture
def spec_factory():
    return make_spec
