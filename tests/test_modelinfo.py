"""``model_dtype`` / ``model_device``: the one definition of a model's dtype every stage reads."""

import torch
from torch import nn

from normswap.modelinfo import model_device, model_dtype


class _IntsFirst(nn.Module):
    """An integer parameter registered before the floating ones (quantized or index weights do this)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = nn.Parameter(torch.arange(4), requires_grad=False)
        self.proj = nn.Linear(4, 4).to(torch.bfloat16)


def test_the_dtype_is_the_first_floating_parameters_not_the_first_parameters():
    model = _IntsFirst()
    assert next(model.parameters()).dtype == torch.int64
    assert model_dtype(model) == torch.bfloat16


def test_a_model_without_floating_parameters_reads_as_the_default():
    assert model_dtype(nn.ReLU()) == torch.float32
    assert model_dtype(nn.ReLU(), default=torch.float64) == torch.float64


def test_the_device_is_the_first_parameters_and_the_cpu_without_any():
    assert model_device(nn.Linear(2, 2, device="meta")) == torch.device("meta")
    assert model_device(nn.ReLU()) == torch.device("cpu")
