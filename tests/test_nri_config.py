"""NicConfig's network fields (addresses, mtu, routes): the decoder and the chart's
admission policy agree on them, and a bad value fails its own claim at prepare."""

from __future__ import annotations

import pytest

from driver.prepare import opaque
from tests.test_claim_status import env  # noqa: F401 - fixture
from tests.test_config_policy import admitted, decoder_accepts, policy, wrap  # noqa: F401
from tests.test_plugin_integration import NIC, new_claim, opaque as config_of, result

V = opaque.API_VERSION


def nic(**fields) -> dict:
    return {"apiVersion": V, "kind": "NicConfig", "moveInterface": True, **fields}


GOOD = {
    "all of it": nic(interfaceName="net1", addresses=["10.1.0.5/24", "fd00::5/64"], mtu=9000,
                     routes=[{"destination": "10.2.0.0/16", "gateway": "10.1.0.1"},
                             {"destination": "default", "gateway": "10.1.0.254"},
                             {"destination": "fd01::/64"}]),
    "nulls": nic(addresses=None, mtu=None, routes=None),
    "empty lists without moving": {"apiVersion": V, "kind": "NicConfig", "addresses": [],
                                   "routes": []},
    "mtu bounds": nic(mtu=68),
    "v6 default": nic(routes=[{"destination": "default", "gateway": "fd00::1"}]),
}
BAD = {
    "address without prefix": nic(addresses=["10.1.0.5"]),
    "address not an IP": nic(addresses=["ten/24"]),
    "route destination not a network": nic(routes=[{"destination": "net-b"}]),
    "addresses not a list": nic(addresses="10.1.0.5/24"),
    "too many addresses": nic(addresses=[f"10.1.0.{i}/24" for i in range(17)]),
    "mtu too small": nic(mtu=67),
    "mtu too large": nic(mtu=65536),
    "mtu a string": nic(mtu="1500"),
    "mtu a bool": nic(mtu=True),
    "route default without gateway": nic(routes=[{"destination": "default"}]),
    "route gateway not an IP": nic(routes=[{"destination": "10.2.0.0/16", "gateway": "gw"}]),
    "route unknown field": nic(routes=[{"destination": "10.2.0.0/16", "via": "10.0.0.1"}]),
    "route without destination": nic(routes=[{"gateway": "10.0.0.1"}]),
    "addresses without moving": {"apiVersion": V, "kind": "NicConfig",
                                 "addresses": ["10.1.0.5/24"]},
    "mtu with moving off": {"apiVersion": V, "kind": "NicConfig", "moveInterface": False,
                            "mtu": 1400},
}
# Well-formed for the policy (which checks shapes: Kubernetes' IP and CIDR CEL libraries
# are not in what tests/test_config_policy.py evaluates with), refused by the decoder at
# prepare, where the claim's error names it.
PREPARE_ONLY = {
    "route host bits": nic(routes=[{"destination": "10.2.0.1/16"}]),
    "route families differ": nic(routes=[{"destination": "fd00::/8", "gateway": "10.0.0.1"}]),
    "address out of range": nic(addresses=["10.1.0.300/24"]),
    "prefix too long": nic(addresses=["10.1.0.5/33"]),
}
CASES = [(n, p, True) for n, p in GOOD.items()] + [(n, p, False) for n, p in BAD.items()]


@pytest.mark.parametrize("name, parameters, good", CASES, ids=[c[0] for c in CASES])
def test_decoder_and_policy_agree(policy, name, parameters, good) -> None:  # noqa: F811
    assert decoder_accepts(parameters) is good, "the table's own verdict"
    verdict, why = admitted(policy, wrap("ResourceClaim", parameters))
    assert verdict is good, why


@pytest.mark.parametrize("name", sorted(PREPARE_ONLY))
def test_what_only_prepare_refuses(policy, name) -> None:  # noqa: F811
    assert not decoder_accepts(PREPARE_ONLY[name])
    verdict, why = admitted(policy, wrap("ResourceClaim", PREPARE_ONLY[name]))
    assert verdict, why


def test_decoded_config_survives_the_checkpoint() -> None:
    config = opaque.decode(GOOD["all of it"])
    assert opaque.from_dict(opaque.to_dict(config)) == config
    assert config.routes[1] == opaque.NicRoute("default", "10.1.0.254")


def test_a_bad_value_fails_its_claim_at_prepare_and_only_that_one(env) -> None:  # noqa: F811
    api, _, kubelet = env
    bad = new_claim(api, "bad-mtu", [result("nic", NIC)],
                    [config_of(["nic"], nic(mtu=20))])
    answer = kubelet.prepare([bad]).claims[bad.uid]
    assert "NicConfig.mtu must be an integer from 68 to 65535, got 20" in answer.error
    assert "default/bad-mtu" in answer.error or bad.uid in answer.error


def test_network_settings_need_the_nri_plugin(env) -> None:  # noqa: F811
    """Without --nri-socket the runtime moves the NIC from CDI netDevices, which carry a
    name only: addresses would be dropped, so the claim fails instead."""
    api, _, kubelet = env
    claim = new_claim(api, "addressed", [result("nic", NIC)],
                      [config_of(["nic"], nic(addresses=["10.1.0.5/24"]))])
    answer = kubelet.prepare([claim]).claims[claim.uid]
    assert "set by the driver's NRI plugin, which is off on this node" in answer.error
