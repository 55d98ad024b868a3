import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    try:
        import vllm  # noqa: F401

        has_vllm = True
    except ImportError:
        has_vllm = False
    if has_gpu and has_vllm:
        return
    reason = "needs a CUDA GPU and vLLM (run on an H200, see tests/gpu/README.md)"
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))
