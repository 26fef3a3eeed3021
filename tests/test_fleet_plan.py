"""A fleet profile's layout (sm120kit.fleet.plan): the replicas' GPUs, ports and URLs, and
every layout mistake refused before anything starts, with the key and the fix."""

from __future__ import annotations

import pytest
from support.standin import PROFILES

from sm120kit.errors import UserError
from sm120kit.fleet.plan import plan
from sm120kit.profiles.loader import load_profile


def fleet(*sets: str, name: str = "standin-fleet"):
    return load_profile(name, [str(PROFILES)], ["server.port=30000", *sets])


def test_replicas_take_the_next_gpus_and_ports_after_the_router():
    layout = plan(fleet())
    assert [(r.name, r.gpus, r.port, r.url) for r in layout.replicas] == [
        ("replica-0", (0,), 30001, "http://127.0.0.1:30001"),
        ("replica-1", (1,), 30002, "http://127.0.0.1:30002"),
        ("replica-2", (2,), 30003, "http://127.0.0.1:30003"),
    ]
    assert layout.router_url == "http://127.0.0.1:30000"
    assert layout.router_options == {"policy": "round_robin"}
    one = layout.replicas[1].profile
    assert one.fleet is None and one.server.port == 30002 and one.node.gpus == 1
    assert one.env["CUDA_VISIBLE_DEVICES"] == "1" and one.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_the_fleets_address_is_server_port_and_fleet_router_port_may_only_repeat_it():
    profile = fleet("fleet.router.port=30000")
    assert profile.server.port == 30000 and "port" not in profile.fleet.router
    with pytest.raises(UserError) as caught:  # both given, and they differ: which one is meant?
        fleet("fleet.router.port=31000")
    assert "fleet.router.port = 31000 and server.port = 30000" in caught.value.message
    assert [r.port for r in plan(fleet("server.port=31000")).replicas] == [31001, 31002, 31003]


def test_listed_replicas_keep_their_gpus_ports_and_urls():
    profile = fleet(
        "node.gpus=8",
        "parallel.tp=2",
        'fleet.replica=[{gpus="4,5", port=31000}, {port=31010}, {url="http://10.0.0.9:30001"}]',
        "fleet.replicas=3",
    )
    r0, r1, r2 = plan(profile).replicas
    assert (r0.gpus, r0.port, r0.here) == ((4, 5), 31000, True)
    assert (r1.gpus, r1.port) == ((0, 1), 31010)  # the first GPUs no listed replica took
    assert (r2.url, r2.here, r2.profile) == ("http://10.0.0.9:30001", False, None)


def test_a_replica_on_another_node_is_routed_to_not_started():
    sets = ['fleet.replica=[{port=30001}, {node="10.255.0.7", port=30001}]', "fleet.replicas=2"]
    with pytest.raises(UserError) as caught:  # bound to loopback there, the router here could not reach it
        plan(fleet(*sets))
    assert "fleet.replica_host = '127.0.0.1'" in caught.value.message
    r0, r1 = plan(fleet(*sets, "fleet.replica_host=0.0.0.0", "server.api_key_env=KEY")).replicas
    assert r0.here and r0.url == "http://127.0.0.1:30001"
    assert not r1.here and r1.url == "http://10.255.0.7:30001"  # the same port on another node is fine


def test_router_only_starts_no_replica():
    layout = plan(fleet(), everything_elsewhere=True)
    assert not layout.here and layout.replicas[0].url == "http://127.0.0.1:30001"


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["fleet.replicas=4"], "replica-3 uses GPU 3, but node.gpus = 3"),
        (['fleet.replica=[{gpus="0"}, {gpus="0"}, {gpus="2"}]'], "GPU 0 is in replica-0 and in replica-1"),
        (["parallel.tp=2", "node.gpus=6", 'fleet.replica=[{gpus="1,1"}, {}, {}]'], 'gpus = "1,1" names a GPU twice'),
        (
            ['fleet.replica=[{gpus="0,1"}, {gpus="2"}, {}]'],
            'fleet.replica[0].gpus = "0,1" is 2 GPU(s), but a replica uses 1',
        ),
        (["fleet.replica=[{port=30005}, {port=30005}, {}]"], "port 30005 is replica-0's server.port and replica-1's"),
        (["fleet.replica=[{port=30000}, {}, {}]"], "port 30000 is the router's (server.port) and replica-0's"),
        (["fleet.gpus_per_replica=2"], "fleet.gpus_per_replica = 2, but each replica's server uses parallel.tp"),
        (["parallel.nnodes=2", "node.gpus=1"], "a fleet's replicas are one-node servers"),
        # sglang takes --port + 233 .. + 238 with dp-attention: two replicas 3 ports apart collide
        (
            ["extra_args.--enable-dp-attention=true", "fleet.replica=[{port=31000}, {port=31003}, {port=32000}]"],
            "port 31236 is replica-0's dp-attention",
        ),
    ],
)
def test_layout_mistakes_are_refused_naming_what_and_where(sets, expected):
    with pytest.raises(UserError) as caught:
        plan(fleet(*sets))
    assert expected in caught.value.message
    assert "nothing was started" in caught.value.message and caught.value.hint


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (['fleet.replica=[{url="10.0.0.2:30001"}]', "fleet.replicas=1"], "is not a worker URL"),
        (['fleet.replica=[{url="http://10.0.0.2"}]', "fleet.replicas=1"], "is not a worker URL"),
        (['fleet.replica=[{url="http://h:1", port=2}]', "fleet.replicas=1"], "give url alone"),
        (['fleet.replica=[{gpus="0;1"}]', "fleet.replicas=1"], "is not a list of GPU indices"),
        (["fleet.replicas=2", "fleet.replica=[{}, {}, {}]"], "fleet.replicas = 2 but 3 [[fleet.replica]]"),
        (["fleet.replica_host=0.0.0.0"], "fleet.replica_host = '0.0.0.0' is a public bind without an API key"),
        (["fleet.router.port=70000"], "fleet.router.port = 70000 is not a port"),
    ],
)
def test_bad_fleet_values_are_refused_when_the_profile_loads(sets, expected):
    with pytest.raises(UserError) as caught:
        fleet(*sets)
    assert expected in caught.value.message


def test_a_fleet_without_replicas_is_refused():
    with pytest.raises(UserError) as caught:
        load_profile("standin", [str(PROFILES)], ["fleet.gpus_per_replica=1"])
    assert "a fleet needs replicas = N or a [[fleet.replica]] list" in caught.value.message
