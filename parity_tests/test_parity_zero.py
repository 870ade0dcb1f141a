"""ZeRO-1/2/3 and HSDP against ZeroRedundancyOptimizer and FSDP2, float64, every tensor at every
step (``cases.F64``; the DDP family is in test_parity.py)."""

import pytest

from parity_tests.cases import ZERO_FAMILY, check_float64, f64_names


@pytest.mark.slow
@pytest.mark.parametrize("name", f64_names(*ZERO_FAMILY))
def test_float64_every_tensor_every_step(name):
    check_float64(name)
