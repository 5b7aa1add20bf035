"""The transformers families gspo-trl trains, each as a tiny random-init model: its completion log-probs on the
padded and packed layouts, those each decoding loop records while sampling and those `generate` samples from, all
against a forward of each row alone (no padding, no cache, no position ids); and two training steps. Where a path
cannot serve a family, the test asserts the reason gspo-trl gives and the path it falls back to.
docs/architectures.md is the table of what each family takes; `test_docs_table_matches_the_code` keeps it true.

Every check compares float32 log-probs within 1e-5: the float32 rounding of a few layers of a 64-wide model,
summed in another order (a padded batch, a packed row, a KV cache, a 4-D mask), differs by a few ulps of values
of order one (measured here: at most 9.5e-7); a wrong position id, mask or cache showed as 1e-2 or more."""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import build_tiny_tokenizer
from helpers import count_digits, sampler_with_rows_ending_apart, small_config, text_dataset
from transformers import AutoConfig, AutoModelForCausalLM

from gspo_trl import GSPOConfig, GSPOTrainer
from gspo_trl.models.loading import router_aux_loss_coef
from gspo_trl.models.packing import padding_free_in_use, padding_free_unsupported_reason
from gspo_trl.rollout import HFGenerateBackend, completion_mask_from_eos, stream_keys
from gspo_trl.rollout.decoding import dynamic, static
from gspo_trl.rollout.decoding.prefix_sharing import prefill
from gspo_trl.rollout.decoding.truncation import policy_logps
from gspo_trl.training.logprobs import completion_logprobs

DOCS_TABLE = Path(__file__).resolve().parent.parent / "docs" / "architectures.md"

# hidden 64, 2 layers, 4 heads of 16, 2 key/value heads: a few hundred thousand parameters, built in well under 1 s.
LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
# A sliding window shorter than the test rows (prompt + completion: about 25 tokens), so that it masks something.
WINDOW = 8

FALCON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)

# id -> (model_type, config values). The ids name the tests (`gpt2-eager-padded`) and the rows of the docs table.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", LLAMA_LIKE),
    "qwen2": ("qwen2", LLAMA_LIKE),
    "qwen3": ("qwen3", LLAMA_LIKE),
    "qwen3_moe": ("qwen3_moe", {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mistral": ("mistral", {**LLAMA_LIKE, "sliding_window": None}),
    "mistral-sliding": ("mistral", {**LLAMA_LIKE, "sliding_window": WINDOW}),
    "mixtral": ("mixtral", {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("gemma2", {**LLAMA_LIKE, "sliding_window": WINDOW, "query_pre_attn_scalar": 16}),
    "gemma3_text": (
        "gemma3_text",
        {
            **LLAMA_LIKE,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "phi3": ("phi3", {key: value for key, value in LLAMA_LIKE.items() if key != "head_dim"}),
    "gpt2": ("gpt2", dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=512)),
    "olmo2": ("olmo2", LLAMA_LIKE),
    "olmoe": ("olmoe", {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": (
        "gpt_oss",
        {
            **LLAMA_LIKE,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "deepseek_v3": (  # multi-head latent attention: as many key/value heads as query heads, as in the released model
        "deepseek_v3",
        {
            **{key: value for key, value in LLAMA_LIKE.items() if key != "head_dim"},
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
        },
    ),
    "falcon": ("falcon", FALCON),
    "falcon-alibi": ("falcon", {**FALCON, "alibi": True}),  # Falcon-RW's position biases instead of rotary ones
    "starcoder2": ("starcoder2", LLAMA_LIKE),
    "gpt_neox": (
        "gpt_neox",
        {key: value for key, value in LLAMA_LIKE.items() if key not in ("head_dim", "num_key_value_heads")},
    ),
}
ATTENTIONS = ("eager", "sdpa")
# transformers builds these with eager attention only: asking for SDPA is a ValueError at construction.
EAGER_ONLY = {"gemma2", "gpt_oss"}
# Sliding-window layers: no packed rows (the block-tree mask would bypass the window) and no static loop (its
# cache layers are not full attention). gspo-trl says so and falls back to padded rows and the dynamic loop.
SLIDING = {"mistral-sliding", "gemma2", "gemma3_text", "gpt_oss"}
# ALiBi biases built from a 2-D padding mask: no packed rows, and no static loop (whose 4-D mask Falcon's forward
# cannot build its biases from: "too many values to unpack" in `build_alibi_tensor`).
ALIBI = {"falcon-alibi"}

COMBINATIONS = [
    pytest.param(family, attention, id=f"{family}-{attention}")
    for family in FAMILIES
    for attention in ATTENTIONS
    if not (family in EAGER_ONLY and attention == "sdpa")
]

TEMPERATURE = 0.8  # the log-prob temperature of `sampler_with_rows_ending_apart`
TOLERANCE = 1e-5  # float32 rounding over a few layers of a tiny model (module docstring)
# Prompts of three lengths (left padding); two that repeat (the packed layout and the prefill put them once) and two
# pairs that share a prefix but not their ends (the rollout's shared-prefix prefill leaves gaps in their rows).
PROMPTS = [
    "What is 2 + 3? Reply with just the number.",
    "What is 2 + 3?",
    "Hello world",
    "Hello world",
    "Solve: 7 - 4 =",
    "Solve: 7 - 4 = 3. Numbers 0 1 2",
]


@functools.cache
def tokenizer():
    return build_tiny_tokenizer()


def build(family: str, attention: str | None):
    """A fresh tiny `family` model in eval mode, fp32, with `attention` (None: transformers' default)."""
    model_type, values = FAMILIES[family]
    tok = tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    try:
        config = AutoConfig.for_model(model_type, vocab_size=len(tok), **ids, **values)
    except (ImportError, KeyError, ValueError) as error:  # a family this transformers does not ship (any longer)
        raise RuntimeError(
            f"transformers {transformers.__version__} cannot build model_type {model_type!r} (test family {family!r}): "
            f"{error}. Drop the family from FAMILIES and from docs/architectures.md only if transformers removed it."
        ) from error
    torch.manual_seed(0)
    kwargs = {} if attention is None else {"attn_implementation": attention}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    for name, value in ids.items():
        setattr(model.generation_config, name, value)
    return model.eval()  # GPT-2's dropout is on by default


@functools.cache
def tiny(family: str, attention: str):
    """Built once per test process; tests must leave it as they found it (weights, config, eval mode)."""
    return build(family, attention)


def plain_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """(len(completion),) log-probs at `TEMPERATURE` from the model's own forward over this one row: no padding,
    no cache, no position ids or mask passed."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logps = (logits / TEMPERATURE).log_softmax(-1)[len(prompt) - 1 : len(prompt) + len(completion) - 1]
    return logps.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def assert_equal_to_plain_forwards(model, prompts: list[list[int]], completions, logps, completion_mask):
    """`logps` (N, C) equal each row's plain forward where `completion_mask` is 1, and are 0 elsewhere."""
    errors = []
    for row, prompt in enumerate(prompts):
        length = int(completion_mask[row].sum())
        assert completion_mask[row, :length].all(), "the scored tokens are not a prefix of the row"
        expected = plain_logps(model, prompt, completions[row, :length].tolist())
        errors.append(float((logps[row, :length] - expected).abs().max()) if length else 0.0)
        assert (logps[row, length:] == 0).all(), row
    assert max(errors) <= TOLERANCE, f"max |log-prob error| per row: {[f'{e:.2e}' for e in errors]}"


def prompt_rows(encoded) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(encoded.input_ids, encoded.attention_mask)]


# --- construction --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(EAGER_ONLY))
def test_eager_only_families_refuse_sdpa(family):
    # Nothing for gspo-trl to fall back from: transformers refuses to build the model, naming SDPA.
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        build(family, "sdpa")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_attention(family):
    # What a user gets without choosing: SDPA wherever transformers has it. The training test runs this one.
    expected = "eager" if family in EAGER_ONLY else "sdpa"
    assert build(family, None).config._attn_implementation == expected


# --- log-probs -----------------------------------------------------------------------------------------------


def padded_batch():
    """Left-padded prompts of three lengths, right-padded completions of five lengths (one of a single token)."""
    tok = tokenizer()
    encoded = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7, 1, 6, 3]
    completion_ids = torch.full((len(PROMPTS), max(lengths)), tok.pad_token_id)
    for row, length in enumerate(lengths):
        completion_ids[row, :length] = torch.randint(5, len(tok), (length,), generator=generator)
    completion_mask = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long()
    return encoded, completion_ids, completion_mask


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("family, attention", COMBINATIONS)
def test_logprobs_equal_a_plain_forward(family, attention, layout):
    model = tiny(family, attention)
    reason = padding_free_unsupported_reason(model)
    if family in SLIDING:
        assert reason is not None and "sliding-window" in reason
    elif family in ALIBI:
        assert reason is not None and "ALiBi" in reason
    else:
        assert reason is None
    padding_free = layout == "packed"
    if padding_free and reason is not None:
        # The trainer decides once, at construction: such a model trains (and is scored) on padded rows.
        assert padding_free_in_use(True, "cpu", model) is False
        padding_free = False
    encoded, completion_ids, completion_mask = padded_batch()
    with torch.no_grad():
        logps = completion_logprobs(
            model,
            torch.cat([encoded.input_ids, completion_ids], dim=1),
            torch.cat([encoded.attention_mask, completion_mask], dim=1),
            completion_ids,
            completion_mask,
            temperature=TEMPERATURE,
            padding_free=padding_free,
        ).logps
    assert_equal_to_plain_forwards(model, prompt_rows(encoded), completion_ids, logps, completion_mask)


# --- sampling ------------------------------------------------------------------------------------------------


def static_refusal(model, encoded) -> str | None:
    return static.unsupported_reason(model, prefill(model, encoded.input_ids, encoded.attention_mask))


@pytest.mark.parametrize("family, attention", COMBINATIONS)
def test_dynamic_loop_records_the_logps_of_a_plain_forward(family, attention):
    # The CPU loop, and the GPU one where the static loop refuses: rows end at different steps and leave the batch.
    model = tiny(family, attention)
    tok = tokenizer()
    run, encoded = sampler_with_rows_ending_apart(model, tok, PROMPTS)
    decoded = run()
    completion_mask, _ = completion_mask_from_eos(decoded.completion_ids, [tok.eos_token_id])
    lengths = completion_mask.sum(1).tolist()
    assert len(set(lengths)) > 1, lengths
    # The helper's processors keep GenerationConfig's default top_k=50: the loop records the truncated log-probs and
    # the kept mass, whose sum is the policy's log-prob a plain forward gives (`truncation.policy_logps`).
    logps = policy_logps(decoded.logps, decoded.kept_log_mass)
    assert_equal_to_plain_forwards(model, prompt_rows(encoded), decoded.completion_ids, logps, completion_mask)


@pytest.mark.parametrize("family, attention", COMBINATIONS)
def test_static_loop_records_the_logps_of_a_plain_forward(family, attention, monkeypatch):
    # The GPU loop, without CUDA graphs (its steps run eagerly here): windows of 4 positions grow every 4 steps,
    # and the batch is compacted at checks every 2 steps. The helper's sampler (its processors, per-row streams and
    # temperature) runs it in the place of `dynamic.sample`, which the helper imports when it is called.
    model = tiny(family, attention)
    tok = tokenizer()
    calls = []

    def static_sample(*args, cpu_kernels=None, **kwargs):  # the static loop runs no CPU kernels
        calls.append(kwargs["max_new_tokens"])
        return static.sample(*args, graphs=False, window_block=4, check_every=2, **kwargs)

    monkeypatch.setattr(dynamic, "sample", static_sample)
    run, encoded = sampler_with_rows_ending_apart(model, tok, PROMPTS)
    reason = static_refusal(model, encoded)
    if family in SLIDING | ALIBI:
        # HFGenerateBackend then decodes with the dynamic loop (the test above), warning once with this reason.
        assert reason is not None, "the static loop must refuse this model"
        assert family in ALIBI or "full attention" in reason
        return
    assert reason is None
    decoded = run()
    assert calls  # the static loop sampled
    completion_mask, _ = completion_mask_from_eos(decoded.completion_ids, [tok.eos_token_id])
    # The helper's processors keep GenerationConfig's default top_k=50: the loop records the truncated log-probs and
    # the kept mass, whose sum is the policy's log-prob a plain forward gives (`truncation.policy_logps`).
    logps = policy_logps(decoded.logps, decoded.kept_log_mass)
    assert_equal_to_plain_forwards(model, prompt_rows(encoded), decoded.completion_ids, logps, completion_mask)


def sampling_config(tmp_path, **overrides) -> GSPOConfig:
    return GSPOConfig(
        output_dir=str(tmp_path), use_cpu=True, max_completion_length=10, temperature=TEMPERATURE, **overrides
    )


@pytest.mark.parametrize("loop", ["dynamic", "static"])
@pytest.mark.parametrize("family, attention", COMBINATIONS)
def test_rollout_records_the_logps_of_a_plain_forward(family, attention, loop, tmp_path, monkeypatch):
    # The trainer's rollout with the default loop, to the length cap (a random model rarely ends a row): each shared
    # prompt prefix prefilled once (`prefix_sharing`; rows with gaps for models that take them), then the loop; its
    # log-probs are π_old. On CPU the backend decodes with the dynamic loop; "static" stands in for a GPU with
    # `decode_cuda_graphs`, where the backend hands the same prefilled rows to the static loop unless it refuses them.
    model = tiny(family, attention)
    tok = tokenizer()
    backend = HFGenerateBackend(lambda: model, tok, sampling_config(tmp_path, decode_logprobs_as_old=True))
    assert backend.use_decode_loop
    refusals, static_calls = [], []
    if loop == "static":
        dynamic_sample = dynamic.sample

        def sample_as_on_a_gpu(model, ids, mask, *, cache, cpu_kernels, **sampling):
            reason = static.unsupported_reason(model, cache)
            if reason is not None:
                refusals.append(reason)
                return dynamic_sample(model, ids, mask, cache=cache, cpu_kernels=cpu_kernels, **sampling)
            static_calls.append(ids.shape)
            return static.sample(model, ids, mask, cache=cache, graphs=False, window_block=4, check_every=2, **sampling)

        monkeypatch.setattr(dynamic, "sample", sample_as_on_a_gpu)
    rollout = backend.generate(PROMPTS, stream_keys(3, torch.arange(len(PROMPTS))))
    if loop == "static":
        if family in SLIDING | ALIBI:
            assert refusals and not static_calls
        else:
            assert static_calls and not refusals
    assert rollout.sampled_by_policy
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)]
    assert_equal_to_plain_forwards(model, rows, rollout.completion_ids, rollout.sampling_logps, rollout.completion_mask)


@pytest.mark.parametrize("family, attention", COMBINATIONS)
def test_generate_samples_from_the_logps_of_a_plain_forward(family, attention, tmp_path, monkeypatch):
    # decode_loop="generate" records no log-probs (π_old then comes from a forward pass). What it sampled from is
    # checked instead: generate's raw logits of each step, read through `output_logits`, at the temperature.
    model = tiny(family, attention)
    tok = tokenizer()
    backend = HFGenerateBackend(lambda: model, tok, sampling_config(tmp_path, decode_loop="generate"))
    assert not backend.use_decode_loop
    steps = []
    generate = model.generate

    def generate_keeping_logits(*args, **kwargs):
        out = generate(*args, **kwargs, output_logits=True, return_dict_in_generate=True)
        steps.extend(out.logits)
        return out.sequences

    monkeypatch.setattr(model, "generate", generate_keeping_logits)
    rollout = backend.generate(PROMPTS, stream_keys(3, torch.arange(len(PROMPTS))))
    assert rollout.sampling_logps is None and not rollout.sampled_by_policy
    completions = rollout.completion_ids
    assert len(steps) == completions.shape[1]  # one generate call (one slice of rows), one logits tensor per token
    logits = torch.stack(steps, dim=1).float()  # (N, C, V)
    logps = (logits / TEMPERATURE).log_softmax(-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    logps = logps * rollout.completion_mask
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask)]
    assert_equal_to_plain_forwards(model, rows, completions, logps, rollout.completion_mask)


# --- training ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # about 0.6 s a family: 30 s of the file's 65 on two busy cores
@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_training_steps(family, tmp_path):
    # Each family with what a user gets by default on CPU: its default attention, packed rows where it takes them,
    # the dynamic loop recording π_old.
    model = build(family, None)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    gspo_trainer = GSPOTrainer(
        model=model,
        reward_funcs=count_digits,
        args=small_config(tmp_path),
        train_dataset=text_dataset(),
        processing_class=tokenizer(),
    )
    assert gspo_trainer.padding_free == (family not in SLIDING | ALIBI)
    gspo_trainer.train()
    losses = [entry["loss"] for entry in gspo_trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())


# --- docs/architectures.md -----------------------------------------------------------------------------------


def docs_rows() -> dict[str, list[str]]:
    """The cells of each row of the table in docs/architectures.md, by the test id in its first cell."""
    rows = {}
    for line in DOCS_TABLE.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `([\w-]+)` \|", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in line.strip().strip("|").split("|")]
    return rows


def test_docs_table_matches_the_code():
    # Each family of this matrix has a row, whose model_type, packed-rows and GPU-decoding cells say what the code
    # decides for it (a load-balancing loss keeps the training forward on padded rows: `completion_logprobs`).
    rows = docs_rows()
    assert set(rows) == set(FAMILIES), set(rows) ^ set(FAMILIES)
    tok = tokenizer()
    encoded = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    for family, (model_type, _) in FAMILIES.items():
        _, documented_type, packed, gpu_loop, *_ = rows[family]
        assert documented_type == f"`{model_type}`", family
        model = tiny(family, "eager")
        packs = padding_free_unsupported_reason(model) is None
        assert packed.startswith("yes" if packs else "no"), family
        assert ("load-balancing" in packed) == (packs and router_aux_loss_coef(model, None) != 0), family
        assert gpu_loop.startswith("static" if static_refusal(model, encoded) is None else "dynamic"), family
