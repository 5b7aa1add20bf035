"""gspo_trl/models/moe/routing.py: the router adapters of each Mixture-of-Experts family, recording the selected
experts and
replaying given ones. The gate-weight formulas are checked against hand-derived values; recording then replaying a
forward's own routes is checked bit for bit against that forward; the replayed gate's gradient against a two-expert
layer differentiated by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_architectures import FAMILIES, build
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from gspo_trl.models.moe.routing import (
    RouteRecorder,
    moe_routers,
    routes_dtype,
    routing_replayed,
    sigmoid_weights,
    softmax_topk_weights,
    topk_softmax_weights,
)

MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "qwen2_moe"]
# Qwen2-MoE (shared expert beside the routed ones) is not in test_architectures' families: its config here.
QWEN2_MOE = {
    **FAMILIES["qwen3_moe"][1],
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
}


def moe_model(family: str):
    if family != "qwen2_moe":
        return build(family, "eager")
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2_moe", vocab_size=400, **QWEN2_MOE)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# --- the gate-weight formulas, by hand ------------------------------------------------------------------------

# logits log(1..4): softmax (0.1, 0.2, 0.3, 0.4); experts 3 and 1 selected.
LOGITS = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]])
EXPERTS = torch.tensor([[3, 1]])
FP32 = 1e-6  # a few float32 ulps of values of order one (softmax/sigmoid of exact logs, one division)


def test_softmax_topk_weights_are_the_probabilities_renormalised_where_the_family_does():
    assert torch.allclose(softmax_topk_weights(LOGITS, EXPERTS, normalize=False), torch.tensor([[0.4, 0.2]]), atol=FP32)
    assert torch.allclose(
        softmax_topk_weights(LOGITS, EXPERTS, normalize=True), torch.tensor([[2 / 3, 1 / 3]]), atol=FP32
    )


def test_topk_softmax_weights_are_a_softmax_over_the_selected_logits_only():
    # softmax over (log 4, log 2): 4/6 and 2/6, whatever the other experts' logits.
    assert torch.allclose(topk_softmax_weights(LOGITS, EXPERTS), torch.tensor([[2 / 3, 1 / 3]]), atol=FP32)


def test_sigmoid_weights_are_renormalised_then_scaled():
    logits = torch.tensor([[0.0, math.log(3), 5.0]])  # sigmoid: 1/2, 3/4, (unselected)
    experts = torch.tensor([[0, 1]])
    assert torch.allclose(sigmoid_weights(logits, experts, False, 1.0), torch.tensor([[0.5, 0.75]]), atol=FP32)
    # renormalised: 0.4, 0.6; times 2.5: 1.0, 1.5
    assert torch.allclose(sigmoid_weights(logits, experts, True, 2.5), torch.tensor([[1.0, 1.5]]), atol=FP32)


def test_routes_take_one_byte_up_to_128_experts():
    assert routes_dtype(4) == torch.int8 and routes_dtype(128) == torch.int8 and routes_dtype(129) == torch.int16


# --- a two-expert layer differentiated by hand ------------------------------------------------------------------


class TwoExpertLayer(nn.Module):
    """One token of hidden size 1, two constant experts y = (y0, y1): output Σ_k gate_k · y[expert_k]."""

    def __init__(self, norm_topk_prob: bool, expert_values=(2.0, 5.0)):
        super().__init__()
        config = SimpleNamespace(num_experts_per_tok=1, num_experts=2, norm_topk_prob=norm_topk_prob, hidden_size=1)
        self.gate = Qwen3MoeTopKRouter(config)
        with torch.no_grad():
            self.gate.weight.copy_(torch.tensor([[0.0], [math.log(3)]]))  # logits (0, log 3): p = (1/4, 3/4)
        self.register_buffer("values", torch.tensor(expert_values))

    def forward(self, x):
        _, gates, experts = self.gate(x)
        return (gates * self.values[experts]).sum()


def test_a_replayed_expert_keeps_the_gradient_of_its_gate_weight():
    layer = TwoExpertLayer(norm_topk_prob=False)
    x = torch.ones(1, 1)
    own = layer(x)  # the router's own choice: expert 1, output p1 · y1 = 3/4 · 5
    assert own.item() == pytest.approx(3.75, abs=FP32)
    layer.zero_grad()
    with routing_replayed(layer, torch.tensor([[[0]]])):  # (N=1, L=1, k=1): expert 0 instead
        out = layer(x)
    out.backward()
    # out = p0 · y0 = σ(l0 - l1) · 2 = 1/4 · 2; d out / d(l0, l1) = y0 · p0 · p1 · (1, -1) = 2 · 3/16 · (1, -1),
    # and d l / d weight = x = 1.
    assert out.item() == pytest.approx(0.5, abs=FP32)
    assert torch.allclose(layer.gate.weight.grad, torch.tensor([[0.375], [-0.375]]), atol=FP32)


def test_a_renormalised_single_expert_has_gate_one_and_no_router_gradient():
    # norm_topk_prob with k = 1: the one weight is p_e / p_e = 1 whatever the logits, so the router learns nothing
    # from this layer's output (the load-balancing loss is then its only signal).
    layer = TwoExpertLayer(norm_topk_prob=True)
    with routing_replayed(layer, torch.tensor([[[0]]])):
        out = layer(torch.ones(1, 1))
    out.backward()
    assert out.item() == pytest.approx(2.0, abs=FP32)
    assert torch.allclose(layer.gate.weight.grad, torch.zeros(2, 1), atol=FP32)


def test_the_router_forward_is_restored_after_the_context_even_on_an_error():
    layer = TwoExpertLayer(norm_topk_prob=False)
    with pytest.raises(RuntimeError, match="inside"):
        with routing_replayed(layer, torch.tensor([[[0]]])):
            assert "forward" in layer.gate.__dict__
            raise RuntimeError("inside")
    assert "forward" not in layer.gate.__dict__
    assert layer(torch.ones(1, 1)).item() == pytest.approx(3.75, abs=FP32)  # its own choice again
    with RouteRecorder(layer).recording():
        pass
    assert "forward" not in layer.gate.__dict__


def test_replayed_routes_of_another_token_count_are_refused():
    layer = TwoExpertLayer(norm_topk_prob=False)
    with pytest.raises(ValueError, match="routes 1 tokens, the replayed routes hold 2"):
        with routing_replayed(layer, torch.tensor([[[0]], [[1]]])):
            layer(torch.ones(1, 1))


# --- each family's real router ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_a_forwards_own_routes_gives_that_forward_bit_for_bit(family):
    model = moe_model(family)
    torch.manual_seed(1)
    input_ids = torch.randint(5, 300, (3, 7))
    recorder = RouteRecorder(model)
    with torch.no_grad():
        with recorder.recording():
            expected = model(input_ids=input_ids).logits
        routes = recorder.take()  # (N, L, k)
        routed_layers = 1 if family == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense here
        assert routes.shape == (3 * 7, routed_layers, 2) and routes.dtype == torch.int8
        assert int(routes.min()) >= 0 and int(routes.max()) < 4
        with routing_replayed(model, routes.view(3, 7, routed_layers, 2), recorder):
            replayed = model(input_ids=input_ids).logits
        own = recorder.take()
    assert torch.equal(replayed, expected)
    assert torch.equal(own, routes)  # the router's own choice is still recorded under replay


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replayed_experts_are_the_given_ones_with_their_recomputed_gate_weights(family):
    model = moe_model(family)
    routers = moe_routers(model)
    seen = []
    hooks = [router.register_forward_hook(lambda module, args, outputs: seen.append(outputs)) for router in routers]
    input_ids = torch.randint(5, 300, (2, 5), generator=torch.Generator().manual_seed(2))
    routes = torch.zeros(2 * 5, len(routers), 2, dtype=torch.int8)
    routes[..., 0], routes[..., 1] = 3, 1  # every token to experts 3 and 1, in that order
    try:
        with torch.no_grad(), routing_replayed(model, routes):
            model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == len(routers)
    for router, (logits, gates, experts) in zip(routers, seen):
        assert experts.tolist() == [[3, 1]] * 10
        logits = logits.float()
        if family == "gpt_oss":
            expected = torch.softmax(logits[:, [3, 1]], dim=-1)
        elif family == "deepseek_v3":
            chosen = logits.sigmoid()[:, [3, 1]]
            expected = chosen / chosen.sum(-1, keepdim=True) * router.routed_scaling_factor
        else:
            chosen = logits.softmax(-1)[:, [3, 1]]
            renormalised = family == "mixtral" or router.norm_topk_prob
            expected = chosen / chosen.sum(-1, keepdim=True) if renormalised else chosen
        assert torch.allclose(gates.float(), expected, atol=FP32), family


def granite_moe():
    """A tiny Granite-MoE: a Mixture-of-Experts family without an adapter."""
    config = AutoConfig.for_model(
        "granitemoe", vocab_size=400, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


def test_a_moe_router_without_an_adapter_is_refused_naming_the_model():
    with pytest.raises(ValueError, match="GraniteMoeForCausalLM is a Mixture-of-Experts model whose router"):
        moe_routers(granite_moe())


def test_a_dense_model_has_no_routers():
    assert moe_routers(build("llama", "eager")) == []
