"""Tests for gspo_trl.rollout.vllm_servers: a rollout's groups split among servers and put back in order, calls to
all servers at once with errors naming their server, and the servers checked against each other. The backend's
sampling runs against stand-in clients (the HTTP boundary), then against two real servers."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import count_digits, text_dataset
from peft import LoraConfig
from real_vllm_servers import FIXED_TEXT, free_port, record_syncs, vllm_config

from gspo_trl import GSPOTrainer
from gspo_trl.rollout.vllm_server import VLLMServerBackend
from gspo_trl.rollout.vllm_servers import ServerLink, check_servers_alike, in_parallel, split_groups
from gspo_trl.vllm.client import VLLMServerError


def shares(sizes, parts):
    return [list(r) for r in split_groups(sizes, parts)]


@pytest.mark.parametrize(
    "sizes, parts, expected",
    [
        ([4, 4, 4, 4], 2, [[0, 1], [2, 3]]),
        ([4, 4, 4, 4], 1, [[0, 1, 2, 3]]),
        ([4, 4, 4], 2, [[0, 1], [2]]),  # 6 samples each way: a tie goes to the later edge
        ([4, 4, 4, 4, 4], 3, [[0, 1], [2], [3, 4]]),  # edges nearest 20/3 and 40/3 samples: 8 and 12
        ([8, 1, 1, 1, 1], 2, [[0], [1, 2, 3, 4]]),  # uneven groups: 8 against 4, not 9 against 3
        ([1, 1, 1, 9], 2, [[0, 1, 2], [3]]),
        ([4], 3, [[], [0], []]),  # fewer groups than servers: some get none
        ([], 2, [[], []]),
    ],
)
def test_groups_split_whole_into_consecutive_near_even_shares(sizes, parts, expected):
    assert shares(sizes, parts) == expected


@pytest.mark.parametrize("seed", range(20))
def test_every_split_covers_each_group_once_in_order_within_a_group_of_even(seed):
    generator = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 30, (1,), generator=generator))
    parts = int(torch.randint(1, 6, (1,), generator=generator))
    sizes = torch.randint(1, 9, (groups,), generator=generator).tolist()
    ranges = split_groups(sizes, parts)
    assert len(ranges) == parts
    assert [i for r in ranges for i in r] == list(range(groups))  # every group once, consecutive, in order
    # Each edge is the group edge nearest its target, so a share is off the even one by less than a group at each end.
    loads = [sum(sizes[i] for i in r) for r in ranges]
    assert max(loads) <= sum(sizes) / parts + max(sizes)


def test_split_refuses_zero_parts():
    with pytest.raises(ValueError, match="at least one part"):
        split_groups([4], 0)


def test_calls_run_at_once_and_their_results_come_back_in_order():
    barrier = threading.Barrier(3, timeout=10)  # passes only if the three calls run at the same time

    def call(value, delay):
        barrier.wait()
        time.sleep(delay)  # the first finishes last
        return value

    tasks = [(f"http://s{i}:1", lambda i=i: call(i, 0.2 - 0.1 * i)) for i in range(3)]
    assert in_parallel(tasks) == [0, 1, 2]


def test_sequential_calls_run_in_order_in_this_thread():
    order = []
    tasks = [(f"http://s{i}:1", lambda i=i: order.append((i, threading.current_thread().name)) or i) for i in range(3)]
    assert in_parallel(tasks, parallel=False) == [0, 1, 2]
    assert order == [(i, threading.current_thread().name) for i in range(3)]


def test_a_failing_server_is_named_once_every_call_ended():
    ended = []

    def slow_ok():
        time.sleep(0.3)
        ended.append("ok")
        return 1

    def broken():
        raise RuntimeError("connection reset")

    with pytest.raises(VLLMServerError, match=r"^The vLLM server at http://b:2: connection reset$") as error:
        in_parallel([("http://a:1", slow_ok), ("http://b:2", broken)])
    assert ended == ["ok"]  # the other server's call was not abandoned
    assert isinstance(error.value.__cause__, RuntimeError)


def test_errors_keep_a_value_error_and_one_naming_its_url_as_it_is_and_list_the_other_failures():
    named = VLLMServerError("The vLLM server at http://a:1 did not answer")

    def raise_(error):
        raise error

    with pytest.raises(ValueError, match="^The vLLM server at http://b:2: bad model$") as error:
        in_parallel(
            [("http://a:1", lambda: 1), ("http://b:2", lambda: raise_(ValueError("bad model"))), ("http://c:3", int)]
        )
    with pytest.raises(VLLMServerError) as error:
        in_parallel([("http://a:1", lambda: raise_(named)), ("http://b:2", lambda: raise_(ValueError("x")))])
    assert error.value is named and error.value.__notes__ == ["The vLLM servers at http://b:2 failed too."]
    with pytest.raises(ValueError, match="^The vLLM server at http://a:1: x$"):
        in_parallel([("http://a:1", lambda: raise_(ValueError("x"))), ("http://b:2", int)], parallel=False)
    # One server: its error exactly as without this module.
    with pytest.raises(KeyError):
        in_parallel([("http://a:1", lambda: raise_(KeyError("k")))])


INFO = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "dtype": "float32", "worker_extension": True}


def link(port, seed=None, info=None, **model_config):
    config = {"model_config": {"dtype": "float32", "max_model_len": 512, "logprobs_mode": "processed_logprobs"}}
    config["model_config"].update(model_config, seed=seed)
    client = SimpleNamespace(base_url=f"http://127.0.0.1:{port}")
    return ServerLink(client, config, dict(INFO if info is None else info))


@pytest.mark.parametrize(
    "other, message",
    [
        (link(2, dtype="bfloat16"), "--dtype: 'float32' at http://127.0.0.1:1, 'bfloat16' at http://127.0.0.1:2"),
        (link(2, max_model_len=256), "--max-model-len: 512 at"),
        (link(2, logprobs_mode="raw_logprobs"), "--logprobs-mode"),
        (link(2, info={**INFO, "vocab_size": 101}), "model_info.vocab_size: 100 at"),
        (link(2, info={**INFO, "max_lora_rank": 8}), "model_info.max_lora_rank: None at"),
    ],
)
def test_servers_serving_differently_are_refused_naming_both(other, message):
    with pytest.raises(ValueError, match=f"servers at http://127.0.0.1:1 and http://127.0.0.1:2 differ .*{message}"):
        check_servers_alike([link(1, info={**INFO, "max_lora_rank": None}) if "lora" in message else link(1), other])


def test_servers_sharing_a_seed_are_warned_about(caplog):
    with caplog.at_level("WARNING"):
        check_servers_alike([link(1, seed=0), link(2, seed=1), link(3, seed=0)])
    assert "servers at http://127.0.0.1:1, http://127.0.0.1:3 were started with the same seed (0)" in caplog.text
    caplog.clear()
    without_config = ServerLink(SimpleNamespace(base_url="http://127.0.0.1:4"), None, dict(INFO))  # nothing to compare
    with caplog.at_level("WARNING"):
        check_servers_alike([link(1, seed=0), link(2, seed=1), link(3), without_config])
    assert "same seed" not in caplog.text


class StandInClient:
    """Answers /v1/completions as a server would: `n` samples per prompt, each [the prompt's last token, a token
    saying which server and which sample] with log-probs saying the same; records every request."""

    def __init__(self, index, delay):
        self.index, self.delay, self.base_url, self.requests = index, delay, f"http://127.0.0.1:{9000 + index}", []

    def complete(self, prompt_ids, n, sampling):
        self.requests.append(([list(p) for p in prompt_ids], n))
        time.sleep(self.delay)
        return [
            [{"token_ids": [p[-1], 40 + 4 * self.index + s], "logprobs": [-1.0, -float(self.index)]} for s in range(n)]
            for p in prompt_ids
        ]


def stand_in_backend(tokenizer, servers):
    backend = VLLMServerBackend.__new__(VLLMServerBackend)  # no real server: only what sampling reads
    backend.tokenizer, backend.eos_token_ids, backend.context, backend.sampling = tokenizer, [], None, {}
    backend.args = SimpleNamespace(max_prompt_length=None, chat_template_kwargs=None, max_completion_length=4)
    backend.accelerator = SimpleNamespace(device=torch.device("cpu"))
    backend.servers = [ServerLink(StandInClient(i, delay), None, {}) for i, delay in enumerate(servers)]
    return backend


def test_a_rollout_on_two_servers_keeps_groups_whole_and_rows_in_order(tiny_tokenizer):
    # Uneven groups (4, 4, 2, 4, 1): 15 rows; the first server answers last.
    texts = ["one plus one", "two plus two", "three", "four plus four", "five"]
    prompts = [text for text, size in zip(texts, [4, 4, 2, 4, 1]) for _ in range(size)]
    backend = stand_in_backend(tiny_tokenizer, servers=[0.3, 0.0])
    rollout = backend.generate(prompts)
    last_tokens = rollout.prompt_ids[:, -1]
    assert torch.equal(rollout.completion_ids[:, 0], last_tokens)  # each row answers its own prompt: order kept
    server_of_row = -rollout.sampling_logps[:, 1]
    starts = [0, 4, 8, 10, 14, 15]
    for start, end in zip(starts, starts[1:]):
        assert len(set(server_of_row[start:end].tolist())) == 1  # a group on one server
    # Consecutive shares near 15 / 2 rows: groups 0-1 (8 rows) to the first server, groups 2-4 (7 rows) to the second.
    assert server_of_row.tolist() == [0.0] * 8 + [1.0] * 7
    first, second = (link.client.requests for link in backend.servers)
    assert [n for _, n in first] == [4] and [sorted(n for _, n in second)] == [[1, 2, 4]]  # one request per group size
    # Within a group, the samples keep the server's order.
    assert rollout.completion_ids[:4, 1].tolist() == [40, 41, 42, 43]


def test_one_server_sends_what_it_always_sent(tiny_tokenizer):
    prompts = [text for text in ["one plus one", "two"] for _ in range(4)]
    backend = stand_in_backend(tiny_tokenizer, servers=[0.0])
    rollout = backend.generate(prompts)
    (requests,) = [link.client.requests for link in backend.servers]
    assert len(requests) == 1 and len(requests[0][0]) == 2 and requests[0][1] == 4  # one request, n=4, two prompts
    assert torch.equal(rollout.completion_ids[:, 0], rollout.prompt_ids[:, -1])


def test_episode_turns_split_by_row_and_come_back_in_order(tiny_tokenizer):
    backend = stand_in_backend(tiny_tokenizer, servers=[0.2, 0.0, 0.1])
    prompt_ids = [[5, 6, 7 + row] for row in range(7)]
    rollout = backend.generate_from_ids(prompt_ids, max_new_tokens=3)
    assert rollout.completion_ids[:, 0].tolist() == [7 + row for row in range(7)]
    assert (-rollout.sampling_logps[:, 1]).tolist() == [0, 0, 1, 1, 1, 2, 2]  # 7 rows over 3 servers: 2, 3, 2


# --- two real servers ------------------------------------------------------------------------------------------------


def two_servers_config(tmp_path, server, second_server, **overrides):
    return vllm_config(tmp_path, server, vllm_server_base_url=[server["url"], second_server["url"]], **overrides)


def record_requests(backend):
    """Per server URL, (prompts, n) of every sampling request it got."""
    seen = {link.url: [] for link in backend.servers}
    for link in backend.servers:
        complete, url = link.client.complete, link.url
        link.client.complete = lambda ids, n, sampling, c=complete, u=url: (
            seen[u].append((len(ids), n)) or c(ids, n, sampling)
        )
    return seen


@pytest.mark.parametrize("setup", ["full", "lora adapter + KL", "full, http"])
@pytest.mark.slow  # two real vLLM servers
@pytest.mark.xdist_group("vllm_server")  # every real server on one worker
def test_two_servers_share_every_rollout_and_each_matches_the_trainer_after_every_sync(
    tmp_path, server, second_server, served_model_dir, setup
):
    """Each rollout's two groups go one to each server, in one request each; every sync reaches both, each through
    its own transport (the engine: a gloo group per server; or HTTP), the adapter to each from its own folder."""
    peft_config = (
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]) if "lora" in setup else None
    )
    args = two_servers_config(
        tmp_path,
        server,
        second_server,
        max_steps=6,
        steps_per_generation=2,  # 8 rows a rollout: 2 groups of 4
        learning_rate=3e-2 if peft_config else 1e-2,
        beta=0.05 if "KL" in setup else 0.0,
        vllm_weight_transport="http" if "http" in setup else "auto",
    )
    trainer = GSPOTrainer(
        served_model_dir, count_digits, args=args, train_dataset=text_dataset(), peft_config=peft_config
    )
    backend = trainer.rollout_backend
    assert [link.url for link in backend.servers] == [server["url"], second_server["url"]]
    assert [link.transport.name for link in backend.servers] == ["http" if "http" in setup else "engine"] * 2
    assert backend.servers[0].transport is not backend.servers[1].transport
    assert backend.servers[0].snapshot_dir != backend.servers[1].snapshot_dir
    if "http" not in setup:  # each server's workers joined a group of their own
        assert backend.servers[0].transport.group is not backend.servers[1].transport.group
    assert backend.sends_adapter == ("adapter" in setup)
    requests, syncs = record_requests(backend), record_syncs(trainer, every_server=True)
    trainer.train()
    # Three rollouts: each server got one group of 4 in one request per rollout.
    assert requests == {server["url"]: [(1, 4)] * 3, second_server["url"]: [(1, 4)] * 3}
    assert [step for step, _, _ in syncs] == [0, 2, 4]
    for step, served, ours in syncs:
        for url, theirs in zip(requests, served):
            torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0, msg=f"{url} after the sync at step {step}")
    assert all((a[1][1] - b[1][1]).abs().max() > 1e-3 for a, b in zip(syncs, syncs[1:]))  # the weights did change
    # The samples of both servers are the trainer's policy's: no mismatch to correct.
    logged = [entry for entry in trainer.state.log_history if "sampling/mismatch_kl" in entry]
    assert len(logged) == 6 and all(entry["sampling/mismatch_kl"] < 1e-6 for entry in logged)


@pytest.mark.slow  # two real vLLM servers
@pytest.mark.xdist_group("vllm_server")  # every real server on one worker
def test_a_seeded_request_samples_each_prompt_alike_on_one_server_or_split_over_two(
    tmp_path, server, second_server, served_model_dir
):
    """With a seed in generation_kwargs, vLLM draws a prompt's samples from it alone: the split changes none."""
    args = two_servers_config(tmp_path, server, second_server, max_completion_length=16, generation_kwargs={"seed": 7})
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    backend = trainer.rollout_backend
    backend.update_weights(trainer.model, 0)
    prompts = [p for p in ["What is 1 + 2?", "Reply with 7.", "Count to three.", "Say hi."] for _ in range(4)]
    requests, servers = record_requests(backend), backend.servers
    split = backend.generate(prompts)
    assert requests == {server["url"]: [(2, 4)], second_server["url"]: [(2, 4)]}  # two whole groups each
    backend.servers = servers[:1]
    first_alone = backend.generate(prompts)
    backend.servers = servers[1:]
    second_alone = backend.generate(prompts)
    backend.servers = servers
    assert len({tuple(row.tolist()) for row in split.completion_ids[:4]}) > 1  # a group's samples differ
    for alone in (first_alone, second_alone):
        assert torch.equal(split.completion_ids, alone.completion_ids)
        # Same tokens, same weights: the log-probs agree up to the kernels' float32 rounding in another batch.
        torch.testing.assert_close(split.sampling_logps, alone.sampling_logps, atol=1e-4, rtol=0)


@pytest.mark.slow  # two real vLLM servers
@pytest.mark.xdist_group("vllm_server")  # every real server on one worker
def test_a_server_that_is_gone_is_named_at_construction_and_mid_run(tmp_path, server, second_server, served_model_dir):
    gone = f"http://127.0.0.1:{free_port()}"
    args = vllm_config(tmp_path, server, vllm_server_base_url=[server["url"], gone], vllm_server_timeout=2)
    with pytest.raises(VLLMServerError, match=f"No vLLM server answered at {gone}/health"):
        GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=two_servers_config(tmp_path, server, second_server),
        train_dataset=text_dataset(),
    )
    backend = trainer.rollout_backend
    backend.update_weights(trainer.model, 0)
    client = backend.servers[1].client
    client.base_url, client.retries = gone, 0  # as if the second server had stopped
    with pytest.raises(VLLMServerError, match=f"The vLLM server at {gone} did not answer POST /v1/completions"):
        backend.generate(["What is 1 + 2?"] * 4 + ["Say hi."] * 4)
    with pytest.raises(VLLMServerError, match=f"The vLLM server at {gone} did not answer POST /pause"):
        backend.update_weights(trainer.model, 1)
    assert backend.servers[0].client.prompt_logprobs(FIXED_TEXT)  # the other server still serves, resumed
