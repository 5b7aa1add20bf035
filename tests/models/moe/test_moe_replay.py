"""gspo_trl/models/moe/replay.py with the HF backend and the trainer: the routes the decoding loop records, replaying
them in
the training forward (routing_replay='rollout'), the routing metrics, and routing_replay='none' training bit for bit
as it did before routes were recorded.

Log-prob comparisons use float32 and the tolerance of tests/test_architectures.py (1e-5): the decoding loop and the
training forward sum the same products in another order (KV cache against one padded forward), a few ulps of values
of order one; a token routed to other experts than the sampler's moves its log-prob by 1e-3 or more here."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import count_digits, small_config, text_dataset
from test_architectures import PROMPTS, TEMPERATURE, build, tokenizer
from transformers import LogitsProcessorList

import gspo_trl.models.moe.replay as replay_module
import gspo_trl.rollout.hf as hf_module
from gspo_trl import GSPOTrainer
from gspo_trl.models.moe.replay import RoutingReplay, rollout_routes
from gspo_trl.models.moe.routing import moe_routers
from gspo_trl.rollout import HFGenerateBackend, stream_keys
from gspo_trl.training.logprobs import completion_logprobs
from gspo_trl.training.micro_batch import MicroBatch

MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"]
TOLERANCE = 1e-5  # float32 rounding in another summation order (module docstring)
MAX_NEW_TOKENS = 10


def sample(model, tmp_path, routing_replay: str) -> MicroBatch:
    """A rollout of `PROMPTS` by the HF backend's decoding loop, EOS favoured so that rows end at different steps
    (rows leave the batch), as the micro-batch scoring makes of it."""
    tok = tokenizer()
    args = small_config(
        tmp_path, routing_replay=routing_replay, temperature=TEMPERATURE, max_completion_length=MAX_NEW_TOKENS
    )
    backend = HFGenerateBackend(lambda: model, tok, args)

    def favour_eos(ids, scores):
        return scores + 3.0 * (torch.arange(scores.shape[-1]) == tok.eos_token_id)

    backend.processors = LogitsProcessorList([favour_eos, *backend.processors])
    rollout = backend.generate(PROMPTS, stream_keys(11, torch.arange(len(PROMPTS))))
    lengths = rollout.completion_mask.sum(1)
    assert lengths.min() < lengths.max(), "rows should end at different steps"
    return MicroBatch(
        **rollout.model_inputs(),
        sampling_logps=rollout.sampling_logps,
        sampled_by_policy=True,
        sampling_routes=rollout.sampling_routes,
    )


def training_scores(model, batch: MicroBatch, routing_replay: str):
    """(the per-token log-probs of a training forward on `batch`, the routing metrics it logged)."""
    metrics = {}
    routing = RoutingReplay(routing_replay, model).training(batch, metrics.__setitem__)
    scores = completion_logprobs(model, *batch.model_inputs(), temperature=TEMPERATURE, routing=routing)
    return scores.logps, metrics


def routed_layers(model) -> int:
    return len(moe_routers(model))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_the_rollouts_routes_scores_the_sampled_tokens_as_the_loop_did(family, tmp_path):
    model = build(family, "eager")
    batch = sample(model, tmp_path, "rollout")
    routes, prompt_width = batch.sampling_routes, batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    assert routes.shape == (*batch.input_ids.shape, routed_layers(model), 2) and routes.dtype == torch.int8
    assert (routes[:, :prompt_width] >= 0).all(), "the loop's prefill records every prompt position"
    for row, length in enumerate(batch.completion_mask.sum(1).tolist()):
        # the positions that sampled the row's tokens are recorded; the last sampled token and the padding are not
        assert (routes[row, prompt_width - 1 : prompt_width - 1 + length] >= 0).all()
        assert (routes[row, prompt_width - 1 + length :] == -1).all()
    logps, metrics = training_scores(model, batch, "rollout")
    mask = batch.completion_mask.bool()
    assert float((logps - batch.sampling_logps)[mask].abs().max()) <= TOLERANCE
    assert metrics["moe/route_mismatch"] == 0.0
    assert 1.0 <= metrics["moe/load_imbalance"] <= metrics["moe/load_imbalance_max"] <= 2.0  # at most E/k = 4/2


def test_without_replay_only_the_sampled_tokens_positions_are_recorded(tmp_path):
    # routing_replay='none': the prompts are prefilled as usual (shared prompts once), and only the forwards of the
    # decoding steps record, which is what the mismatch metric compares.
    model = build("qwen3_moe", "eager")
    batch = sample(model, tmp_path, "none")
    prompt_width = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    assert (batch.sampling_routes[:, : prompt_width - 1] == -1).all()
    assert (batch.sampling_routes[:, prompt_width - 1] >= 0).all()
    logps, metrics = training_scores(model, batch, "none")
    assert metrics["moe/route_mismatch"] == 0.0
    assert float((logps - batch.sampling_logps)[batch.completion_mask.bool()].abs().max()) <= TOLERANCE


def test_a_moe_model_decodes_with_the_dynamic_loop_where_cuda_graphs_would_run(tmp_path, monkeypatch):
    # On a GPU the static loop (CUDA graphs) records no routes, and its capture fails for the experts' dispatch; a
    # MoE model decodes with the dynamic loop there so that the routing metrics have the sampler's routes. Forced on
    # CPU here; a dense model still takes the static loop.
    monkeypatch.setattr(HFGenerateBackend, "_uses_static_loop", lambda self, device: self.cuda_graphs)
    args = small_config(tmp_path, temperature=TEMPERATURE, max_completion_length=4)
    keys = stream_keys(11, torch.arange(len(PROMPTS)))
    moe = HFGenerateBackend(lambda: build("qwen3_moe", "eager"), tokenizer(), args).generate(PROMPTS, keys)
    assert moe.decoding_loop == "dynamic" and moe.sampling_routes is not None
    dense = HFGenerateBackend(lambda: build("llama", "eager"), tokenizer(), args).generate(PROMPTS, keys)
    assert dense.decoding_loop == "static" and dense.sampling_routes is None


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_perturbed_router_shows_as_route_mismatch_and_replay_keeps_the_sampled_experts(family, tmp_path):
    model = build(family, "eager")
    batch = sample(model, tmp_path, "rollout")
    last = moe_routers(model)[-1]
    with torch.no_grad():
        last.weight.add_(torch.randn(last.weight.shape, generator=torch.Generator().manual_seed(5)))
    own_logps, own_metrics = training_scores(model, batch, "none")
    replayed_logps, replayed_metrics = training_scores(model, batch, "rollout")
    # Only the last router changed: the first layer routes every token as the sampler did (same weights, same
    # inputs up to float rounding), the last one differs on some.
    assert own_metrics["moe/route_mismatch/layer_0"] == 0.0
    assert own_metrics["moe/route_mismatch/layer_1"] > 0.0
    assert own_metrics["moe/route_mismatch"] == own_metrics["moe/route_mismatch/layer_1"]
    # Under replay the metric is the router's own choice against the sampler's: the same drift ...
    assert replayed_metrics["moe/route_mismatch"] == own_metrics["moe/route_mismatch"]
    # ... while the experts used are the sampler's: only the gate weights of the changed router move the log-probs.
    mask = batch.completion_mask.bool()
    assert float((replayed_logps - own_logps)[mask].abs().max()) > 1e-3


def test_the_replayed_gate_weights_carry_the_router_gradient(tmp_path):
    model = build("qwen3_moe", "eager")
    batch = sample(model, tmp_path, "rollout")
    logps, _ = training_scores(model, batch, "rollout")
    (logps * batch.completion_mask).sum().backward()
    for router in moe_routers(model):
        assert router.weight.grad is not None and float(router.weight.grad.abs().max()) > 0.0
    model.zero_grad()


def test_rollout_routes_put_each_steps_experts_one_position_before_its_token():
    steps = torch.arange(2 * 3).view(2, 3, 1, 1).to(torch.int8)  # (N=2, C=3, L=1, k=1)
    routes = rollout_routes(None, steps, prompt_width=2)
    # positions: prompt 0, 1 | completion 2, 3, 4; token t is sampled by the forward of position 1 + t
    assert routes[..., 0, 0].tolist() == [[-1, 0, 1, 2, -1], [-1, 3, 4, 5, -1]]
    prompt = torch.full((2, 2, 1, 1), 7, dtype=torch.int8)
    assert rollout_routes(prompt, steps, prompt_width=2)[..., 0, 0].tolist() == [[7, 0, 1, 2, -1], [7, 3, 4, 5, -1]]


# --- the trainer ----------------------------------------------------------------------------------------------


def train(family: str, tmp_path, **overrides):
    model = build(family, None)
    trainer = GSPOTrainer(
        model=model,
        reward_funcs=count_digits,
        args=small_config(tmp_path, **overrides),
        train_dataset=text_dataset(),
        processing_class=tokenizer(),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return model, logs


@pytest.mark.slow
def test_routing_replay_none_trains_bit_for_bit_as_without_recording_routes(tmp_path, monkeypatch):
    # The routes recorded for the metrics only read the routers' outputs: switching recording off everywhere (what
    # gspo-trl did before) gives the same weights, bit for bit.
    recorded_model, recorded_logs = train("qwen3_moe", tmp_path / "recorded", num_iterations=2)
    assert "moe/route_mismatch" in recorded_logs[0]
    monkeypatch.setattr(hf_module, "route_recorder_for", lambda model: None)
    monkeypatch.setattr(replay_module, "route_recorder_for", lambda model: None)
    plain_model, plain_logs = train("qwen3_moe", tmp_path / "plain", num_iterations=2)
    assert "moe/route_mismatch" not in plain_logs[0]
    assert [entry["loss"] for entry in recorded_logs] == [entry["loss"] for entry in plain_logs]
    for (name, recorded), plain in zip(recorded_model.named_parameters(), plain_model.parameters()):
        assert torch.equal(recorded, plain), name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_routing_replay_rollout_trains_under_bf16_with_pi_old_and_reference_forwards(family, tmp_path):
    # bf16 autocast: π_old comes from a forward pass (num_iterations=2), which replays the routes like the
    # reference's (beta > 0) and the training forwards.
    _, logs = train(family, tmp_path, routing_replay="rollout", bf16=True, num_iterations=2, beta=0.04)
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert all(0.0 <= entry["moe/route_mismatch"] <= 1.0 for entry in logs)


def test_routing_replay_is_refused_for_a_dense_model_and_an_unsupported_router(tmp_path):
    with pytest.raises(ValueError, match="LlamaForCausalLM is not a Mixture-of-Experts model"):
        GSPOTrainer(
            model=build("llama", None),
            reward_funcs=count_digits,
            args=small_config(tmp_path, routing_replay="rollout"),
            train_dataset=text_dataset(),
            processing_class=tokenizer(),
        )
    from test_moe_routing import granite_moe

    with pytest.raises(ValueError, match="GraniteMoeForCausalLM is a Mixture-of-Experts model whose router"):
        RoutingReplay("rollout", granite_moe())
    assert RoutingReplay("none", granite_moe()).recorder is None  # no replay asked: no routes, no error


def test_a_rollout_without_routes_is_refused_when_replay_is_on():
    batch = MicroBatch(
        input_ids=torch.zeros(1, 3, dtype=torch.long),
        attention_mask=torch.ones(1, 3),
        completion_ids=torch.zeros(1, 1, dtype=torch.long),
        completion_mask=torch.ones(1, 1),
    )
    with pytest.raises(ValueError, match="routing_replay='rollout' needs the experts the decoding loop chose"):
        RoutingReplay("rollout", build("qwen3_moe", "eager")).without_grad(batch)


@pytest.mark.slow  # torchrun launch
def test_routes_are_gathered_with_their_rows_on_two_processes(tmp_path):
    # Each process samples its rows; the rollout is gathered, padded to the widest prompt and completion, and cut
    # again. Routes that moved against their tokens would show at the first step, whose weights are the sampling
    # ones: as a mismatch, or as importance ratios away from 1 (π_old is the decoding loop's log-probs; float32
    # rounding moves a sequence ratio by about 1e-6, a token routed to other experts by 1e-3 or more).
    import json
    import subprocess
    import sys
    from pathlib import Path

    from helpers import worker_env

    model_dir = tmp_path / "model"
    build("qwen3_moe", None).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    result = tmp_path / "result.json"
    worker = Path(__file__).parents[2] / "moe_worker.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    completed = subprocess.run(
        [*command, str(worker), str(model_dir), str(result)],
        capture_output=True,
        text=True,
        timeout=300,
        env=worker_env(),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    runs = json.loads(result.read_text())
    assert runs["world_size"] == 2
    for rank, metrics in enumerate(runs["metrics"]):
        mismatches = [value for name, value in metrics if name == "moe/route_mismatch"]
        assert len(mismatches) == 2, (rank, metrics)  # one per optimizer step (one micro-step each)
        assert mismatches[0] == 0.0, (rank, metrics)
    assert runs["ratios"][0] == pytest.approx((1.0, 1.0), abs=1e-5)
    assert runs["aligned"] == [[True] * len(runs["aligned"][0])] * 2 and runs["aligned"][0]


@pytest.mark.slow
def test_routing_replay_rollout_trains_a_micro_batch_in_several_passes(tmp_path, monkeypatch):
    # DeepSeek-V3 has no load-balancing loss, so a micro-batch of 4 rows (about 25 positions each) is cut into
    # passes by max_tokens_per_pass; each pass replays its rows' routes, cut like its input_ids.
    import gspo_trl.trainer as trainer_module

    taken, original = [], trainer_module.take_pass
    monkeypatch.setattr(trainer_module, "take_pass", lambda *args: taken.append(1) or original(*args))
    _, logs = train("deepseek_v3", tmp_path, routing_replay="rollout", max_tokens_per_pass=40)
    assert len(taken) >= 4  # at least two passes per micro-step
    assert all(math.isfinite(entry["loss"]) for entry in logs)
    assert logs[0]["moe/route_mismatch"] == 0.0  # the first step's weights sampled the rollout


# --- routing_replay="old" -------------------------------------------------------------------------------------


def test_the_pi_old_pass_records_old_routes_and_training_forwards_replay_them(tmp_path):
    import contextlib

    from gspo_trl.training.logprobs import logprobs_without_grad

    model = build("qwen3_moe", "eager")
    batch = sample(model, tmp_path, "old")
    batch.old_logps = batch.sampling_logps.clone()  # as if a π_old pass were needed (weights about to move)
    routing = RoutingReplay("old", model)
    assert routing.without_grad(batch) is None  # outside a π_old pass (the reference's): no replay, no recording

    def score(model, batch):
        return logprobs_without_grad(
            model, batch, 2, contextlib.nullcontext, routing=routing.without_grad(batch), temperature=0.8
        )

    routing.old_pass(score, model, batch)
    # Two rows per forward, laid out as the batch: the π_old pass routes every token the sampler ran to its experts
    # (same weights, float32). Padding positions attend to nothing and route anyhow: not compared.
    assert batch.old_routes.shape == batch.sampling_routes.shape
    tokens = batch.attention_mask.bool() & (batch.sampling_routes >= 0).all(-1).all(-1)  # (B, P + C)
    assert int(tokens.sum()) > batch.rows * 5
    assert torch.equal(batch.old_routes[tokens].sort(-1).values, batch.sampling_routes[tokens].sort(-1).values)
    last = moe_routers(model)[-1]
    with torch.no_grad():
        last.weight.add_(torch.randn(last.weight.shape, generator=torch.Generator().manual_seed(5)))
    used = []
    hook = last.register_forward_hook(lambda module, args, outputs: used.append(outputs[2]))
    try:
        training_scores(model, batch, "old")
        training_scores(model, batch, "none")
    finally:
        hook.remove()
    old_experts = batch.old_routes[:, :, -1].reshape(-1, 2).long()
    assert torch.equal(used[0], old_experts)  # replayed: π_old's experts at every position
    assert not torch.equal(used[1], old_experts)  # the perturbed router's own choice differs somewhere


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True])
def test_routing_replay_old_trains_with_pi_old_from_a_pass_or_from_the_decoding_loop(bf16, tmp_path):
    # float32: π_old is the decoding loop's log-probs, and the sampler's routes are replayed; bf16: the π_old pass
    # runs and records old_routes.
    model = build("olmoe", None)
    trainer = GSPOTrainer(
        model=model,
        reward_funcs=count_digits,
        args=small_config(tmp_path, routing_replay="old", bf16=bf16, num_iterations=2),
        train_dataset=text_dataset(),
        processing_class=tokenizer(),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert all((batch.old_routes is not None) == bf16 for batch in trainer.schedule.micro_batches)
