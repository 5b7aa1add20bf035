"""gspo_trl/models/loading.py (and the reward models of gspo_trl/scoring/rewards.py) loading custom-code models (a
directory whose
model, tokenizer and reward head are classes defined in its own Python files, loaded only with `trust_remote_code`),
and loading a checkpoint to resume from whose weights transformers saves under other names. Quantized bases are tested
in test_quantization.py."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
import torch
from helpers import count_digits, small_config

from gspo_trl import GSPOTrainer

CONFIGURATION = """
from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "{model_type}"
"""

MODELING = """
import torch
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig


class TinyCustomForSequenceClassification(LlamaForSequenceClassification):
    config_class = TinyCustomConfig

    def __init__(self, config):  # its body built directly: AutoModel does not know the custom config
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = LlamaModel(config)
        self.score = torch.nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
"""

TOKENIZATION = """
from transformers import PreTrainedTokenizerFast


class TinyCustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture()
def custom_code_dir(tmp_path, tiny_model_dir):
    """The tiny Llama as a custom-code model: its config, causal LM, sequence classifier and tokenizer classes live in
    the directory (`auto_map`), under a model type transformers does not know."""
    path = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, path)
    model_type = f"tiny_custom_{uuid.uuid4().hex[:8]}"  # dynamic modules are cached per process: one name per test
    (path / "configuration_tiny.py").write_text(CONFIGURATION.format(model_type=model_type))
    (path / "modeling_tiny.py").write_text(MODELING)
    (path / "tokenization_tiny.py").write_text(TOKENIZATION)
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type=model_type,
        num_labels=1,
        auto_map={
            "AutoConfig": "configuration_tiny.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
            "AutoModelForSequenceClassification": "modeling_tiny.TinyCustomForSequenceClassification",
        },
    )
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config.update(
        tokenizer_class="TinyCustomTokenizer",
        auto_map={"AutoTokenizer": [None, "tokenization_tiny.TinyCustomTokenizer"]},
    )
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(path)


@pytest.mark.slow  # training runs
def test_custom_code_models_load_only_with_trust_remote_code(tmp_path, custom_code_dir):
    from helpers import text_dataset

    with pytest.raises(ValueError, match="trust_remote_code"):
        GSPOTrainer(custom_code_dir, count_digits, args=small_config(tmp_path), train_dataset=text_dataset())
    # The reward model: the custom family's sequence-classification class, saved as such (a causal-LM checkpoint
    # given as a reward model is refused: its score head would be random).
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_dir = tmp_path / "reward"
    scorer = AutoModelForSequenceClassification.from_pretrained(custom_code_dir, trust_remote_code=True, num_labels=1)
    scorer.save_pretrained(reward_dir)
    AutoTokenizer.from_pretrained(custom_code_dir, trust_remote_code=True).save_pretrained(reward_dir)
    args = small_config(tmp_path / "run", trust_remote_code=True, max_steps=1)
    trainer = GSPOTrainer(custom_code_dir, [count_digits, str(reward_dir)], args=args, train_dataset=text_dataset())
    assert type(trainer.model).__name__ == "TinyCustomForCausalLM"
    assert type(trainer.processing_class).__name__ == "TinyCustomTokenizer"
    reward_model = trainer.reward_funcs[1]
    assert type(reward_model.model).__name__ == "TinyCustomForSequenceClassification"
    assert type(reward_model.processing_class).__name__ == "TinyCustomTokenizer"
    trainer.train()
    assert trainer.state.global_step == 1


def test_model_init_kwargs_trust_remote_code_wins_over_the_field(tmp_path, custom_code_dir):
    from helpers import text_dataset

    args = small_config(tmp_path, trust_remote_code=True, model_init_kwargs={"trust_remote_code": False})
    with pytest.raises(ValueError, match="trust_remote_code"):  # the model refuses; TRL's precedence
        GSPOTrainer(custom_code_dir, count_digits, args=args, train_dataset=text_dataset())


# Families whose checkpoints transformers writes under other names than the model's own (experts saved one by one,
# fused in the model; GPT-NeoX's head saved as `embed_out`), and one whose names agree.
@pytest.mark.parametrize(
    "family, renamed", [("qwen3_moe", True), ("mixtral", True), ("olmoe", True), ("gpt_neox", True), ("llama", False)]
)
def test_a_checkpoint_saved_under_other_names_is_loaded_back_bit_for_bit(family, renamed, tmp_path):
    import torch
    from test_architectures import build

    from gspo_trl.models.loading import checkpoint_weight_names, load_renamed_checkpoint

    saved = build(family, None)
    saved.save_pretrained(tmp_path)
    assert (checkpoint_weight_names(str(tmp_path)) != set(saved.state_dict())) == renamed
    model = build(family, None)
    with torch.no_grad():
        for value in model.parameters():
            value.add_(1.0)
    assert load_renamed_checkpoint(model, str(tmp_path)) == renamed  # False: Trainer's own load_state_dict is right
    if renamed:
        for (name, expected), value in zip(saved.state_dict().items(), model.state_dict().values()):
            assert torch.equal(expected, value), name


def test_the_reference_copy_does_not_run_a_forward_another_library_put_on_the_policy(tmp_path, tiny_model):
    # TRL's SFTTrainer adds its fused LM head by replacing the instance's `forward` with a wrapper that closes over the
    # model's own bound forward. A plain deep copy would keep calling the policy's forward (its weights): the
    # reference's log-probs would follow the policy's and the KL term would vanish.
    from trl.trainer.utils import add_fused_lm_head

    from gspo_trl.models.loading import create_reference_model

    add_fused_lm_head(tiny_model)
    wrapper = tiny_model.forward
    reference = create_reference_model(tiny_model, tiny_model, small_config(tmp_path, beta=0.1))
    assert tiny_model.forward == wrapper  # the policy keeps its wrapper
    assert "forward" not in reference.__dict__  # the copy runs its class's forward, on its own weights
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        before = reference(input_ids=ids).logits
        for parameter in tiny_model.parameters():
            parameter.add_(0.5)
        assert torch.equal(reference(input_ids=ids).logits, before)  # the policy's new weights do not reach it
