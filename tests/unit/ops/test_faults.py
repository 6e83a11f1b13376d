"""The fault drill's loopback proxy alone, against an echo server: latency, partition, reset, bandwidth cap."""

import socket
import socketserver
import threading
import time

import pytest

from fedssl.ops.faults import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while True:
            try:
                data = self.request.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.request.sendall(data)


@pytest.fixture
def echo_port():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(echo_port):
    with FaultProxy(echo_port, seed=7, name="site-1") as p:
        yield p


def _connect(proxy) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _rtt(s: socket.socket) -> float:
    t0 = time.monotonic()
    s.sendall(b"ping")
    assert _recv_exactly(s, 4) == b"ping"
    return time.monotonic() - t0


def test_latency_with_jitter_each_way_on_a_round_trip(proxy):
    with _connect(proxy) as s:
        base = min(_rtt(s) for _ in range(3))
        proxy.set_latency(0.1, 0.02)  # 100 ms +- 20 ms each way: a round trip takes 160..240 ms plus the base
        rtts = [_rtt(s) for _ in range(6)]
    assert base < 0.08
    assert all(0.155 <= r <= 0.24 + base + 0.15 for r in rtts), rtts
    assert max(rtts) - min(rtts) > 0.005  # jitter: not one fixed delay
    assert proxy.stats()["up"] >= 4 * 8 and proxy.stats()["down"] >= 4 * 8  # the traffic went through the proxy


def test_partition_holds_both_ways_then_releases_in_order(proxy):
    with _connect(proxy) as s:
        _rtt(s)
        proxy.partition(0.6)
        time.sleep(0.05)
        t0 = time.monotonic()
        s.sendall(b"one")
        s.sendall(b"two")
        s.settimeout(0.3)
        with pytest.raises(socket.timeout):  # held, not delivered
            s.recv(16)
        s.settimeout(5)
        assert _recv_exactly(s, 6) == b"onetwo"  # released, nothing lost, in order
        assert 0.45 <= time.monotonic() - t0 <= 2.0
        assert _rtt(s) < 0.1  # healed
    assert proxy.stats()["partitions"][0][1] == 0.6


def test_reset_closes_both_sides_and_the_site_can_reconnect(proxy):
    with _connect(proxy) as s:
        _rtt(s)
        assert proxy.reset_connections() == 1
        s.settimeout(5)
        try:
            assert s.recv(16) == b""  # closed ...
        except ConnectionResetError:  # ... by a reset
            pass
    with _connect(proxy) as s2:
        assert _rtt(s2) < 0.5
    assert proxy.stats()["resets"] == 1 and proxy.stats()["connections"] == 2


def test_scheduled_resets_are_seeded_and_bounded(echo_port):
    with FaultProxy(echo_port, seed=3) as a, FaultProxy(echo_port, seed=3) as b:
        moments = a.schedule_resets(3, 0.4)
        assert moments == b.schedule_resets(3, 0.4) and len(moments) == 3 and moments == sorted(moments)
        assert all(0 <= m <= 0.4 for m in moments)
        with _connect(a) as s:
            _rtt(s)
            time.sleep(0.6)
            s.settimeout(2)
            try:
                closed = s.recv(16) == b""
            except ConnectionResetError:
                closed = True
            assert closed
        assert len(a.stats()["reset_at_s"]) == 3  # exactly the scheduled count, no more


def test_bandwidth_cap_limits_throughput_each_way(proxy):
    payload = bytes(range(256)) * 400  # 102,400 bytes
    with _connect(proxy) as s:
        t0 = time.monotonic()
        s.sendall(payload)
        assert _recv_exactly(s, len(payload)) == payload
        free = time.monotonic() - t0
        proxy.set_bandwidth(200_000)  # 200 kB/s: about 0.5 s each way, the two ways pipelined
        t0 = time.monotonic()
        s.sendall(payload)
        assert _recv_exactly(s, len(payload)) == payload
        capped = time.monotonic() - t0
    assert free < 0.3
    assert 0.45 <= capped <= 3.0, capped


@pytest.mark.parametrize("kwargs, named", [
    ({"listen_host": "0.0.0.0"}, "listen_host='0.0.0.0'"),
    ({"target_host": "10.0.0.1"}, "target_host='10.0.0.1'"),
    ({"target_host": "localhost"}, "target_host='localhost'"),
    ({"listen_port": 70000}, "listen_port=70000"),
    ({"seed": 1.5}, "seed=1.5"),
])
def test_arguments_outside_loopback_or_range_are_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        FaultProxy(18000, **kwargs)


def test_fault_settings_are_checked_by_name(proxy):
    with pytest.raises(ValueError, match="jitter_s=0.2 exceeds latency_s=0.1"):
        proxy.set_latency(0.1, 0.2)
    with pytest.raises(ValueError, match="bytes_per_s=-1"):
        proxy.set_bandwidth(-1)
    with pytest.raises(ValueError, match="seconds=nan"):
        proxy.partition(float("nan"))
