"""AdamW's implementation is chosen per device in one place (``optim.adamw_kernel``): fused on CUDA, PyTorch's
default elsewhere, so CPU results are those of a plain ``torch.optim.AdamW`` (issue 51). On CUDA:
``tests/gpu/test_trainer_head_gpu.py``."""

from types import SimpleNamespace

import pytest
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


def test_the_key_chooses_the_kernel_on_cpu_and_the_stages_take_fused():
    """``optim.adamw_kernel``: ``fused`` runs the fused kernel on CPU too (TRL's default, so the stages'), ``loop``
    the per-parameter loop; the fused step lands within float rounding of the loop's."""
    from tidal.config import ConfigError, apply_overrides
    from tidal.optim.rules import OPTIM_RULES  # noqa: F401 (the key's rule is registered)
    from tidal.stages.common import stage_optim
    from tidal.system.validate import validate_run_config as validate

    p = torch.nn.Parameter(torch.zeros(2))
    assert adamw_kernel([p], "fused") == {"fused": True} and adamw_kernel([p], "loop") == {"foreach": False}
    assert adamw_kernel([_fake(cuda=True)], "loop") == {"foreach": False}
    assert stage_optim(1e-4).adamw_kernel == "fused" and OptimConfig().adamw_kernel == "auto"
    torch.manual_seed(0)
    models = [torch.nn.Linear(6, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m, OptimConfig(lr=1e-2, adamw_kernel=k))[0] for m, k in zip(models, ("loop", "fused"))]
    assert opts[1].param_groups[0]["fused"] and not opts[0].param_groups[0]["fused"]
    x = torch.randn(8, 6)
    for _ in range(3):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    from tidal.recipes import RECIPES
    with pytest.raises(ConfigError, match="optim.adamw_kernel: 'fast' is not one of"):
        apply_overrides(RECIPES.get("quickstart")(), ["optim.adamw_kernel=fast"])
    cfg = RECIPES.get("quickstart")()
    cfg.optim.adamw_kernel = "fast"  # set in code, past the config's own check
    with pytest.raises(ConfigError, match="optim.adamw_kernel.*auto, fused or loop"):
        validate(cfg)
