"""Mixture-of-experts routing: find a model's routers, record the experts each token chose, replay them.

Why: in RL on an MoE model the engine and the trainer choose each token's top-k experts independently, and
small numerical differences (bf16 vs fp32, kernels, batch layout) flip some choices. A flipped expert is a
different function, not a rounding error: the trainer then scores tokens with a network the sampler never
ran, and the engine/trainer log-prob gap grows by an order of magnitude. Rollout Routing Replay (R3, Ma et
al., arXiv 2510.11370) records the engine's choices with each sample and makes the trainer use them; GSPO's
Routing Replay (R2, Zheng et al., arXiv 2507.18071, sec. 4.3) replays the trainer's own choices from before
the update so every minibatch of a step scores with the same experts.

What is replayed is the *selection* only. The gate weights are recomputed from the trainer's own router
logits over the replayed experts (softmax over all experts, the chosen ones' probabilities, renormalized
where the architecture renormalizes), so the router keeps its gradient and the loss sees the trainer's gates.

How: transformers 5 gives every MoE architecture tidal runs one router module per MoE layer whose forward
returns ``(router_logits, gate_weights, expert_ids)`` (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ...).
``Routing`` puts a forward hook on each; the hook can hand the chosen ids to a ``sink`` (the engine writes
them next to its keys and values, ``rollout/slots.py``), keep the logits (the auxiliary losses), and, given a
``plan`` (expert ids per token and layer, ``NO_ROUTE`` where there is none), return the planned ids with
gates recomputed. The plan stays set until the caller clears it, so activation checkpointing's recompute
in the backward replays the same experts.

Routes are stored compactly as ``uint8`` [tokens, layers, k] (expert ids < 255; ``NO_ROUTE`` = 255 marks a
token without a recorded route: the model's own choice is used there).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tidal.models.architecture import UnsupportedArchitecture

NO_ROUTE = 255
"""A token without a recorded route (padding, a sampled token the engine never fed): replay keeps the model's
own choice for it, and agreement does not count it."""
ROUTE_DTYPE = torch.uint8
REPLAY_MODES = ("off", "r2", "r3")


@dataclass(frozen=True)
class GateRule:
    """How an architecture's router turns logits and chosen experts into gate weights."""

    softmax_first: bool
    """True: softmax over all experts, then the chosen ones' probabilities (Qwen-MoE, Mixtral, OLMoE); False:
    softmax over the chosen experts' logits only (GPT-OSS)."""
    normalize: bool | str
    """Renormalize the chosen probabilities to sum to 1: True, False, or the router's attribute that says."""


GATE_RULES = {
    "Qwen2MoeTopKRouter": GateRule(True, "norm_topk_prob"),
    "Qwen3MoeTopKRouter": GateRule(True, "norm_topk_prob"),
    "Qwen3VLMoeTextTopKRouter": GateRule(True, "norm_topk_prob"),
    "OlmoeTopKRouter": GateRule(True, "norm_topk_prob"),
    "MixtralTopKRouter": GateRule(True, True),
    "GptOssTopKRouter": GateRule(False, False),
}
"""Routers whose gates tidal recomputes under replay (read from transformers 5's modeling files). A router
not listed still records; replaying through it is refused (``UnsupportedArchitecture``) rather than guessed."""


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's router modules in layer order: those of a known class (``GATE_RULES``) or any module named
    ``*Router`` with ``top_k``, ``num_experts`` and a ``weight`` (how transformers 5 writes them)."""
    return [m for m in model.modules() if type(m).__name__ in GATE_RULES or (
        type(m).__name__.endswith("Router") and hasattr(m, "top_k") and hasattr(m, "num_experts")
        and isinstance(getattr(m, "weight", None), torch.nn.Parameter))]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(find_routers(model))


def gates(router: torch.nn.Module, logits_ne: torch.Tensor, experts_nk: torch.Tensor,
          dtype: torch.dtype) -> torch.Tensor:
    """Gate weights [N, k] of ``experts_nk`` from the router's logits [N, E], as ``router``'s own forward
    computes them for its own top-k (``GATE_RULES``), differentiable through the logits."""
    rule = GATE_RULES.get(type(router).__name__)
    if rule is None:
        raise UnsupportedArchitecture(f"{type(router).__name__}: routing replay does not know how this router "
                                      f"computes its gate weights (known: {', '.join(GATE_RULES)})")
    if rule.softmax_first:
        chosen = torch.softmax(logits_ne.float(), dim=-1).gather(-1, experts_nk)
    else:
        chosen = torch.softmax(logits_ne.gather(-1, experts_nk).float(), dim=-1)
    normalize = getattr(router, rule.normalize) if isinstance(rule.normalize, str) else rule.normalize
    if normalize:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen.to(dtype)


class Routing:
    """A model's routers and what their hooks do on the next forwards (module docstring)."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.routers = routers
        self.num_layers = len(routers)
        self.top_k = int(routers[0].top_k)
        self.num_experts = int(routers[0].num_experts)
        if self.num_experts >= NO_ROUTE:
            raise UnsupportedArchitecture(f"{self.num_experts} experts: tidal stores routes as uint8 (< {NO_ROUTE})")
        self.sink: Callable[[int, torch.Tensor], None] | None = None
        """Called with (layer, expert ids [N, k]) for every router call: the engine's recorder."""
        self.plan: torch.Tensor | None = None
        """[N, layers, k] expert ids to use (``NO_ROUTE``: the model's own), N the flattened tokens of the forward."""
        self.replace = True
        """With a plan: use it (replay), or only compare with it (agreement without replay)."""
        self.count: torch.Tensor | None = None
        """With a plan: bool [N], the tokens whose choices count toward the agreement (None: every planned one)."""
        self.keep_logits = False
        self.logits: list[torch.Tensor | None] = [None] * self.num_layers
        """Each layer's router logits [N, E] of the last forward (``keep_logits``): the auxiliary losses read them."""
        self.chosen: list[torch.Tensor | None] = [None] * self.num_layers
        """Each layer's expert ids [N, k] that the last forward used (``keep_logits``)."""
        self.agree = torch.zeros(2, dtype=torch.float64)
        """[matching token-layer choices, compared ones], summed on the device since ``take_agreement``."""
        self.hooks = [r.register_forward_hook(_RouterHook(self, i)) for i, r in enumerate(routers)]

    @contextlib.contextmanager
    def recording(self, sink: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
        """Hand each router's chosen ids to ``sink(layer, ids_nk)`` during the block."""
        previous, self.sink = self.sink, sink
        try:
            yield
        finally:
            self.sink = previous

    def set_plan(self, plan_nlk: torch.Tensor | None, replace: bool = True,
                 count_n: torch.Tensor | None = None) -> None:
        """Replay (``replace``) or compare with ``plan_nlk`` [N, layers, k] on every forward until ``clear_plan``;
        ``count_n`` (bool [N]) limits which tokens count toward the agreement."""
        if plan_nlk is not None:
            assert plan_nlk.dim() == 3 and plan_nlk.shape[1:] == (self.num_layers, self.top_k), (
                f"a route plan is [tokens, {self.num_layers} layers, {self.top_k}], got {tuple(plan_nlk.shape)}")
        self.plan, self.replace, self.count = plan_nlk, replace, count_n

    def clear_plan(self) -> None:
        self.plan, self.replace, self.count = None, True, None

    @contextlib.contextmanager
    def planned(self, plan_nlk: torch.Tensor | None, replace: bool = True) -> Iterator[None]:
        """``set_plan`` for the block (forward and backward inside it, so a checkpoint's recompute replays too)."""
        self.set_plan(plan_nlk, replace)
        try:
            yield
        finally:
            self.clear_plan()

    def take_agreement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(matching, compared) token-layer choices since the last call, as device tensors (no sync)."""
        matched, compared = self.agree[0], self.agree[1]
        self.agree = torch.zeros_like(self.agree)
        return matched, compared

    def drop_logits(self) -> None:
        self.logits = [None] * self.num_layers
        self.chosen = [None] * self.num_layers

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


class _RouterHook:
    """One router's forward hook (an object, not a closure: ``copy.deepcopy`` of a model copies it with the
    ``Routing`` it points to, so an engine's copy gets hooks of its own)."""

    def __init__(self, routing: Routing, layer: int):
        self.routing, self.layer = routing, layer

    def __call__(self, module: torch.nn.Module, args, output):
        logits, weights, own = output
        r, layer = self.routing, self.layer
        if r.sink is not None:
            r.sink(layer, own)
        chosen = own
        if r.plan is not None:
            planned = r.plan[:, layer].to(own.device)
            assert planned.shape == own.shape, (f"route plan for {planned.shape[0]} tokens, forward of "
                                                f"{own.shape[0]} (the plan must follow the forward's layout)")
            known = planned[:, 0] != NO_ROUTE
            with torch.no_grad():
                counted = known if r.count is None else known & r.count.to(own.device)
                same = (planned.long().sort(-1).values == own.sort(-1).values).all(-1) & counted
                if r.agree.device != own.device:
                    r.agree = r.agree.to(own.device)
                r.agree += torch.stack([same.sum(), counted.sum()]).double()
            if r.replace:
                chosen = torch.where(known[:, None], planned.long(), own)
                weights = gates(module, logits, chosen, weights.dtype)
        if r.keep_logits:
            r.logits[layer], r.chosen[layer] = logits, chosen
        return logits, weights, chosen


def routing_of(model: torch.nn.Module) -> Routing | None:
    """The model's ``Routing`` (hooks installed on first use), or None for a dense model."""
    routing = getattr(model, "_tidal_routing", None)
    if routing is not None and routing.routers and routing.routers[0] in model.modules():
        return routing
    routers = find_routers(model)
    if not routers:
        return None
    routing = Routing(routers)
    object.__setattr__(model, "_tidal_routing", routing)  # not a submodule: a plain attribute
    return routing


# ---- auxiliary losses --------------------------------------------------------------------------------------
def load_balance_loss(logits: list[torch.Tensor], chosen: list[torch.Tensor], num_experts: int,
                      valid_n: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al., arXiv 2101.03961, eq. 4-6) for top-k routing,
    averaged over layers: ``E * sum_i f_i * P_i``, f_i the share of the tokens' k assignments that went to
    expert i and P_i the mean router probability of expert i, over ``valid_n`` tokens. 1.0 when routing is
    uniform. (transformers' ``load_balancing_loss_func`` counts f_i per token, not per assignment, so its
    value is k times this.)"""
    total = logits[0].new_zeros((), dtype=torch.float32)
    for logits_ne, chosen_nk in zip(logits, chosen):
        probs = torch.softmax(logits_ne.float(), dim=-1)
        w = probs.new_ones(len(probs)) if valid_n is None else valid_n.float()
        assigned = torch.zeros_like(probs).scatter_add_(1, chosen_nk, w[:, None].expand_as(chosen_nk).contiguous())
        f = assigned.sum(0) / (w.sum() * chosen_nk.shape[1]).clamp(min=1)
        p = (probs * w[:, None]).sum(0) / w.sum().clamp(min=1)
        total = total + num_experts * (f.detach() * p).sum()
    return total / len(logits)


def router_z_loss(logits: list[torch.Tensor], valid_n: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al., arXiv 2202.08906, eq. 5): the mean over tokens of
    ``logsumexp(router logits)^2``, averaged over layers; it keeps router logits small (stable in bf16)."""
    total = logits[0].new_zeros((), dtype=torch.float32)
    for logits_ne in logits:
        z2 = torch.logsumexp(logits_ne.float(), dim=-1) ** 2
        w = z2.new_ones(len(z2)) if valid_n is None else valid_n.float()
        total = total + (z2 * w).sum() / w.sum().clamp(min=1)
    return total / len(logits)


def expert_load(chosen: list[torch.Tensor], num_experts: int, valid_n: torch.Tensor | None = None) -> torch.Tensor:
    """Share of the k assignments each expert received, [E], averaged over layers (uniform: 1/E each)."""
    load = torch.zeros(num_experts, device=chosen[0].device)
    for chosen_nk in chosen:
        ids = chosen_nk if valid_n is None else chosen_nk[valid_n.bool()]
        load += torch.bincount(ids.reshape(-1), minlength=num_experts).float() / max(ids.numel(), 1)
    return load / len(chosen)


# ---- routes as data ---------------------------------------------------------------------------------------
def encode_routes(routes_tlk: torch.Tensor) -> dict:
    """A sample's routes for JSON (``samples.jsonl``): shape and base64 of the uint8 bytes (compact: a
    4k-token sample of a 48-layer top-8 model is 1.5 MB raw, as a list of numbers several times that)."""
    data = routes_tlk.to(ROUTE_DTYPE).contiguous().cpu()
    return {"shape": list(data.shape), "uint8_b64": base64.b64encode(data.numpy().tobytes()).decode()}


def decode_routes(blob: dict) -> torch.Tensor:
    raw = bytearray(base64.b64decode(blob["uint8_b64"]))
    return torch.frombuffer(raw, dtype=ROUTE_DTYPE).reshape(blob["shape"]) if raw else torch.zeros(
        blob["shape"], dtype=ROUTE_DTYPE)
