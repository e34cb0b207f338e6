"""driver/kube/client.py against the API emulator: what goes back into the connection pool.

A pooled keep-alive connection must hold nothing of an earlier response; otherwise the
next request on it (a claim GET during a prepare) reads that instead of its own answer
and fails with "Connection aborted". One connection in the pool makes every request use
the connection the watch had.
"""

from __future__ import annotations

import http.client
import queue
import threading
import time

import pytest

from driver.kube.client import ApiError, Kube
from driver.publish.publisher import Publisher
from driver.sim.apiserver import TOKEN, ApiServer, Fault, claim_allocated
from tests.conftest import discover_profile

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIM = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c"


@pytest.fixture
def api():
    with ApiServer() as server:
        server.add_node("node-a")
        server.put_claim(claim_allocated("default", "c", "uid-c", []))
        yield server


def one_connection(api, tmp_path) -> Kube:
    return Kube.deferred(api.kubeconfig(tmp_path), connections=1)


def test_a_failed_watch_leaves_its_connection_clean_for_the_next_request(api, tmp_path):
    kube = one_connection(api, tmp_path)
    # The error's body comes after its headers, as a real server's may: a client that
    # pools the connection on the headers alone gets this body as the claim's answer.
    api.inject(Fault("GET", "resourceslices", status=503, times=3, body_delay=0.3))
    for _ in range(3):
        with pytest.raises(ApiError) as failed:
            list(kube.stream(SLICES, {"watch": "1"}, timeout=5))
        assert kube.request("GET", CLAIM)["metadata"]["uid"] == "uid-c"
        assert str(failed.value) == f"HTTP 503: watch {SLICES}: injected fault 503"


def test_a_watch_left_early_leaves_no_half_read_response_in_the_pool(api, tmp_path):
    """urllib3 closes the connection itself when its stream is closed mid-body; this keeps
    it so whichever way the watch is read."""
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = Publisher(one_connection(api, tmp_path), "accel.dra.io", "node-a",
                          inventory=lambda: result.inventory)
    assert publisher.reconcile() == 3
    kube = one_connection(api, tmp_path)
    # The three ADDED events, then the watch stays open (no bookmark asked for): the
    # connection is mid-response with nothing yet to read on it.
    events = kube.stream(SLICES, {"watch": "1", "timeoutSeconds": "30"}, timeout=40)
    assert [next(events)["type"] for _ in range(3)] == ["ADDED"] * 3
    events.close()
    started = time.monotonic()
    assert kube.request("GET", CLAIM)["metadata"]["uid"] == "uid-c"
    assert time.monotonic() - started < 20, "the GET waited for the abandoned watch to end"


def test_a_proxy_page_instead_of_a_status_is_reported_by_its_reason(api, tmp_path):
    kube = one_connection(api, tmp_path)
    page = "<html><body><h1>502 Bad Gateway</h1></body></html>"
    api.inject(Fault("GET", "resourceclaims", status=502, page=page))
    api.inject(Fault("GET", "resourceslices", status=504, page=page))
    with pytest.raises(ApiError) as failed:
        kube.request("GET", CLAIM)
    assert str(failed.value) == f"HTTP 502: GET {CLAIM}: Bad Gateway"
    with pytest.raises(ApiError) as failed:
        list(kube.stream(SLICES, {"watch": "1"}, timeout=5))
    assert str(failed.value) == f"HTTP 504: watch {SLICES}: Gateway Timeout"
    api.inject(Fault("GET", "resourceclaims", status=200, page=page))
    with pytest.raises(ApiError) as failed:
        kube.request("GET", CLAIM)
    assert str(failed.value) == f"GET {CLAIM}: the answer is not JSON: {page.encode()!r}"
    assert kube.request("GET", CLAIM)["metadata"]["uid"] == "uid-c"


def test_a_watch_answered_with_something_else_fails_as_a_watch_does(api, tmp_path):
    """The slice watcher backs off and lists again on an ApiError; anything else would end
    its thread and, with it, the watch."""
    kube = one_connection(api, tmp_path)
    api.inject(Fault("GET", "resourceslices", status=200, page="<html>portal login</html>\n"))
    with pytest.raises(ApiError) as failed:
        list(kube.stream(SLICES, {"watch": "1"}, timeout=5))
    assert str(failed.value) == f"watch {SLICES}: not a watch event: b'<html>portal login</html>'"
    assert kube.request("GET", CLAIM)["metadata"]["uid"] == "uid-c"


def test_a_get_whose_connection_is_dropped_is_sent_once_more(api, tmp_path):
    kube = one_connection(api, tmp_path)
    dropped = Fault("GET", "resourceclaims", drop=True, times=1)
    api.inject(dropped)
    assert kube.request("GET", CLAIM)["metadata"]["uid"] == "uid-c"
    assert dropped.times == 0
    # Dropped again on the second try: the error names the request, one line.
    twice = Fault("GET", "resourceclaims", drop=True, times=2)
    api.inject(twice)
    with pytest.raises(ApiError) as failed:
        kube.request("GET", CLAIM)
    assert twice.times == 0
    assert str(failed.value).startswith(f"GET {CLAIM}: ('Connection aborted.'")
    # A watch opens the same way.
    api.inject(Fault("GET", "resourceslices", drop=True, times=1))
    assert list(kube.stream(SLICES, {"watch": "1", "timeoutSeconds": "0"}, timeout=5)) == []


def test_a_write_whose_connection_is_dropped_is_not_sent_again(api, tmp_path):
    """Whether a dropped write reached the server is unknown; the caller decides (the
    publisher reconciles from what the server has, the claim status is written again)."""
    kube = one_connection(api, tmp_path)
    dropped = Fault("POST", "events", drop=True, times=5)
    api.inject(dropped)
    with pytest.raises(ApiError):
        kube.request("POST", "/apis/events.k8s.io/v1/namespaces/default/events", body={})
    assert dropped.times == 4


def test_the_emulator_keeps_a_connection_open_after_a_watch_as_the_server_does():
    """A watch that ends at its timeoutSeconds leaves the connection usable. The emulator
    used to close it without saying so, and a client that reused it at once (the slice
    watcher resuming) lost the race now and then: a needless LIST in a test that forbids it."""
    with ApiServer() as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.httpd.server_address[1])
        for _ in range(20):
            connection.request("GET", f"{SLICES}?watch=1&timeoutSeconds=0",
                               headers={"Authorization": f"Bearer {TOKEN}"})
            response = connection.getresponse()
            assert response.status == 200 and response.read() == b""
            assert not response.will_close
        connection.request("GET", "/version")
        assert connection.getresponse().status == 200
        connection.close()


def test_a_watch_that_ends_leaves_the_other_watches_their_events(api, tmp_path):
    """Two idle watches: the one that ends first must take only its own queue away. The
    emulator removed queues by value, and two empty ones are equal: the watch still open
    saw no more events (and the other's end raised ValueError in the server's thread)."""
    _, result = discover_profile("mixed", tmp_path / "m")
    publisher = Publisher(Kube.deferred(api.kubeconfig(tmp_path)), "accel.dra.io", "node-a",
                          inventory=lambda: result.inventory)
    publisher.reconcile()
    version = str(api.state.resource_version)
    kube = Kube.deferred(api.kubeconfig(tmp_path))
    seen: queue.Queue = queue.Queue()

    def staying() -> None:
        query = {"watch": "1", "timeoutSeconds": "4", "resourceVersion": version}
        for event in kube.stream(SLICES, query, timeout=10):
            seen.put(event)

    thread = threading.Thread(target=staying, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5  # the long watch waits, its queue empty...
    while len(api.state.watchers) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(api.state.watchers) == 1
    # ... when a short one starts and ends, its queue empty too.
    brief = list(kube.stream(SLICES, {"watch": "1", "timeoutSeconds": "1", "resourceVersion": version},
                             timeout=10))
    assert brief == [] and len(api.state.watchers) == 1
    name = sorted(api.state.slices)[0]
    api.delete_slice(name)
    event = seen.get(timeout=5)
    assert (event["type"], event["object"]["metadata"]["name"]) == ("DELETED", name)
    thread.join(10)
