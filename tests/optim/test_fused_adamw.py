"""AdamW's implementation is chosen per device in one place (``optim.adamw_kernel``): fused on CUDA, PyTorch's
default elsewhere, so CPU results are those of a plain ``torch.optim.AdamW`` (issue 51). On CUDA:
``tests/gpu/test_trainer_head_gpu.py``."""

from types import SimpleNamespace

import torch

from tidal.optim import OptimConfig, adamw_kernel, build_optimizer


def _fake(cuda: bool, floating: bool = True, data=None):
    return SimpleNamespace(is_cuda=cuda, is_floating_point=lambda: floating,
                           data=torch.zeros(1) if data is None else data)


def test_the_choice_is_made_per_device():
    assert adamw_kernel([_fake(cuda=True), _fake(cuda=True)]) == {"fused": True}
    assert adamw_kernel([_fake(cuda=True), _fake(cuda=False)]) == {}  # mixed devices: PyTorch's default
    assert adamw_kernel([_fake(cuda=True, floating=False)]) == {}
    assert adamw_kernel([torch.nn.Parameter(torch.zeros(2))]) == {}
    assert adamw_kernel([]) == {}


def test_a_sharded_parameter_keeps_the_default():
    class NotPlain(torch.Tensor):  # stands in for FSDP's DTensor
        pass
    assert adamw_kernel([_fake(cuda=True, data=torch.zeros(1).as_subclass(NotPlain))]) == {}


def test_cpu_results_equal_plain_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    twin.load_state_dict(model.state_dict())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    mine, _ = build_optimizer(model, cfg)
    plain = torch.optim.AdamW(twin.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                              weight_decay=cfg.weight_decay)
    assert not mine.param_groups[0]["fused"]
    x = torch.randn(16, 4)
    for _ in range(3):
        for m, opt in ((model, mine), (twin, plain)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
