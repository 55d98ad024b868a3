from __future__ import annotations

import atexit
import shutil
import tempfile

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

from capplan.schemas.spec import Spec

# Hypothesis keeps an example database and a constants cache (owner-only files) in
# .hypothesis/ under the working folder; the tests leave nothing in the checkout.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="capplan-tests-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)


def make_spec(**sections) -> Spec:
    """Spec from keyword sections, e.g. make_spec(lora={"enabled": True}, fixes=[])."""
    return Spec.model_validate(sections)


@pytest.fixture
def spec_factory():
    return make_spec
