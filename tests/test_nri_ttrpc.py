"""driver/nri/ttrpc.py against bytes NRI's own Go code put on the socket
(tests/data/nri/README.md says how they were recorded)."""

from __future__ import annotations

import asyncio
import socket
import struct
from pathlib import Path

import pytest

from driver._proto.nri.v1alpha1 import api_pb2 as api
from driver._proto.ttrpc import request_pb2
from driver.nri import ttrpc
from driver.nri.plugin import PLUGIN_SERVICE, RUNTIME_SERVICE, event_mask, netns_path

DATA = Path(__file__).parent / "data" / "nri"


def messages(stream: bytes, chunk: int | None = None) -> list[tuple[int, ttrpc.Message]]:
    """(connection id, message) in trunk order, fed whole or `chunk` bytes at a time."""
    mux = ttrpc.MuxDecoder()
    decoders: dict[int, ttrpc.MessageDecoder] = {}
    out = []
    pieces = [stream] if chunk is None else [stream[i:i + chunk]
                                              for i in range(0, len(stream), chunk)]
    for piece in pieces:
        for conn_id, payload in mux.feed(piece):
            decoder = decoders.setdefault(conn_id, ttrpc.MessageDecoder())
            out.extend((conn_id, m) for m in decoder.feed(payload))
    return out


def test_runtime_side_recording_decodes() -> None:
    got = messages((DATA / "runtime_to_plugin.bin").read_bytes())
    summary = [(conn, m.stream_id, m.kind, m.flags) for conn, m in got]
    assert summary == [
        (ttrpc.RUNTIME_SERVICE_CONN, 1, ttrpc.MessageType.RESPONSE, 0),  # RegisterPlugin ok
        (ttrpc.PLUGIN_SERVICE_CONN, 1, ttrpc.MessageType.REQUEST, 0),   # Configure
        (ttrpc.PLUGIN_SERVICE_CONN, 3, ttrpc.MessageType.REQUEST, 0),   # Synchronize
        (ttrpc.PLUGIN_SERVICE_CONN, 5, ttrpc.MessageType.REQUEST, 0),   # RunPodSandbox
    ]
    # An OK response with an empty payload is zero bytes: status and payload both unset.
    assert got[0][1].data == b""
    requests = []
    for _, message in got[1:]:
        request = request_pb2.Request()
        request.ParseFromString(message.data)
        requests.append(request)
    assert [(r.service, r.method) for r in requests] == [
        (PLUGIN_SERVICE, "Configure"), (PLUGIN_SERVICE, "Synchronize"),
        (PLUGIN_SERVICE, "RunPodSandbox")]
    # The runtime sends its deadline: NRI's 2 s request timeout, less what has passed.
    assert all(0 < r.timeout_nano <= 2_000_000_000 for r in requests)

    configure = api.ConfigureRequest.FromString(requests[0].payload)
    assert (configure.runtime_name, configure.NRI_version) == ("nri-runtime", "v0.12.3")
    assert (configure.registration_timeout, configure.request_timeout) == (5000, 2000)

    sync = api.SynchronizeRequest.FromString(requests[1].payload)
    assert [(p.id, p.uid, netns_path(p)) for p in sync.pods] == [
        ("sb-known", "uid-known", "/var/run/netns/cni-known")]
    assert not sync.more

    run = api.RunPodSandboxRequest.FromString(requests[2].payload)
    assert (run.pod.namespace, run.pod.name, run.pod.uid) == ("ml", "trainer", "uid-1")
    assert netns_path(run.pod) == "/var/run/netns/cni-1"


def test_plugin_side_recording_decodes() -> None:
    got = messages((DATA / "plugin_to_runtime.bin").read_bytes())
    summary = [(conn, m.stream_id, m.kind) for conn, m in got]
    assert summary == [
        (ttrpc.RUNTIME_SERVICE_CONN, 1, ttrpc.MessageType.REQUEST),   # RegisterPlugin
        (ttrpc.PLUGIN_SERVICE_CONN, 1, ttrpc.MessageType.RESPONSE),   # Configure
        (ttrpc.PLUGIN_SERVICE_CONN, 3, ttrpc.MessageType.RESPONSE),   # Synchronize
        (ttrpc.PLUGIN_SERVICE_CONN, 5, ttrpc.MessageType.RESPONSE),   # RunPodSandbox
    ]
    register = request_pb2.Request.FromString(got[0][1].data)
    assert (register.service, register.method) == (RUNTIME_SERVICE, "RegisterPlugin")
    body = api.RegisterPluginRequest.FromString(register.payload)
    assert (body.plugin_name, body.plugin_idx) == ("recorder", "10")
    configured = request_pb2.Response.FromString(got[1][1].data)
    assert configured.status.code == ttrpc.Code.OK
    # The stub subscribed to RunPodSandbox only: bit RUN_POD_SANDBOX-1.
    assert api.ConfigureResponse.FromString(configured.payload).events == \
        event_mask(api.RUN_POD_SANDBOX) == 1


@pytest.mark.parametrize("name", ["runtime_to_plugin.bin", "plugin_to_runtime.bin"])
def test_encoding_reproduces_the_recording_byte_for_byte(name: str) -> None:
    recorded = (DATA / name).read_bytes()
    rebuilt = b"".join(
        ttrpc.encode_mux(conn, ttrpc.encode_message(m.stream_id, ttrpc.MessageType(m.kind),
                                                    m.data, m.flags))
        for conn, m in messages(recorded))
    assert rebuilt == recorded


def test_our_register_request_is_the_stubs_bytes() -> None:
    """What the plugin sends to register, built as driver/nri/plugin.py builds it, equals
    the Go stub's bytes for the same name, index, version and deadline."""
    recorded = (DATA / "plugin_to_runtime.bin").read_bytes()
    conn, first = messages(recorded)[0]
    deadline = request_pb2.Request.FromString(first.data).timeout_nano
    ours = request_pb2.Request(
        service=RUNTIME_SERVICE, method="RegisterPlugin", timeout_nano=deadline,
        payload=api.RegisterPluginRequest(plugin_name="recorder", plugin_idx="10",
                                          NRI_version="v0.12.3").SerializeToString())
    frame = ttrpc.encode_mux(ttrpc.RUNTIME_SERVICE_CONN,
                             ttrpc.encode_message(1, ttrpc.MessageType.REQUEST,
                                                  ours.SerializeToString()))
    assert recorded.startswith(frame)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_decoding_does_not_depend_on_how_bytes_arrive(chunk: int) -> None:
    recorded = (DATA / "runtime_to_plugin.bin").read_bytes()
    assert messages(recorded, chunk) == messages(recorded)


def test_long_payload_spans_mux_frames_and_reassembles() -> None:
    payload = bytes(range(256)) * ((ttrpc.MUX_PAYLOAD_MAX // 256) + 10)
    framed = ttrpc.encode_mux(7, payload)
    first_len = struct.unpack(">II", framed[:8])[1]
    assert first_len == ttrpc.MUX_PAYLOAD_MAX
    got = list(ttrpc.MuxDecoder().feed(framed))
    assert [c for c, _ in got] == [7, 7]
    assert b"".join(p for _, p in got) == payload


def test_oversized_message_is_skipped_and_the_next_one_still_decodes() -> None:
    decoder = ttrpc.MessageDecoder()
    big = ttrpc.MESSAGE_LENGTH_MAX + 5
    header = struct.pack(">IIBB", big, 9, 1, 0)
    following = ttrpc.encode_message(11, ttrpc.MessageType.REQUEST, b"next")
    stream = header + b"x" * big + following
    out = []
    for start in range(0, len(stream), 1 << 20):
        out.extend(decoder.feed(stream[start:start + (1 << 20)]))
    assert [(m.stream_id, m.data, m.length) for m in out] == [(9, None, big), (11, b"next", 4)]
    assert len(decoder._buffer) == 0


def test_mux_frame_longer_than_any_message_is_a_protocol_error() -> None:
    bad = struct.pack(">II", 1, ttrpc.MUX_PAYLOAD_MAX + 1)
    with pytest.raises(ttrpc.ProtocolError, match="connection 1"):
        list(ttrpc.MuxDecoder().feed(bad))


def test_encode_refuses_a_message_over_the_limit() -> None:
    with pytest.raises(ttrpc.RemoteError) as err:
        ttrpc.encode_message(1, ttrpc.MessageType.REQUEST, b"\0" * (ttrpc.MESSAGE_LENGTH_MAX + 1))
    assert err.value.code == ttrpc.Code.RESOURCE_EXHAUSTED


async def _endpoint_pair(services):
    left, right = socket.socketpair()
    r1, w1 = await asyncio.open_unix_connection(sock=left)
    r2, w2 = await asyncio.open_unix_connection(sock=right)
    server = ttrpc.Endpoint(r1, w1, services)
    client = ttrpc.Endpoint(r2, w2, {})
    tasks = [asyncio.create_task(server.run()), asyncio.create_task(client.run())]
    return server, client, tasks


def test_endpoint_answers_statuses_as_ttrpc_does() -> None:
    async def echo(payload: bytes) -> bytes:
        return payload[::-1]

    async def refuse(payload: bytes) -> bytes:
        raise ttrpc.RemoteError(ttrpc.Code.FAILED_PRECONDITION, "no such NIC")

    async def crash(payload: bytes) -> bytes:
        raise ValueError("boom")

    async def hang(payload: bytes) -> bytes:
        await asyncio.Event().wait()
        return b""

    async def main() -> None:
        server, client, tasks = await _endpoint_pair(
            {1: {("svc", "Echo"): echo, ("svc", "Refuse"): refuse, ("svc", "Crash"): crash,
             ("svc", "Hang"): hang}})
        assert await client.call(1, "svc", "Echo", b"abc", 2) == b"cba"
        calls = [client.call(1, "svc", "Echo", bytes([i]) * 3, 2) for i in range(20)]
        assert await asyncio.gather(*calls) == [bytes([i]) * 3 for i in range(20)]
        for method, code, text in [("Refuse", ttrpc.Code.FAILED_PRECONDITION, "no such NIC"),
                                   ("Crash", ttrpc.Code.UNKNOWN, "boom"),
                                   ("Nope", ttrpc.Code.UNIMPLEMENTED, "method Nope")]:
            with pytest.raises(ttrpc.RemoteError) as err:
                await client.call(1, "svc", method, b"", 2)
            assert (err.value.code, err.value.message) == (code, text)
        with pytest.raises(ttrpc.RemoteError) as err:
            await client.call(2, "svc", "Echo", b"", 2)  # nothing served on connection 2
        assert (err.value.code, err.value.message) == (ttrpc.Code.UNIMPLEMENTED, "service svc")
        # The server closing fails calls in flight with ConnectionClosed, not a hang.
        slow = asyncio.create_task(client.call(1, "svc", "Hang", b"x", 30))
        await asyncio.sleep(0.05)
        await server.close()
        with pytest.raises(ttrpc.ConnectionClosed):
            await asyncio.wait_for(slow, 5)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
