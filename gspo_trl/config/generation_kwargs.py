"""The checks of `generation_kwargs`: what may reach the sampler besides the config's own sampling fields.

Refused: settings that do not sample one completion per prompt row from the policy (beam and contrastive search,
greedy decoding, several sequences per row, the vLLM request fields the trainer sets itself), and a value for one of
the config's own fields (temperature, top_p, top_k, min_p, repetition_penalty, the completion budget) other than the
config's: the trainer scores log-probs, budgets and the vLLM request with the config's fields, so the sampler
would sample with one setting and training compute with another. Warned once: settings that change the distribution
completions are drawn from without a field of their own (bad words, n-gram bans, minimum lengths, biases). What it
does not own: the config's own sampling fields' bounds (`checks.check_sampling`).
"""

from __future__ import annotations

from transformers.utils import logging

logger = logging.get_logger(__name__)

# vLLM request fields the trainer sets itself (one sample per request row, the sampled token's log-prob) or that
# search instead of sampling.
VLLM_REQUEST_FIELDS_REFUSED = ("n", "best_of", "use_beam_search", "logprobs", "prompt_logprobs")

# generation_kwargs names (GenerationConfig's, and the vLLM request's) of a config field: their value must be the
# field's, which training computes with.
CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_completion_length",
    "max_tokens": "max_completion_length",
    "cache_implementation": "cache_implementation",
}

# Settings that change the distribution completions are drawn from, with no config field of their own: the completions
# are then not samples of the policy whose log-probs training computes (GenerationConfig's and vLLM's names).
OFF_POLICY_SETTINGS = (
    "min_new_tokens",
    "min_length",
    "min_tokens",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "bad_words",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "logit_bias",
    "allowed_token_ids",
    "encoder_repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "exponential_decay_length_penalty",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "guidance_scale",
)

NEUTRAL_VALUES = {"encoder_repetition_penalty": 1.0, "typical_p": 1.0, "guidance_scale": 1.0}


def _same_setting(field: str, value, configured) -> bool:
    """Whether a generation_kwargs value means what the config field's value means (top_k 0 and vLLM's -1 both
    disable it; min_p None and 0 too)."""
    if field == "top_k":
        return (value or 0) in (0, -1) and not configured or value == configured
    if field == "min_p":
        return (value or 0.0) == (configured or 0.0)
    return value == configured


def check_generation_kwargs(config) -> None:
    """Refuse the generation_kwargs that do not sample one completion per prompt row from the policy the config
    describes (see the module docstring); with `use_vllm` they are vLLM request fields, and those the trainer sets
    itself are refused too. Warns once about the settings that change the sampled distribution."""
    generation_kwargs = config.generation_kwargs
    if generation_kwargs is None:
        return
    if not isinstance(generation_kwargs, dict):
        raise TypeError(f"generation_kwargs must be a dict of GenerationConfig fields, got {generation_kwargs!r}.")
    if config.use_vllm:
        refused = [name for name in VLLM_REQUEST_FIELDS_REFUSED if name in generation_kwargs]
        if refused:
            raise ValueError(
                f"generation_kwargs sets {refused[0]!r}, which the trainer sets itself in every vLLM request (one "
                "sample per prompt row, the sampled token's log-prob) or which searches instead of sampling. "
                "Remove it; num_generations sets the group size."
            )
    for name, what in (
        ("num_beams", "beam search keeps the likeliest sequences instead of sampling them"),
        ("num_beam_groups", "beam search keeps the likeliest sequences instead of sampling them"),
        ("num_return_sequences", "each prompt row already gets one completion; num_generations sets the group size"),
    ):
        value = generation_kwargs.get(name)
        if value is not None and value != 1:
            raise ValueError(
                f"generation_kwargs[{name!r}]={value!r} is not supported: {what}, so the completions would not be "
                "samples of the policy that GSPO's importance ratio compares. Remove it."
            )
    if generation_kwargs.get("penalty_alpha"):
        raise ValueError(
            "generation_kwargs['penalty_alpha'] (contrastive search) is not supported: it picks tokens "
            "deterministically, so the completions would not be samples of the policy. Remove it."
        )
    if generation_kwargs.get("do_sample", True) is not True:
        raise ValueError(
            f"generation_kwargs['do_sample']={generation_kwargs['do_sample']!r} decodes greedily: every completion "
            "of a group would be the same, so no group has a reward spread to learn from. Remove it (the trainer "
            "samples)."
        )
    if "max_length" in generation_kwargs:
        raise ValueError(
            "generation_kwargs['max_length'] counts the prompt too, and the trainer budgets completions with "
            "max_completion_length. Remove it and set max_completion_length."
        )
    for name, field in CONFIG_FIELDS.items():
        if name in generation_kwargs and not _same_setting(field, generation_kwargs[name], getattr(config, field)):
            raise ValueError(
                f"generation_kwargs[{name!r}]={generation_kwargs[name]!r} overrides {field}="
                f"{getattr(config, field)!r}, which the rest of training reads (the log-probs' temperature, the "
                "completion budget, the vLLM request): the completions would be sampled with one setting and trained "
                f"on with another. Set {field}={generation_kwargs[name]!r} instead and remove it from "
                "generation_kwargs."
            )
    changing = [
        name
        for name in OFF_POLICY_SETTINGS
        if generation_kwargs.get(name) not in (None, 0, [], {}, NEUTRAL_VALUES.get(name))
    ]
    if changing:
        logger.warning(
            f"generation_kwargs sets {', '.join(changing)}, which change the distribution completions are drawn "
            "from: training computes the policy's own log-probs for them, as if the policy had sampled them. Leave "
            "them out unless that bias is intended."
        )
