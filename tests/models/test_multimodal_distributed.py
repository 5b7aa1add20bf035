"""Vision-language training on more than one process: every process's images joined with the gathered rollout
(`VisionInputs.joined`, `gather.gather_rollout`), and whole runs of the tiny Qwen2.5-VL under torchrun (DDP and
DeepSpeed ZeRO-3, through tests/distributed_worker.py's `+vlm`) against one process."""

from __future__ import annotations

import pytest
import torch
from test_distributed import assert_same_run, launch
from vlm_models import BUILDERS, build_tiny_qwen2_5_vl

from gspo_trl.models.multimodal import VisionInputs


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """The tiny Qwen2.5-VL's weights (the worker builds its processor, which needs torchvision to load)."""
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl")
    build_tiny_qwen2_5_vl()[0].save_pretrained(path)
    return str(path)


def test_joined_vision_inputs_follow_the_gathered_rows():
    # Process 0: prompts of 3 columns, rows [0, 0, 1]; process 1: one prompt of 2 columns, rows [0, 0]. Gathered, the
    # prompts are 4 columns wide (left-padded), and process 1's rows answer the third prompt.
    first = {"pixel_values": torch.tensor([[1.0]]), "mm_token_type_ids": torch.tensor([[0, 1, 0]])}
    second = {"pixel_values": torch.tensor([[2.0]]), "mm_token_type_ids": torch.tensor([[1, 1, 0]])}
    third = {"pixel_values": torch.tensor([[3.0], [4.0]]), "mm_token_type_ids": torch.tensor([[1, 0]])}
    rank0 = VisionInputs([first, second], torch.tensor([0, 0, 1]))
    rank1 = VisionInputs([third], torch.tensor([0, 0]))
    joined = VisionInputs.joined([rank0, rank1], prompt_length=4)
    assert joined.groups.tolist() == [0, 0, 1, 2, 2]
    assert joined.prompts[2]["pixel_values"] is third["pixel_values"]  # only token-aligned fields are rebuilt
    rows = joined.rows_inputs(total_length=6)  # 4 prompt columns, 2 completion columns
    assert rows["pixel_values"].flatten().tolist() == [1.0, 1.0, 2.0, 3.0, 4.0, 3.0, 4.0]
    assert rows["mm_token_type_ids"].tolist() == [
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
    ]
    # A process's share of a global micro-batch keeps the prompts of its rows only.
    assert joined.select(torch.tensor([1, 4])).prompts == [joined.prompts[0], joined.prompts[2]]


@pytest.mark.parametrize("mode", ["ddp+seeded+vlm", "ddp+seeded+vlm+lora+beta", "zero3+seeded+vlm"])
@pytest.mark.slow  # torchrun launches
def test_one_and_two_processes_train_the_same_vlm_run(tmp_path, vlm_dir, mode):
    # 8 completions per micro-step with layout-independent sampling: one process of 8 rows or two of 4 sample the
    # same completions, and each process trains on its share of the same global micro-batches, whose rows come from
    # both processes' prompts (images included). Every third prompt of the worker's is longer, so the gathered
    # rollout left-pads the other process's prompts and their token-aligned image fields (M-RoPE's positions).
    # +lora+beta: an adapter on every linear layer (the vision tower's too), the KL to the disabled-adapter reference.
    one = launch(tmp_path, vlm_dir, mode, processes=1, name="one")
    two = launch(tmp_path, vlm_dir, mode, processes=2, name="two")
    # Float32 rounding of the same sums over other batch shapes, a few 1e-7 relative on values of order one (1e-6
    # seen); 1e-5 as for the text models. Images given to the wrong rows move log-probs by ~0.1 (test_multimodal).
    assert_same_run(one[0], two[0], 1e-5)
    assert_same_run(two[0], two[1], 0)  # every rank logs the same numbers and holds the same weights
    assert any(e["ratio/max"] != 1.0 for e in one[0]["logs"])  # an off-policy step (π_old from a forward) compared
    assert one[0]["logs"][0]["completions/mean_length"] == two[0]["logs"][0]["completions/mean_length"]
    if "beta" in mode:
        assert any(e["kl"] > 0 for e in one[0]["logs"])
    if mode.startswith("zero3"):
        assert [r["distributed_type"] for r in two] == ["DistributedType.DEEPSPEED"] * 2
        assert two[0]["local_parameters"] <= 0.55 * one[0]["local_parameters"]  # partitioned: half the weights each
        assert two[0]["whole_at_generation"] == [True, True]  # gathered for generate, once per rollout
        # ds3_gather_for_generation=False: generate on partitioned weights (ZeRO-3's hooks gather each layer, and
        # generate keeps both ranks stepping together): the same run.
        partitioned = launch(tmp_path, vlm_dir, mode + "+nogather", name="partitioned")
        assert partitioned[0]["whole_at_generation"] == [False, False]
        assert_same_run(two[0], partitioned[0], 0)


@pytest.mark.slow  # torchrun launches
def test_kill_9_mid_rollout_then_resume_continues_with_its_images(tmp_path, vlm_dir):
    # Rank 1 is killed inside optimizer step 3; checkpoint-2, inside a 3-step rollout, holds each rank's micro-batches
    # with their images. The resumed run trains on them (nothing to sample again) and ends where the whole run did.
    whole = launch(tmp_path, vlm_dir, "ddp+vlm+checkpoints", name="whole")
    killed = launch(tmp_path, vlm_dir, "ddp+vlm+kill", name="cut", must_succeed=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    resumed = launch(tmp_path, vlm_dir, "ddp+vlm+resume", name="cut")
    assert_same_run(whole[0], resumed[0], 1e-6, steps=4)  # the same weights and rows: 0 seen
    assert_same_run(resumed[0], resumed[1], 0, steps=4)
    assert any(e["ratio/max"] != 1.0 for e in resumed[0]["logs"] if e["step"] == 3)  # the continued rollout


@pytest.mark.slow  # a torchrun launch
def test_processes_with_and_without_images_are_refused_on_every_process(tmp_path, vlm_dir):
    # Rank 1's prompts have no images, rank 0's do: the first-rollout check is skipped on both (it is decided from
    # the model), and the rollout's gather refuses the mix on both, instead of one rank waiting in a collective the
    # other never enters.
    completed = launch(tmp_path, vlm_dir, "ddp+vlm+mixed", must_succeed=False)
    assert completed.returncode != 0
    assert "A rollout mixes processes whose prompts have images with processes whose prompts have none" in (
        completed.stderr
    )


@pytest.mark.parametrize("family", ["llava", "gemma3", "idefics3"])
@pytest.mark.slow  # torchrun launches
def test_one_and_two_processes_train_the_same_run_for_each_family(tmp_path, family):
    # The other image plumbings: LLaVA's fixed image tokens, Gemma 3's token_type_ids (bidirectional attention over an
    # image's tokens), Idefics3's sub-images with pixel_attention_mask (padded across the gathered prompts).
    model_dir = tmp_path / family
    BUILDERS[family]()[0].save_pretrained(model_dir)
    one = launch(tmp_path, str(model_dir), f"ddp+seeded+vlm+{family}", processes=1, name="one")
    two = launch(tmp_path, str(model_dir), f"ddp+seeded+vlm+{family}", processes=2, name="two")
    assert_same_run(one[0], two[0], 1e-5)  # the tolerance of the Qwen2.5-VL test above
    assert_same_run(two[0], two[1], 0)
