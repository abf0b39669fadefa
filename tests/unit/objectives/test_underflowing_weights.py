"""Finite losses and gradients when every weight underflows, in fp32 and bf16."""

import pytest
import torch

from nemo_jq.objectives import garl, paft, rb_rloo


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("estimator", [garl, paft])
def test_underflowing_weights_stay_finite(estimator, q, dtype):
    gen = torch.Generator().manual_seed(0)
    rlp = (torch.randn(4, 8, generator=gen) * 30 - 200).to(dtype).requires_grad_()
    alp = torch.full((4, 8), -1e4, dtype=dtype).requires_grad_()
    out = estimator(rlp, alp, q)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.per_example).all()
    assert torch.isfinite(rlp.grad).all() and torch.isfinite(alp.grad).all()
    assert out.metrics["w_underflow_fraction"] == 1.0
    assert all(map(lambda v: v == v and abs(v) != float("inf"), out.metrics.values()))
    if q == 1.0:
        # IWAE / EM still learn from the relative weights when every w underflows.
        assert alp.grad.abs().sum() > 0


def test_distinct_underflowing_weights_keep_their_ratios():
    rlp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    alp = torch.tensor([[-1e4, -1e4 + 1.0, -1e4 - 1.0]], dtype=torch.float64, requires_grad=True)
    garl(rlp, alp, 1.0, normalize=False).loss.backward()
    expected = -torch.softmax(alp.detach(), -1)  # IWAE pathwise weights: w_m / Σ w
    torch.testing.assert_close(alp.grad, expected)


def test_minus_infinity_log_weights_are_handled():
    rlp = torch.zeros(2, 4, requires_grad=True)
    alp = torch.tensor([[float("-inf")] * 4, [0.0, float("-inf"), -1.0, -2.0]], requires_grad=True)
    for out in (garl(rlp, alp, 0.5), paft(rlp, alp, 0.5), rb_rloo(rlp, alp)):
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(rlp.grad).all()
