"""Tests of clients/library/targets.py: the target forms that name one or several replicas, and the
channel arguments that spread streams over them."""

from __future__ import annotations

import argparse
import json

import pytest

from clients.library.grpc_client import BALANCED_CHANNEL_ARGS, CHANNEL_ARGS
from clients.library.targets import parse_target, target_option


@pytest.mark.parametrize(
    ("text", "uri", "replicas"),
    [
        ("127.0.0.2:8001", "127.0.0.2:8001", ["127.0.0.2:8001"]),
        ("ipv4:127.0.0.2:8001,127.0.0.3:8001", None, ["127.0.0.2:8001", "127.0.0.3:8001"]),
        ("127.0.0.2:8001, 127.0.0.3:9001", "ipv4:127.0.0.2:8001,127.0.0.3:9001", None),
        ("ipv6:[::1]:8001", "ipv6:[::1]:8001", ["[::1]:8001"]),
        ("[::1]:8001,[::1]:8002", "ipv6:[::1]:8001,[::1]:8002", ["[::1]:8001", "[::1]:8002"]),
        ("dns:///localhost:8001", None, None),
        ("dns://8.8.8.8/triton.example:8001", None, None),
    ],
)
def test_accepted_forms(text, uri, replicas):
    """Each accepted form keeps (or gets) gRPC's own spelling; lists name their replicas."""
    target = parse_target(text)
    assert target.uri == (uri or text)
    if replicas is not None:
        assert target.replicas() == replicas


def test_a_name_is_resolved_on_every_call():
    """dns:/// and host:port targets resolve their name: localhost gives loopback addresses."""
    for text in ("dns:///localhost:8001", "localhost:8001"):
        target = parse_target(text)
        assert not target.is_list and target.hosts() == ["localhost"]
        assert "127.0.0.1:8001" in target.replicas()
    assert parse_target("dns:///no-such-host.invalid:8001").replicas() == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("127.0.0.2", "HOST:PORT"),
        ("127.0.0.2:0", "HOST:PORT"),
        ("127.0.0.2:http", "HOST:PORT"),
        ("host-a:8001,host-b:8001", "IP addresses"),
        ("ipv4:127.0.0.2:8001,[::1]:8001", "one family"),
        ("ipv6:127.0.0.2:8001", "one family"),
        ("::1:8001", "brackets"),
        ("dns:///:8001", "HOST:PORT"),
    ],
)
def test_bad_targets_say_what_is_wrong(text, message):
    """A malformed target is refused with a message naming the problem."""
    with pytest.raises(ValueError, match=message):
        parse_target(text)
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        target_option(text)


def test_channel_args_keep_the_defaults_and_add_round_robin():
    """tritonclient's channel_args replace its defaults: ours keep the message limits and the
    reconnect backoff, and add round_robin and a short DNS re-resolution interval."""
    args = dict(BALANCED_CHANNEL_ARGS)
    assert all(args[key] == value for key, value in CHANNEL_ARGS)
    assert args["grpc.max_receive_message_length"] == 2**31 - 1
    config = json.loads(args["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert args["grpc.dns_min_time_between_resolutions_ms"] <= 1000
