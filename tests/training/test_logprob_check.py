"""gspo_trl.training.logprob_check: on the first rollout, the log-probs of the path training scores with and of the
decoding
loop agree with a plain forward of each row alone on the fixed paths, and a deliberately broken path (positions
shifted, the static loop's old boolean mask under eager attention) raises, or with "warn" falls back and trains."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_gpt2
from datasets import Dataset
from helpers import count_digits, small_config, text_dataset
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.models.precision import cast_lm_head_to_fp32
from gspo_trl.rollout import HFGenerateBackend, completion_mask_from_eos
from gspo_trl.rollout.decoding import dynamic, static
from gspo_trl.rollout.decoding.prefix_sharing import prefill_shared_prompts
from gspo_trl.training import logprobs
from gspo_trl.training.logprob_check import (
    FLOAT32,
    HALF_PRECISION,
    check_first_rollout,
    checked_rows,
    compare,
    tolerance_in_use,
)
from gspo_trl.training.micro_batch import MicroBatch

PROMPTS = ["What is 2 + 3?"] * 3 + ["Hi"] * 3 + ["Solve: 7 - 4 = 3. Reply with just the number."] * 3
TEMPERATURE = 0.9


def rollout_inputs(model, tokenizer, loop: str = "dynamic") -> MicroBatch:
    """A rollout as the trainer hands it to the check: left-padded prompts, completions, the loop's log-probs."""
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = encoded.input_ids, encoded.attention_mask
    eos = tokenizer.eos_token_id
    kwargs = dict(
        max_new_tokens=10,
        eos_token_ids=[eos],
        pad_token_id=tokenizer.pad_token_id,
        processors=LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE)]),
        logp_temperature=TEMPERATURE,
    )
    torch.manual_seed(0)
    if loop == "static":
        decoded = static.sample(model, ids, mask, graphs=False, window_block=4, **kwargs)
    else:
        decoded = dynamic.sample(model, ids, mask, cache=prefill_shared_prompts(model, ids, mask), **kwargs)
    completion_mask, _ = completion_mask_from_eos(decoded.completion_ids, [eos])
    return MicroBatch(
        input_ids=torch.cat([ids, decoded.completion_ids], dim=1),
        attention_mask=torch.cat([mask, completion_mask], dim=1),
        completion_ids=decoded.completion_ids,
        completion_mask=completion_mask,
        sampling_logps=decoded.logps,
        sampled_by_policy=True,
    )


def check(model, inputs, option="raise", padding_free=False, loop="dynamic", backends=()):
    args = SimpleNamespace(check_logprobs=option, temperature=TEMPERATURE, logprob_chunk_size=1024)
    return check_first_rollout(
        model, inputs, args, padding_free=padding_free, decoding_loop=loop, backends=list(backends)
    )


def shift_padded_positions(monkeypatch, by: int = 3):
    """Padded rows scored at positions `by` past those they were sampled with (learned positions notice)."""
    positions = logprobs.positions_from_mask
    monkeypatch.setattr(logprobs, "positions_from_mask", lambda mask: positions(mask) + by)


def old_boolean_mask(monkeypatch):
    """The static loop as it was: a boolean mask, which eager attention adds to its scores as 1s and 0s."""
    init = static.StaticDecoder.__init__

    def with_boolean_mask(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.mask = self.mask == static.ATTENDED

    monkeypatch.setattr(static.StaticDecoder, "__init__", with_boolean_mask)
    monkeypatch.setattr(static, "ATTENDED", True)


class RecordingBackend:
    def __init__(self):
        self.avoided = []

    def avoid_loop(self, loop):
        self.avoided.append(loop)


def test_checked_rows_are_the_most_padded_scored_rows_groups_together():
    attention = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 0]])
    completion_mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [0, 0]])  # row 4 scores nothing
    assert checked_rows(attention, completion_mask, count=4).tolist() == [0, 1, 3, 2]
    assert checked_rows(attention, completion_mask, count=9).tolist() == [0, 1, 3, 2, 4]  # a fixed count


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_fixed_paths_agree(tiny_model, tiny_tokenizer, family, attention):
    model = tiny_model if family == "llama" else build_tiny_gpt2(tiny_tokenizer)
    model.set_attn_implementation(attention)
    backend = RecordingBackend()
    for loop in ("static", "dynamic"):
        inputs = rollout_inputs(model.eval(), tiny_tokenizer, loop)  # sampled in eval mode, as the backend does
        model.train()  # training mode, as the trainer calls the check (which runs in eval mode: no dropout)
        for padding_free in (False, True):
            assert check(model, inputs, padding_free=padding_free, loop=loop, backends=[backend]) is padding_free
        assert inputs.sampling_logps is not None and backend.avoided == []
    assert model.training  # put back


def test_shifted_positions_raise_naming_the_family_the_path_and_the_error(tiny_tokenizer, monkeypatch):
    model = build_tiny_gpt2(tiny_tokenizer).eval()
    inputs = rollout_inputs(model, tiny_tokenizer)
    shift_padded_positions(monkeypatch)
    with pytest.raises(ValueError, match="padded rows") as raised:
        check(model, inputs, option="warn")  # padded rows are the safe path: nothing to fall back to
    message = str(raised.value)
    assert "model_type='gpt2'" in message and "attn_implementation='sdpa'" in message
    error = float(message.split("by up to ")[1].split(" nats")[0])
    assert error > 10 * FLOAT32.atol and "float32" in message
    assert check(model, inputs, option="off") is False  # off: nothing checked


def test_the_static_loops_old_boolean_mask_under_eager_attention_is_found(tiny_model, tiny_tokenizer, monkeypatch):
    tiny_model.set_attn_implementation("eager")
    old_boolean_mask(monkeypatch)
    inputs = rollout_inputs(tiny_model, tiny_tokenizer, "static")
    with pytest.raises(ValueError, match="static decoding loop.*model_type='llama', attn_implementation='eager'"):
        check(tiny_model, inputs, loop="static")
    backend = RecordingBackend()
    assert check(tiny_model, inputs, option="warn", loop="static", backends=[backend]) is False
    assert backend.avoided == ["static"] and inputs.sampling_logps is None  # π_old gets a forward


def test_a_dynamic_loops_disagreement_falls_back_to_generate(tiny_model, tiny_tokenizer, tmp_path):
    inputs = rollout_inputs(tiny_model, tiny_tokenizer)
    inputs.sampling_logps = inputs.sampling_logps - 0.01 * inputs.completion_mask
    with pytest.raises(ValueError, match="dynamic decoding loop differ"):
        check(tiny_model, inputs)
    backend = HFGenerateBackend(lambda: tiny_model, tiny_tokenizer, small_config(tmp_path))
    assert backend.use_decode_loop and backend.logp_temperature is not None
    assert check(tiny_model, inputs, option="warn", padding_free=True, backends=[backend]) is True  # rows are right
    assert not backend.use_decode_loop and backend.logp_temperature is None  # generate, which records nothing
    assert inputs.sampling_logps is None


def test_the_tolerance_follows_the_precision(tiny_model):
    assert tolerance_in_use(tiny_model) is FLOAT32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert tolerance_in_use(tiny_model) is HALF_PRECISION
    assert tolerance_in_use(tiny_model.to(torch.bfloat16)) is HALF_PRECISION


def test_in_half_precision_a_rows_mean_decides_and_in_float32_every_token_does():
    reference = torch.full((2, 40), -3.0)  # log p of 40 completion tokens in each of 2 rows
    mask = torch.ones(2, 40, dtype=torch.bool)
    one_token_off = reference.clone()
    one_token_off[0, 5] -= 0.9  # rounding on one unlucky token of a correct layout: 0.0225 on the row's mean
    every_token_off = reference - 0.2  # a layout error shifts a whole row
    assert compare("padded rows", one_token_off, reference, mask, HALF_PRECISION).agrees
    assert compare("padded rows", one_token_off, reference, mask, HALF_PRECISION).tokens_off == 1  # reported
    assert not compare("padded rows", every_token_off, reference, mask, HALF_PRECISION).agrees
    assert not compare("padded rows", one_token_off, reference, mask, FLOAT32).agrees
    assert compare("padded rows", reference + 1e-5, reference, mask, FLOAT32).agrees


def test_bf16_layers_beside_a_tied_float32_head_take_the_half_precision_tolerance(tiny_tokenizer):
    # cast_lm_head_to_fp32 on a tied model makes its first parameter, the input embedding, float32: its layers still
    # compute in bf16, and their padded rows (0.02 nats from a plain forward here) raised under float32's bounds.
    model = build_tiny_gpt2(tiny_tokenizer).to(torch.bfloat16).eval()
    cast_lm_head_to_fp32(model)
    assert next(model.parameters()).dtype == torch.float32 and tolerance_in_use(model) is HALF_PRECISION
    assert check(model, rollout_inputs(model, tiny_tokenizer)) is False


def test_config_validates_the_option(tmp_path):
    with pytest.raises(ValueError, match="check_logprobs must be one of"):
        GSPOConfig(output_dir=str(tmp_path), check_logprobs="maybe")


def gpt2_trainer(tmp_path, tokenizer, **overrides):
    prompts = Dataset.from_dict({"prompt": [PROMPTS[0], PROMPTS[3], PROMPTS[6], "Numbers 0 1 2 3"] * 2})  # padded
    config = small_config(tmp_path / "out", **overrides)
    return GSPOTrainer(
        build_tiny_gpt2(tokenizer), count_digits, args=config, train_dataset=prompts, processing_class=tokenizer
    )


def test_warn_falls_back_from_broken_packed_rows_to_padded_rows_and_trains(
    tmp_path, tiny_tokenizer, monkeypatch, caplog
):
    pack = logprobs.pack_shared_prefix

    def shifted_pack(*args, **kwargs):
        packed = pack(*args, **kwargs)
        packed.position_ids += 3
        return packed

    monkeypatch.setattr(logprobs, "pack_shared_prefix", shifted_pack)
    trainer = gpt2_trainer(tmp_path, tiny_tokenizer, padding_free=True, check_logprobs="warn")
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "packed rows differ" in caplog.text and "Falling back to padded rows" in caplog.text
    assert not trainer.padding_free
    assert all(math.isfinite(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry)
    trainer = gpt2_trainer(tmp_path, tiny_tokenizer, padding_free=True)  # the default, "raise"
    with pytest.raises(ValueError, match="packed rows differ.*model_type='gpt2'"):
        trainer.train()


def test_warn_falls_back_from_a_broken_static_loop_to_the_dynamic_one(tmp_path, tiny_model_dir, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(HFGenerateBackend, "_uses_static_loop", lambda self, device: self.cuda_graphs)  # on CPU too
    old_boolean_mask(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    config = small_config(tmp_path / "out", check_logprobs="warn", steps_per_generation=1)  # a rollout per step
    trainer = GSPOTrainer(model, count_digits, args=config, train_dataset=text_dataset())
    with caplog.at_level("WARNING"):
        trainer.train()
    assert "static decoding loop differ" in caplog.text and "Decoding without the static KV cache" in caplog.text
    assert trainer.rollout_backend.cuda_graphs is False  # the second rollout was sampled by the dynamic loop


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_gpt2_trains_in_bf16_with_the_check_on(tmp_path, tiny_tokenizer, padding_free, caplog):
    # bf16 autocast rounds the plain forward and the training path apart: within the half-precision tolerance.
    trainer = gpt2_trainer(tmp_path, tiny_tokenizer, bf16=True, padding_free=padding_free)
    with caplog.at_level("INFO", logger="gspo_trl.training.logprob_check"):
        trainer.train()
    assert f"{'packed' if padding_free else 'padded'} rows agree with a plain forward" in caplog.text  # it ran
    assert trainer.padding_free is padding_free
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_the_check_leaves_the_training_trajectory_unchanged(tmp_path, tiny_tokenizer, caplog):
    # Dropout on and a rollout per step: a check that drew from the global random state or left the model in eval mode
    # would change the second rollout's draws or the dropout masks, and the two runs would part.
    def trained(option: str):
        trainer = gpt2_trainer(
            tmp_path / option, tiny_tokenizer, check_logprobs=option, disable_dropout=False, steps_per_generation=1
        )
        with caplog.at_level("INFO", logger="gspo_trl.training.logprob_check"):
            trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, [parameter.detach().clone() for parameter in trainer.model.parameters()]

    losses_off, weights_off = trained("off")
    assert "agree with a plain forward" not in caplog.text
    losses_checked, weights_checked = trained("raise")
    assert "rows agree with a plain forward" in caplog.text  # it ran
    assert len(losses_off) == 2 and losses_checked == losses_off
    assert all(torch.equal(checked, off) for checked, off in zip(weights_checked, weights_off))


def test_a_rollout_sampled_ahead_by_older_weights_checks_the_scoring_path_only(tmp_path, tiny_model_dir, caplog):
    # Resumed inside a rollout, async rollouts sample the next one ahead, by the checkpoint's weights: the first rollout
    # this process checks holds the log-probs of weights trained past since (0.16 nats off at lr 1e-3), not a broken
    # loop's, and "raise" failed the resumed run.
    args = small_config(
        tmp_path / "out", max_steps=3, steps_per_generation=2, async_rollouts=True, save_strategy="steps", save_steps=1
    )
    GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset()).train()
    resumed = GSPOTrainer(tiny_model_dir, count_digits, args=args, train_dataset=text_dataset())
    with caplog.at_level("INFO", logger="gspo_trl.training.logprob_check"):
        resumed.train(resume_from_checkpoint=f"{args.output_dir}/checkpoint-1")
    staleness = {entry["step"]: entry["rollout/staleness"] for entry in resumed.state.log_history if "loss" in entry}
    assert staleness[3] == 1  # step 3 trained on the rollout sampled ahead at step 1, the first one checked
    assert "rows agree with a plain forward" in caplog.text and "decoding loop agree" not in caplog.text
    assert resumed.rollout_backend.use_decode_loop  # no fallback either
