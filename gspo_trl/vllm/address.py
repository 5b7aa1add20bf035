"""Where the vLLM servers are: each base URL checked (or one built from host and port), a list of servers read from a
list or a comma-separated string, and whether an address is loopback.

Pure standard library, so the config's checks, `gspo-trl vllm-serve` and the client share one reading of an
address. What it does not own: talking to the server (`client`), the token (`auth`).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

EXAMPLE = "http://127.0.0.1:8000"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 literal in a URL


def check_base_url(url, field: str = "vllm_server_base_url") -> str:
    """`url` as the client uses it (no trailing slash), or a ValueError naming `field` and what to write instead:
    the scheme (http or https), a host and an explicit port, nothing after them (the client adds /v1 itself)."""
    if not isinstance(url, str):
        raise TypeError(f"{field} must be a string like {EXAMPLE!r}, got {type(url).__name__}.")
    stripped = url.strip()
    head = f"{field}={url!r}"
    if stripped != url or any(char.isspace() for char in url):
        raise ValueError(f"{head} holds whitespace: write the URL alone, like {EXAMPLE!r}.")
    if "://" not in url:
        raise ValueError(f"{head} has no scheme: write it as 'http://{url}' (the form is {EXAMPLE!r}).")
    try:
        parts = urlsplit(url)
    except ValueError as error:  # an unbalanced bracket
        raise ValueError(f"{head}: {error} (an IPv6 address goes in brackets: 'http://[::1]:8000').") from None
    if parts.username is not None or parts.password is not None:  # named before anything repeats the URL
        raise ValueError(
            f"{field} holds credentials (user:password@): drop them from the URL and pass the server's token as "
            "vllm_server_token (or the GSPO_TRL_VLLM_TOKEN environment variable)."
        )
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{head}: the scheme must be http or https (the form is {EXAMPLE!r}).")
    if not parts.hostname:
        brackets = " (an IPv6 address goes in brackets: 'http://[::1]:8000')" if "::" in parts.netloc else ""
        raise ValueError(f"{head} has no host{brackets} (the form is {EXAMPLE!r}).")
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ValueError(f"{head}: the port must be a number from 1 to 65535 (the form is {EXAMPLE!r}).")
    if port is None:
        raise ValueError(
            f"{head} names no port: write it, e.g. '{parts.scheme}://{parts.netloc}:8000' (`gspo-trl vllm-serve`'s "
            "default port), or :80 / :443 for a server behind a proxy."
        )
    path = parts.path.rstrip("/")
    if path or parts.query or parts.fragment:
        hint = " (the client adds /v1 to the paths that need it)" if path.endswith("/v1") else ""
        raise ValueError(
            f"{head} has a path, query or fragment after the port{hint}: give the server's root, like "
            f"'{parts.scheme}://{parts.netloc}'."
        )
    return f"{parts.scheme.lower()}://{parts.netloc}"


def check_base_urls(value, field: str = "vllm_server_base_url") -> list[str]:
    """The servers' URLs as the clients use them: `value` is one URL, several separated by commas, or a list of URLs.
    A ValueError (or TypeError) names `field`, the entry at fault (`field[i]`) and what to write instead; the same
    server named twice is refused (it would get two shares of every rollout and every sync twice)."""
    if isinstance(value, str) and "," in value:
        entries = [entry.strip() for entry in value.split(",")]
    elif isinstance(value, (list, tuple)):
        entries = list(value)
    else:
        return [check_base_url(value, field)]  # one URL: checked and named exactly as before
    if not entries:
        raise ValueError(f"{field} is an empty list: name at least one server, like [{EXAMPLE!r}].")
    urls: list[str] = []
    for index, entry in enumerate(entries):
        if entry == "":
            raise ValueError(
                f"{field}={value!r} has an empty entry at position {index}: separate the URLs with single commas, "
                f"like '{EXAMPLE},http://127.0.0.1:8001'."
            )
        url = check_base_url(entry, f"{field}[{index}]")
        earlier = next((i for i, seen in enumerate(urls) if _server_key(seen) == _server_key(url)), None)
        if earlier is not None:
            raise ValueError(
                f"{field} names the server {url} twice (entries {earlier} and {index}): list each server once."
            )
        urls.append(url)
    return urls


def _server_key(url: str) -> tuple:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def base_url(host: str, port: int, fields: tuple[str, str] = ("vllm_server_host", "vllm_server_port")) -> str:
    """The base URL of a server at `host`:`port` (checked, naming `fields`)."""
    if isinstance(host, str) and "," in host:
        raise ValueError(
            f"{fields[0]}={host!r} names several hosts: {fields[0]} and {fields[1]} name one server; list several "
            "servers' URLs in vllm_server_base_url instead, e.g. 'http://10.0.0.7:8000,http://10.0.0.8:8000'."
        )
    if not isinstance(host, str) or not host.strip() or "/" in host or any(char.isspace() for char in host):
        raise ValueError(
            f"{fields[0]}={host!r} must be a host name or an IP address alone (no scheme, path or spaces), e.g. "
            "'127.0.0.1'; or set vllm_server_base_url."
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"{fields[1]}={port!r} must be an integer from 1 to 65535.")
    host = host.strip("[]")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"{fields[0]}={host!r} holds a ':' but is no IPv6 address: give the port as {fields[1]}."
            ) from None
    return f"http://{_bracketed(host)}:{port}"


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface
