import pytest

from capplan.planner.lora_cases import (
    captured_lora_counts,
    kernel_grid,
    kernel_slots,
    lora_capture_cases,
    lora_dispatch_map,
)
from tests.conftest import make_spec


@pytest.mark.parametrize(
    "lora, cases",
    [
        ({"enabled": False}, [0]),
        ({"enabled": True, "max_loras": 4}, [0, 5]),
        ({"enabled": True, "max_loras": 4, "specialize": False}, [0, 5]),
        ({"enabled": True, "max_loras": 4, "specialize_active": True}, [0, 1, 2, 4, 5]),
        ({"enabled": True, "max_loras": 3, "specialize_active": True}, [0, 1, 2, 4]),
        ({"enabled": True, "max_loras": 4, "specialize": False, "specialize_active": True}, [0, 5]),
    ],
)
def test_capture_cases(lora, cases):
    assert lora_capture_cases(make_spec(lora=lora)) == cases


def test_dispatch_map_rounds_up():
    assert lora_dispatch_map([0, 1, 2, 4, 5]) == {1: 1, 2: 2, 3: 4, 4: 4, 5: 5}
    assert lora_dispatch_map([0]) == {}


def test_kernel_slots_count_the_no_adapter_id():
    assert kernel_slots(0, True) == 0
    assert kernel_slots(2, False) == 2
    assert kernel_slots(2, True) == 3


def test_kernel_grid_mirrors_prepare_tensors():
    active = make_spec(lora={"enabled": True, "max_loras": 4, "specialize_active": True})
    assert captured_lora_counts(4, True) == [1, 2, 4, 5]
    assert kernel_grid([-1], 8, active) == 0  # all no-adapter: kernels skipped
    assert kernel_grid([1, 2, 3], 8, active) == 4  # 3 distinct rounds up to 4
    assert kernel_grid([1, 2, 3, 4], 8, active) == 4  # vLLM's max_loras+1 dummy: one short
    assert kernel_grid([1, 2, 3, 4, -1], 8, active) == 5  # with the -1 row: full grid
    assert kernel_grid([1, 2, 3, 4, -1], 2, active) == 2  # only 2 dummy requests: ids 1, 2
    plain = make_spec(lora={"enabled": True, "max_loras": 4})
    assert kernel_grid([1], 1, plain) == 5  # not specialized: always max_loras+1
