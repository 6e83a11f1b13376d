"""A TCP proxy on loopback that puts network faults between one site and the server (the fault drill, issue 46).

One :class:`FaultProxy` per site listens on ``127.0.0.1`` and forwards every connection to the server's
``fed_learn`` port, also on loopback; the site's kit names the proxy's port as the server's (see
``fedssl.ops.deploy``).  Faults are changed while traffic flows, from any thread:

- latency with jitter, each way: every chunk read from one side is delivered to the other ``latency +- jitter``
  seconds later (uniform, from the proxy's seeded generator), never before an earlier chunk of the same direction;
- a bandwidth cap, each way, shared by every connection of the proxy (the site's link): a chunk of ``n`` bytes
  occupies the link for ``n / cap`` seconds;
- a partition: nothing is delivered either way for ``T`` seconds (the bytes are held, not dropped), then
  everything held is released in order;
- connection resets: every open connection is closed on both sides at once with a TCP reset (SO_LINGER 0), now
  or at ``count`` moments drawn from the seeded generator within a window.

The proxy runs its own asyncio loop in a daemon thread, so a synchronous caller (the drill, a test) controls it
with plain method calls.  Addresses outside 127.0.0.0/8 are refused at construction.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import struct
import threading
import time

#: bytes read from a socket at once
CHUNK = 64 * 1024


def _loopback(arg: str, host: str) -> str:
    try:
        ok = ipaddress.ip_address(host) in ipaddress.ip_network("127.0.0.0/8")
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"FaultProxy: {arg}={host!r} is not an IPv4 loopback address; use one in 127.0.0.0/8, "
                         "e.g. 127.0.0.1 (the drill never listens on or connects to another network)")
    return host


def _port(arg: str, port, allow_zero: bool) -> int:
    low = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
        raise ValueError(f"FaultProxy: {arg}={port!r} is not a TCP port; use a whole number in [{low}, 65535]"
                         + (" (0: any free port)" if allow_zero else ""))
    return port


def _non_negative(arg: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"FaultProxy: {arg}={value!r} is not a finite number >= 0; use seconds (or bytes/s), "
                         "0 for none")
    return float(value)


class _Connection:
    """One proxied connection: the site's socket and the server's, each with its asyncio writer."""

    def __init__(self, client_w: asyncio.StreamWriter, server_w: asyncio.StreamWriter):
        self.writers = (client_w, server_w)

    def reset(self) -> None:
        """Close both sides with a TCP reset, dropping anything not yet sent."""
        for w in self.writers:
            sock = w.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:  # already closed by the peer: nothing left to reset
                    pass
            w.transport.abort()

    def close(self) -> None:
        for w in self.writers:
            w.close()


class FaultProxy:
    """A loopback TCP proxy from ``listen_host:listen_port`` to ``target_host:target_port`` with run-time faults.

    Args:
        target_port: the server's port (its ``fed_learn_port``).
        listen_port: the port the site connects to; 0 picks a free one (read :attr:`port` after :meth:`start`).
        target_host: the server's address, in 127.0.0.0/8.
        listen_host: the proxy's address, in 127.0.0.0/8.
        seed: seeds the jitter and the moments of scheduled resets (a run repeats with the same seed).
        name: used in messages and in :meth:`stats` (e.g. the site's name).
    """

    def __init__(self, target_port: int, *, listen_port: int = 0, target_host: str = "127.0.0.1",
                 listen_host: str = "127.0.0.1", seed: int = 0, name: str = "proxy"):
        self.target_port = _port("target_port", target_port, allow_zero=False)
        self.listen_port = _port("listen_port", listen_port, allow_zero=True)
        self.target_host = _loopback("target_host", target_host)
        self.listen_host = _loopback("listen_host", listen_host)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"FaultProxy: seed={seed!r} is not a whole number; use e.g. 0")
        self.seed = seed
        self.name = name
        self._rng = random.Random(seed)
        self._latency = 0.0
        self._jitter = 0.0
        self._bps = 0.0
        self._next_free = {"up": 0.0, "down": 0.0}
        self._conns: set[_Connection] = set()
        self._counts = {"connections": 0, "refused_upstream": 0, "resets": 0, "up": 0, "down": 0}
        self.reset_log: list[float] = []
        self.partition_log: list[tuple[float, float]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self._open: asyncio.Event | None = None
        self._heal_handle = None
        self._t0 = time.monotonic()
        #: the port the proxy listens on, known after start()
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FaultProxy":
        """Bind and serve in a daemon thread; returns once the port is listening."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._open = asyncio.Event()
                self._open.set()
                self._server = self._loop.run_until_complete(
                    asyncio.start_server(self._handle, self.listen_host, self.listen_port))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # reported to the caller of start()
                failure.append(e)
                ready.set()
                self._loop.close()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=run, name=f"fault-proxy-{self.name}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise OSError(f"FaultProxy {self.name}: cannot listen on {self.listen_host}:{self.listen_port}: "
                          f"{failure[0]}")
        self._t0 = time.monotonic()
        return self

    def close(self) -> None:
        """Stop listening, close every connection, end the thread."""
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return

        async def shutdown():
            self._server.close()
            for c in list(self._conns):
                c.close()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ faults, settable at run time
    def set_latency(self, latency_s: float, jitter_s: float = 0.0) -> None:
        """Each chunk, each way, is delayed by ``latency_s +- jitter_s`` (uniform); 0, 0 for none."""
        latency_s = _non_negative("latency_s", latency_s)
        jitter_s = _non_negative("jitter_s", jitter_s)
        if jitter_s > latency_s:
            raise ValueError(f"FaultProxy: jitter_s={jitter_s!r} exceeds latency_s={latency_s!r}; a delay cannot be "
                             "negative, use jitter_s <= latency_s")
        self._latency, self._jitter = latency_s, jitter_s

    def set_bandwidth(self, bytes_per_s: float) -> None:
        """Cap each direction of the link at ``bytes_per_s`` (all connections together); 0 for no cap."""
        self._bps = _non_negative("bytes_per_s", bytes_per_s)

    def partition(self, seconds: float) -> None:
        """Hold all traffic, both ways, for ``seconds``, then release it (in order); returns at once."""
        seconds = _non_negative("seconds", seconds)
        self._need_loop()

        def begin():
            if self._heal_handle is not None:
                self._heal_handle.cancel()
            self._open.clear()
            self.partition_log.append((round(time.monotonic() - self._t0, 3), seconds))
            self._heal_handle = self._loop.call_later(seconds, self._open.set)

        self._loop.call_soon_threadsafe(begin)

    def heal(self) -> None:
        """End a partition now."""
        self._need_loop()

        def end():
            if self._heal_handle is not None:
                self._heal_handle.cancel()
            self._open.set()

        self._loop.call_soon_threadsafe(end)

    def reset_connections(self) -> int:
        """Close every open connection on both sides with a TCP reset; returns how many were reset."""
        self._need_loop()

        async def reset():
            return self._reset_all()

        return asyncio.run_coroutine_threadsafe(reset(), self._loop).result(timeout=10)

    def schedule_resets(self, count: int, window_s: float, start_s: float = 0.0) -> list[float]:
        """Reset every open connection at ``count`` moments drawn (seeded) uniformly in ``[start_s, start_s +
        window_s]`` seconds from now; returns the moments (seconds from now, sorted)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"FaultProxy: count={count!r} is not a whole number >= 0; use the number of resets")
        window_s = _non_negative("window_s", window_s)
        start_s = _non_negative("start_s", start_s)
        self._need_loop()
        moments = sorted(start_s + self._rng.uniform(0, window_s) for _ in range(count))
        for m in moments:
            self._loop.call_soon_threadsafe(self._loop.call_later, m, self._reset_all)
        return moments

    def stats(self) -> dict:
        """Connections accepted, bytes forwarded each way, resets, and the current fault settings."""
        return {"name": self.name, "port": self.port, **self._counts,
                "open_connections": len(self._conns), "latency_s": self._latency, "jitter_s": self._jitter,
                "bytes_per_s": self._bps, "reset_at_s": list(self.reset_log), "partitions": list(self.partition_log)}

    # ------------------------------------------------------------------ the loop's side
    def _need_loop(self) -> None:
        if self._loop is None:
            raise RuntimeError(f"FaultProxy {self.name}: not started; call start() (or use it as a context manager)")

    def _reset_all(self) -> int:
        n = len(self._conns)
        for c in list(self._conns):
            c.reset()
        self._conns.clear()
        self._counts["resets"] += n
        self.reset_log.append(round(time.monotonic() - self._t0, 3))
        return n

    def _delay(self) -> float:
        if self._latency == 0:
            return 0.0
        return self._latency + self._rng.uniform(-self._jitter, self._jitter)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:  # server down (killed in the drill): the site sees its connection closed and retries
            self._counts["refused_upstream"] += 1
            client_w.close()
            return
        conn = _Connection(client_w, server_w)
        self._conns.add(conn)
        self._counts["connections"] += 1
        pumps = [asyncio.ensure_future(self._pump(client_r, server_w, "up")),
                 asyncio.ensure_future(self._pump(server_r, client_w, "down"))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for p in pumps:
            p.cancel()
        self._conns.discard(conn)
        conn.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Read chunks as they come, deliver each after its delay, after any partition, at the capped rate."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def read():
            last = 0.0
            try:
                while True:
                    data = await reader.read(CHUNK)
                    if not data:
                        break
                    last = max(loop.time() + self._delay(), last)  # in order: never before an earlier chunk
                    queue.put_nowait((last, data))
            except OSError:  # reset by the peer or by reset_connections()
                pass
            queue.put_nowait((None, b""))

        reading = asyncio.ensure_future(read())
        try:
            while True:
                due, data = await queue.get()
                if due is None:
                    return
                await asyncio.sleep(max(0.0, due - loop.time()))
                await self._open.wait()
                await self._throttle(direction, len(data), loop)
                writer.write(data)
                await writer.drain()
                self._counts[direction] += len(data)
        except OSError:  # the other side went away
            return
        finally:
            reading.cancel()

    async def _throttle(self, direction: str, n: int, loop) -> None:
        if not self._bps:
            return
        now = loop.time()
        start = max(now, self._next_free[direction])
        self._next_free[direction] = start + n / self._bps
        await asyncio.sleep(self._next_free[direction] - now)
