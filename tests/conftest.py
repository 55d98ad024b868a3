from __future__ import annotations

import pytest

from capplan.schemas.spec import Spec


def make_spec(**sections) -> Spec:
    """Spec from keyword sections, e.g. make_spec(lora={"enabled": True}, fixes=[])."""
    return Spec.model_validate(sections)


@pytest.fixture
def spec_factory():
    return make_spec
