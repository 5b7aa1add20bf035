"""Tests for gspo_trl.vllm.address: the server's URL (or host and port) checked at the config's construction, and
which addresses are loopback."""

import pytest

from gspo_trl import GSPOConfig
from gspo_trl.vllm.address import base_url, check_base_url, check_base_urls, is_loopback


@pytest.mark.parametrize(
    "url, expected",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("HTTPS://vllm.example.com:443", "https://vllm.example.com:443"),
        ("http://[::1]:8000", "http://[::1]:8000"),
    ],
)
def test_a_well_formed_url_is_kept_without_its_trailing_slash(url, expected):
    assert check_base_url(url) == expected


MALFORMED = [
    ("127.0.0.1:8000", "no scheme: write it as 'http://127.0.0.1:8000'"),
    ("localhost:8000", "no scheme"),
    ("//127.0.0.1:8000", "no scheme"),
    ("ftp://127.0.0.1:8000", "scheme must be http or https"),
    ("http://127.0.0.1:8000/v1", "path.*adds /v1"),
    ("http://127.0.0.1:8000/v1/", "path.*adds /v1"),
    ("http://127.0.0.1:8000/api", "path"),
    ("http://127.0.0.1:8000?x=1", "query"),
    ("http://127.0.0.1:8000#top", "fragment"),
    ("http://127.0.0.1:80000", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1:0", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1:", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1:port", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1", "names no port: write it, e.g. 'http://127.0.0.1:8000'"),
    ("http://:8000", "no host"),
    ("http://", "no host"),
    ("", "no scheme"),
    (" http://127.0.0.1:8000", "whitespace"),
    ("http://127.0.0.1:8000\n", "whitespace"),
    ("http://user:pw@127.0.0.1:8000", "credentials.*vllm_server_token"),
    ("http://::1:8000", "no host .an IPv6 address goes in brackets"),
    ("http://[::1:8000", "IPv6 address goes in brackets"),
]


@pytest.mark.parametrize("url, message", MALFORMED)
def test_a_malformed_url_is_a_value_error_naming_the_field(url, message):
    with pytest.raises(ValueError, match=f"vllm_server_base_url.*{message}"):
        check_base_url(url)


@pytest.mark.parametrize("url", ["http://user:hunter2@127.0.0.1:8000", "ftp://user:hunter2@127.0.0.1:8000/v1"])
def test_credentials_are_not_repeated_in_the_error(url):
    with pytest.raises(ValueError, match="credentials") as error:
        check_base_url(url)
    assert "hunter2" not in str(error.value)


@pytest.mark.parametrize("url, message", MALFORMED[:3] + MALFORMED[4:5] + MALFORMED[9:10] + MALFORMED[13:14])
def test_the_config_refuses_a_malformed_url_at_construction(tmp_path, url, message):
    with pytest.raises(ValueError, match=f"vllm_server_base_url.*{message}"):
        GSPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_server_base_url=url)
    # Not read when the server is not used (colocate mode, or no vLLM at all).
    GSPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=False, vllm_server_base_url=url)


@pytest.mark.parametrize(
    "host, port, message",
    [
        ("http://127.0.0.1", 8000, "vllm_server_host='http://127.0.0.1' must be a host name or an IP address alone"),
        ("127.0.0.1:8000", 8000, "vllm_server_host=.* no IPv6 address: give the port as vllm_server_port"),
        ("", 8000, "vllm_server_host='' must be"),
        ("my host", 8000, "vllm_server_host='my host' must be"),
        ("127.0.0.1", 0, "vllm_server_port=0 must be an integer from 1 to 65535"),
        ("127.0.0.1", 65536, "vllm_server_port=65536"),
    ],
)
def test_the_config_refuses_a_malformed_host_or_port_at_construction(tmp_path, host, port, message):
    with pytest.raises(ValueError, match=message):
        GSPOConfig(
            output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_server_host=host, vllm_server_port=port
        )


def test_host_and_port_make_the_url_with_ipv6_in_brackets():
    assert base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert base_url("::1", 8001) == "http://[::1]:8001" == base_url("[::1]", 8001)
    assert base_url("0.0.0.0", 8000) == "http://0.0.0.0:8000"  # TRL's default host: this machine, as a client


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.1.2.3", False),
        ("myhost", False),
    ],  # fmt: skip
)
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


# --- several servers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "http://127.0.0.1:8000,http://10.0.0.7:8001/",
        "http://127.0.0.1:8000, http://10.0.0.7:8001",
        ["http://127.0.0.1:8000", "http://10.0.0.7:8001/"],
        ("http://127.0.0.1:8000", "http://10.0.0.7:8001"),
    ],
)
def test_several_servers_are_a_list_or_comma_separated(value):
    assert check_base_urls(value) == ["http://127.0.0.1:8000", "http://10.0.0.7:8001"]


def test_one_server_reads_as_before():
    assert (
        check_base_urls("http://127.0.0.1:8000/")
        == ["http://127.0.0.1:8000"]
        == check_base_urls(["http://127.0.0.1:8000"])
    )
    with pytest.raises(ValueError, match=r"^vllm_server_base_url='127.0.0.1:8000' has no scheme"):
        check_base_urls("127.0.0.1:8000")  # the field's own name, as with one URL before


@pytest.mark.parametrize(
    "value, error, message",
    [
        (
            "http://127.0.0.1:8000,127.0.0.1:8001",
            ValueError,
            r"vllm_server_base_url\[1\]='127.0.0.1:8001' has no scheme",
        ),
        (["http://127.0.0.1:8000", "http://h:8001/v1"], ValueError, r"vllm_server_base_url\[1\]=.* path.*adds /v1"),
        (["http://127.0.0.1:8000", 8001], TypeError, r"vllm_server_base_url\[1\] must be a string"),
        ("http://127.0.0.1:8000,", ValueError, "empty entry at position 1"),
        ("http://127.0.0.1:8000,,http://127.0.0.1:8001", ValueError, "empty entry at position 1"),
        ([], ValueError, "vllm_server_base_url is an empty list"),
        (
            "http://127.0.0.1:8000,http://10.0.0.7:8000,http://127.0.0.1:8000/",
            ValueError,
            r"names the server http://127.0.0.1:8000 twice \(entries 0 and 2\)",
        ),
        (["http://Host.example:8000", "HTTP://host.EXAMPLE:8000"], ValueError, "twice"),
    ],
)
def test_a_bad_server_list_is_refused_naming_the_entry(tmp_path, value, error, message):
    with pytest.raises(error, match=message):
        check_base_urls(value)
    with pytest.raises(error, match=message):
        GSPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_server_base_url=value)


def test_the_config_keeps_a_server_list_as_given(tmp_path):
    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    config = GSPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_server_base_url=urls)
    assert config.vllm_server_base_url == urls
    text = "http://127.0.0.1:8000,http://127.0.0.1:8001"
    config = GSPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_server_base_url=text)
    assert config.vllm_server_base_url == text  # TRL's field, untouched: the backend reads it


def test_the_command_line_takes_several_servers_comma_separated(tmp_path):
    from transformers import HfArgumentParser

    text = "http://127.0.0.1:8000,http://127.0.0.1:8001"
    (config,) = HfArgumentParser(GSPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--use_vllm", "--vllm_server_base_url", text]
    )
    assert check_base_urls(config.vllm_server_base_url) == text.split(",")


def test_host_and_port_name_one_server(tmp_path):
    with pytest.raises(ValueError, match="names several hosts.*list several servers' URLs in vllm_server_base_url"):
        GSPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_server_host="10.0.0.7,10.0.0.8")


def test_a_fixed_group_port_leaves_room_for_every_server(tmp_path):
    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    fields = dict(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_server_base_url=urls)
    GSPOConfig(**fields, vllm_group_port=65533)  # 65533, 65534, 65535
    with pytest.raises(ValueError, match="vllm_group_port=65534 with 3 servers.*up to 65536, past 65535"):
        GSPOConfig(**fields, vllm_group_port=65534)
