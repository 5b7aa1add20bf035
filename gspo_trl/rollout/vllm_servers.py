"""Several vLLM servers behind one `VLLMServerBackend`: what is known of each, a rollout's groups split among them,
calls to all of them at once, and the check that they serve alike.

A group (the `num_generations` samples of one prompt) always goes to one server, the servers get consecutive shares
of the prompts, and their answers are put back in the prompts' order, so a rollout has the rows one server would
have returned. Every request carries the same sampling fields as with one server; none carries a seed (the CPU build
kills its engine on seeded requests, see `vllm_server.generate`, and `layout_independent_sampling` is refused with
vLLM), so each server samples from its own random state and a prompt's samples have the same distribution wherever
it goes. A seed in `generation_kwargs` travels with every request to every server alike: vLLM then draws a prompt's
samples from that seed alone (seed + the sample's index), so which server drew them does not change them either.
Servers started with the same `--seed` start from the same random state and can draw the same random numbers for
requests of the same shapes, which would tie the samples of different prompts together: `check_servers_alike` warns.
What it does not own: one server's requests and weight sync (`vllm_server`), the wire format (`vllm.client`), the
transports (`vllm.transport`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers.utils import logging

from ..vllm.client import VLLMServerClient, VLLMServerError

logger = logging.get_logger(__name__)

T = TypeVar("T")

# The settings of a server's vLLM config (`/server_info`) that shape what a request returns: they must agree.
COMPARED_SETTINGS = ("dtype", "max_model_len", "logprobs_mode", "quantization")


@dataclass
class ServerLink:
    """One server: its client, its vLLM config (None where it does not expose one), the served model as the client
    describes it (`model_info`), and, once chosen, the transport the weights take to it and that transport's folder."""

    client: VLLMServerClient
    config: dict | None
    info: dict
    transport: Any = None
    snapshot_dir: str | None = None

    @property
    def url(self) -> str:
        return self.client.base_url


def describe_server(client: VLLMServerClient) -> ServerLink:
    """Wait for the server, then read its served model's name, vLLM config and model description."""
    client.wait_until_ready()
    client.served_model()
    config = client.server_config()  # the weight-transfer engine, if any, is named in it
    return ServerLink(client, config, client.model_info(config))


def split_groups(sizes: Sequence[int], parts: int) -> list[range]:
    """Consecutive ranges of group indices, one per server, covering every group once in order: range k ends at the
    group edge nearest to (k + 1) / parts of all samples (`sizes`: samples per group), the later edge on a tie. Uneven
    groups give near-even shares; with fewer groups than servers, some ranges are empty."""
    if parts < 1:
        raise ValueError(f"split_groups needs at least one part, got {parts}.")
    before = [0, *itertools.accumulate(sizes)]  # before[i]: samples in the groups before group i
    total, edges = before[-1], [0]
    for part in range(1, parts):
        target = total * part / parts
        at = bisect.bisect_left(before, target, lo=edges[-1])  # the first edge at or past the target
        if at > edges[-1] and target - before[at - 1] < before[at] - target:
            at -= 1  # the edge before it is nearer
        edges.append(at)
    edges.append(len(sizes))
    return [range(start, end) for start, end in zip(edges, edges[1:])]


def in_parallel(tasks: Sequence[tuple[str, Callable[[], T]]], parallel: bool = True) -> list[T]:
    """Run each `(server URL, call)`, each in its own thread (`parallel`, and more than one), else one after the other
    in order; return their results in order. With several servers, an error that does not name its server's URL is
    raised again with it (a ValueError stays one, anything else becomes a `VLLMServerError`); when several fail, the
    first in order is raised, once every call has ended, and names the others."""
    if len(tasks) == 1:
        return [tasks[0][1]()]  # one server: its errors as they are
    if not parallel:
        results = []
        for url, call in tasks:
            try:
                results.append(call())
            except Exception as error:
                named = _naming(url, error)
                if named is error:
                    raise
                raise named from error
        return results
    with ThreadPoolExecutor(max_workers=len(tasks), thread_name_prefix="gspo-vllm-server") as pool:
        futures = [pool.submit(call) for _, call in tasks]
        wait(futures)  # every call ends before anything is raised: none is left running against its server
    failed = [(url, future.exception()) for (url, _), future in zip(tasks, futures) if future.exception() is not None]
    if failed:
        url, error = failed[0]
        named = _naming(url, error)
        if len(failed) > 1:
            named.add_note(f"The vLLM servers at {', '.join(u for u, _ in failed[1:])} failed too.")
        if named is error:
            raise error
        raise named from error
    return [future.result() for future in futures]


def _naming(url: str, error: Exception) -> Exception:
    if url in str(error):
        return error
    kind = ValueError if isinstance(error, ValueError) else VLLMServerError
    return kind(f"The vLLM server at {url}: {error}")


def gathers_collectively(model: torch.nn.Module) -> bool:
    """Whether the weights are gathered by collectives every process joins (ZeRO-3, FSDP2): the syncs to several
    servers then run one after the other on every process, so that the gathers pair up."""
    return any(getattr(p, "ds_status", None) is not None or hasattr(p, "full_tensor") for p in model.parameters())


def server_settings(link: ServerLink) -> dict:
    """What must agree between servers: the served model as described (`model_info`), and `COMPARED_SETTINGS` of
    the vLLM config where the server exposes it."""
    model_config = (link.config or {}).get("model_config") or {}
    settings = {f"model_info.{name}": value for name, value in link.info.items()}
    if link.config is not None:
        settings.update({f"--{name.replace('_', '-')}": model_config.get(name) for name in COMPARED_SETTINGS})
    return settings


def check_servers_alike(links: Sequence[ServerLink]) -> None:
    """Every server serves the first one's model with its settings (a ValueError names both servers and what
    differs); a warning where two servers share a seed."""
    first = server_settings(links[0])
    for link in links[1:]:
        theirs = server_settings(link)
        differ = [
            f"{name}: {first[name]!r} at {links[0].url}, {theirs[name]!r} at {link.url}"
            for name in first
            if name in theirs and theirs[name] != first[name]
        ]
        if differ:
            raise ValueError(
                f"The vLLM servers at {links[0].url} and {link.url} differ ({'; '.join(differ)}): every server of a "
                "run must serve the trained model's checkpoint with the same settings. Start them with the same "
                "command, but for --port and --seed."
            )
    seeds: dict[Any, list[str]] = {}
    for link in links:
        seed = ((link.config or {}).get("model_config") or {}).get("seed")
        if seed is not None:
            seeds.setdefault(seed, []).append(link.url)
    shared = {seed: urls for seed, urls in seeds.items() if len(urls) > 1}
    if shared:
        seed, urls = next(iter(shared.items()))
        logger.warning(
            f"The vLLM servers at {', '.join(urls)} were started with the same seed ({seed}): they can draw the same "
            "random numbers for requests of the same shapes, which would tie the samples of different prompts "
            "together. Start each server with its own --seed."
        )
