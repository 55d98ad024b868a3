from __future__ import annotations

import os

import pytest

from capplan.schemas.spec import Spec


def make_spec(**sections) -> Spec:
    """Spec from keyword sections, e.g. make_spec(lora={"enabled": True}, fixes=[])."""
    return Spec.model_validate(sections)


@pytest.fixture
def spec_factory():
    return make_spec


@pytest.fixture(autouse=True, scope="session")
def _private_dispatch_cache(tmp_path_factory):
    """Commands under test (compile, dispatch) store dispatch tables; keep them out of
    the user's ~/.cache. Tests that look at the cache point CAPPLAN_CACHE_DIR elsewhere."""
    before = os.environ.get("CAPPLAN_CACHE_DIR")
    os.environ["CAPPLAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("capplan-cache"))
    yield
    if before is None:
        os.environ.pop("CAPPLAN_CACHE_DIR", None)
    else:
        os.environ["CAPPLAN_CACHE_DIR"] = before
