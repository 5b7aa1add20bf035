"""A real vLLM server after a trainer fails: a killed run's snapshot removed by the next, a trainer killed in the
middle of an engine sync, and a sync that fails half-way; each time the next trainer takes the server over."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from helpers import count_digits, text_dataset, worker_env
from real_vllm_servers import FIXED_TEXT, bearer, record_syncs, trainer_logprobs, vllm_config

from gspo_trl import GSPOTrainer
from gspo_trl.vllm.auth import TOKEN_ENV
from gspo_trl.vllm.client import VLLMServerError

pytestmark = pytest.mark.xdist_group(
    "vllm_server"
)  # every real server on one worker (tests/rollout/real_vllm_servers.py)


KILLED_RUN = """
import sys
from helpers import count_digits, small_config, text_dataset
from gspo_trl import GSPOTrainer
model, url, sync_dir, out, transport = sys.argv[1:6]
args = small_config(
    out, use_vllm=True, vllm_server_base_url=url, vllm_weight_sync_dir=sync_dir, vllm_weight_transport=transport,
    max_steps=10000,
)
trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=text_dataset())
print("SNAPSHOT", trainer.rollout_backend.snapshot_dir, flush=True)
trainer.train()
"""


@pytest.mark.parametrize("transport", ["http", "engine"])
@pytest.mark.slow  # the real vLLM server, two training processes
def test_a_killed_runs_snapshot_is_removed_by_the_next_and_sigterm_removes_its_own(
    tmp_path, server, served_model_dir, transport
):
    """The next run trains on the server a killed run left (wherever the kill landed: the engine's sync included)."""
    sync_dir = tmp_path / "sync"  # the trainers' snapshot folders (the server cannot read it: weights do not go there)
    tests_dir = str(Path(__file__).parents[1])
    env = {**worker_env(), TOKEN_ENV: server["token"]}
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, str(Path(tests_dir).parent), env.get("PYTHONPATH", "")])

    processes = []

    def start(name):
        process = subprocess.Popen(
            [sys.executable, "-c", KILLED_RUN, served_model_dir, server["url"], str(sync_dir), str(tmp_path / name)]
            + [transport],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        processes.append(process)
        lines = iter(process.stdout.readline, "")
        folder = next((line.split()[1] for line in lines if line.startswith("SNAPSHOT ")), None)
        assert folder and os.path.isdir(folder), f"run {name} made no snapshot folder (exit {process.poll()})"
        return process, folder

    try:
        killed, killed_folder = start("killed")
        time.sleep(5)  # into training: the first rollout's sync
        killed.kill()
        killed.wait(timeout=60)
        assert os.path.isdir(killed_folder)  # SIGKILL runs no cleanup: what a killed run leaves behind
        stopped, stopped_folder = start("stopped")
        assert not os.path.exists(killed_folder)  # removed as the next run made its own
        time.sleep(5)
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(timeout=60) == -signal.SIGTERM  # it still ends as SIGTERM ends it
        assert not os.path.exists(stopped_folder)
        assert os.listdir(sync_dir) == []
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=60)


KILLED_DURING_SYNC = """
import os, signal, sys
import torch
from helpers import count_digits, small_config, text_dataset
from gspo_trl import GSPOTrainer
from gspo_trl.vllm import collective, engine_transport
model, url, out, where = sys.argv[1:5]
# a sync folder the server does not read: the buffers go through the group (else through files in /dev/shm)
sync_dir = out + "/unseen" if where.endswith("through the group") else None
args = small_config(
    out, use_vllm=True, vllm_server_base_url=url, vllm_weight_transport="engine", vllm_weight_sync_dir=sync_dir
)
trainer = GSPOTrainer(model, count_digits, args=args, train_dataset=text_dataset())
assert (trainer.rollout_backend.transport.shared is None) == (sync_dir is not None)
torch.manual_seed(1)
with torch.no_grad():  # weights no later trainer sends: any the server kept would show in its log-probs
    for param in trainer.model.parameters():
        param.add_(torch.randn_like(param))
engine_transport.BUFFER_BYTES = 1  # one layer per buffer: the sync dies with some layers loaded and others not


def die():
    print("KILLED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if where.startswith("in the broadcast"):  # the server's worker is receiving: two buffers went out, the next awaited
    broadcast, sent = collective._broadcast, []

    def broadcast_then_die(group, buffer):
        work = broadcast(group, buffer)
        sent.append(work)
        if len(sent) == 2:
            work.wait()
            die()
        return work

    collective._broadcast = broadcast_then_die
else:  # "between requests": the update started (every layer waits for its weights), no weight announced yet
    trainer.rollout_backend.client.update_weights = lambda update_info: die()
trainer.rollout_backend.update_weights(trainer.model, 0)
"""


@pytest.mark.parametrize("where", ["in the broadcast", "in the broadcast, through the group", "between requests"])
@pytest.mark.slow  # the real vLLM server, a second training process
def test_a_trainer_killed_during_an_engine_sync_leaves_the_server_to_the_next(
    tmp_path, server, served_model_dir, where, caplog
):
    """A trainer SIGKILLed in the middle of a sync through the weight-transfer engine leaves the server paused, with
    an update started and some layers waiting for weights; the next trainer takes the server over: its syncs
    complete, and the server then computes the new trainer's log-probs (none of the dead one's weights is left)."""
    tests_dir = str(Path(__file__).parents[1])
    env = {**worker_env(), TOKEN_ENV: server["token"]}
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, str(Path(tests_dir).parent), env.get("PYTHONPATH", "")])
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_SYNC, served_model_dir, server["url"], str(tmp_path / "killed"), where],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL and "KILLED" in killed.stdout, killed.stderr[-3000:]
    paused = requests.get(f"{server['url']}/is_paused", headers=bearer(server["token"]), timeout=30).json()
    assert paused == {"is_paused": True}  # as the dead trainer left it: the next one's sync resumes it
    trainer = GSPOTrainer(
        served_model_dir,
        count_digits,
        args=vllm_config(tmp_path, server, max_steps=4, steps_per_generation=2, learning_rate=1e-2),
        train_dataset=text_dataset(),
    )
    assert trainer.rollout_backend.transport.name == "engine"
    syncs = record_syncs(trainer)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert [step for step, _, _ in syncs] == [0, 2]
    for step, server_logps, trainer_logps in syncs:
        torch.testing.assert_close(server_logps, trainer_logps, atol=1e-4, rtol=0, msg=f"after the sync at step {step}")
    assert (syncs[0][1] - syncs[1][1]).abs().max() > 1e-3  # the server's model did change between the two
    if where == "between requests":  # vLLM still thought the update active: the new trainer undid it, and said so
        assert "never finished" in caplog.text


@pytest.mark.slow  # the real vLLM server
def test_a_sync_that_fails_half_way_leaves_the_server_paused_and_the_next_one_completes(
    tmp_path, server, served_model_dir, monkeypatch
):
    """A live trainer whose engine sync fails after some layers were sent: the error says so, the server undid the
    rest and stays paused (never sampling from half-loaded weights unnoticed), and the next sync brings it to the
    trainer's weights and resumes it."""
    from gspo_trl.vllm import engine_transport

    args = vllm_config(tmp_path, server)
    trainer = GSPOTrainer(served_model_dir, count_digits, args=args, train_dataset=text_dataset())
    backend = trainer.rollout_backend
    assert backend.transport.name == "engine"
    real_chunks = engine_transport.weight_chunks

    def failing_chunks(weights, max_bytes):  # the first chunk reaches the server, then the trainer fails
        chunks = real_chunks(weights, max_bytes)
        yield next(chunks)
        raise RuntimeError("a gather failed")

    monkeypatch.setattr(engine_transport, "CHUNK_BYTES", 1)  # a layer per chunk
    monkeypatch.setattr(engine_transport, "weight_chunks", failing_chunks)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    with pytest.raises(VLLMServerError, match="failed half-way: a gather failed.*put back.*stays paused"):
        backend.update_weights(trainer.model, 0)
    is_paused = requests.get(f"{server['url']}/is_paused", headers=bearer(server["token"]), timeout=30).json()
    assert is_paused == {"is_paused": True} and backend.synced_step is None
    monkeypatch.setattr(engine_transport, "weight_chunks", real_chunks)
    backend.update_weights(trainer.model, 0)
    is_paused = requests.get(f"{server['url']}/is_paused", headers=bearer(server["token"]), timeout=30).json()
    assert is_paused == {"is_paused": False}
    server_logps = torch.tensor(backend.client.prompt_logprobs(FIXED_TEXT))
    torch.testing.assert_close(server_logps, trainer_logprobs(trainer, FIXED_TEXT), atol=1e-4, rtol=0)
