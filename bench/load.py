"""A bounded gRPC load generator: closed loop or a target rate, loopback only.

One asyncio process, ``concurrency`` workers on one channel. Requests are serialised before
the run and sent as bytes through a generic unary call, so the client spends as little CPU
per call as gRPC Python allows (the client shares the machine's cores with the servers).
Every reply is parsed and checked by the caller's ``check``.

* Closed loop (``rate_per_s`` None): each worker sends, waits, sends again.
* Target rate: request ``k`` is due at ``start + k / rate``; a worker waits until its next
  request is due. With ``concurrency`` calls in flight the rate cannot be exceeded; if the
  servers fall behind, requests are sent late and the latency shows it.

Bounded: the run stops after ``warmup_s + duration_s`` seconds or when the payloads are used
up, whichever comes first; every call has a deadline of ``timeout_s``. Only calls that start
after the warm-up and end inside the window are counted in the figures; every call's outcome
is kept in :class:`Outcomes` for reconciliation.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

LOOPBACK = ("127.", "localhost:", "[::1]")
# Reconnect quickly after a server restart (gRPC's default backoff grows to minutes).
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500),
                   # one connection per channel, even to the same target: several channels to one address
                   # reach several of its workers (SO_REUSEPORT spreads connections, not calls)
                   ("grpc.use_local_subchannel_pool", 1)]


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile of an ascending sequence (q in 0..100)."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


@dataclass
class Outcomes:
    """What happened to every call of a run (inside the window or not).

    Attributes:
        acknowledged: key → what ``check`` returned for an OK reply (e.g. the decision id).
        failed: key → gRPC status code name (or ``BAD_REPLY:<why>``) of calls that did not succeed.
        in_flight: calls sent and not yet answered, now.
        started: key → ``time.monotonic()`` when the call was sent.
        finished: key → ``time.monotonic()`` when its answer (or error) arrived.
    """

    acknowledged: dict[str, object] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    in_flight: int = 0
    started: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)

    def in_flight_at(self, moment: float) -> int:
        """Calls sent before ``moment`` (``time.monotonic()``) and answered after it."""
        return sum(1 for key, t0 in self.started.items() if t0 < moment < self.finished.get(key, float("inf")))


class Repeated(Sequence):
    """``n`` calls cycling through ``payloads`` (key, request), each with its own key."""

    def __init__(self, payloads: Sequence[tuple[str, bytes]], n: int) -> None:
        self.payloads, self.n = payloads, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[str, bytes]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return str(index), self.payloads[index % len(self.payloads)][1]


class BadReply(Exception):
    """``check`` found a reply that is not what the call should return."""


async def drive(target: str | Sequence[str], method: str, payloads: Sequence[tuple[str, bytes]], *,
                check: Callable[[str, bytes], object], concurrency: int, duration_s: float, warmup_s: float = 0.0,
                rate_per_s: float | None = None, timeout_s: float = 10.0, metadata: tuple = (),
                rows_per_call: int = 1, cpu_of: dict[str, Callable[[], float]] | None = None,
                outcomes: Outcomes | None = None, stop: asyncio.Event | None = None) -> dict:
    """Sends ``payloads`` (key, serialised request) to ``method`` at ``target``; returns the figures.

    Args:
        target: ``host:port``, or several (replicas of one service): one channel each, the
            ``concurrency`` workers spread over them round-robin, the figures for all together.
        check: ``check(key, reply_bytes)`` parses and checks one reply; raises :class:`BadReply`.
        cpu_of: name → a function giving that process's CPU seconds, sampled over the window.
        outcomes: filled with every call's outcome when given.
        stop: ends the run early when set.

    Returns:
        calls, calls/s, rows/s, p50/p90/p99/max latency in ms, error counts by code, CPU % per
        process over the window (100 = one core), and whether the payloads ran out.
    """
    targets = [target] if isinstance(target, str) else list(target)
    if not targets or not all(t.startswith(LOOPBACK) for t in targets):
        raise ValueError(f"refusing non-loopback target(s) {target!r}")
    if duration_s <= 0 or warmup_s < 0 or warmup_s + duration_s > 900:
        raise ValueError("need 0 < duration_s and warmup_s + duration_s <= 900")
    outcomes = outcomes if outcomes is not None else Outcomes()
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    next_index = 0
    async with contextlib.AsyncExitStack() as channels:
        calls = [(await channels.enter_async_context(grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS)))
                 .unary_unary(method) for t in targets]  # bytes in, bytes out: no serialiser on either side
        started = time.perf_counter()
        t_measure = started + warmup_s
        t_end = t_measure + duration_s

        async def worker(call) -> None:
            nonlocal next_index
            while next_index < len(payloads) and not (stop and stop.is_set()):
                index = next_index
                next_index += 1
                if rate_per_s:
                    due = started + index / rate_per_s
                    if due >= t_end:
                        return
                    if (wait := due - time.perf_counter()) > 0:
                        await asyncio.sleep(wait)
                        if stop and stop.is_set():
                            return
                key, request = payloads[index]
                t0 = time.perf_counter()
                if t0 >= t_end:
                    return
                code = None
                outcomes.in_flight += 1
                outcomes.started[key] = time.monotonic()
                try:
                    reply = await call(request, timeout=timeout_s, metadata=metadata)
                    outcomes.acknowledged[key] = check(key, reply)
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name
                except BadReply as exc:
                    code = f"BAD_REPLY:{exc}"
                finally:
                    outcomes.in_flight -= 1
                    outcomes.finished[key] = time.monotonic()
                t1 = time.perf_counter()
                if code is not None:
                    outcomes.failed[key] = code
                if t0 >= t_measure and t1 <= t_end:
                    if code is None:
                        latencies.append(t1 - t0)
                    else:
                        errors[code] += 1
                if code is not None and code != "DEADLINE_EXCEEDED":
                    await asyncio.sleep(0.002)  # a failing server is not hammered in a tight loop

        cpu0: dict[str, float] = {}
        cpu1: dict[str, float] = {}

        async def sample() -> None:
            await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
            cpu0.update({name: f() for name, f in (cpu_of or {}).items()})
            cpu0["client"] = _own_cpu()
            cpu0["machine"] = _machine_busy()
            window = max(0.0, t_end - time.perf_counter())
            if stop is None:
                await asyncio.sleep(window)
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(window):
                        await stop.wait()
            cpu1.update({name: f() for name, f in (cpu_of or {}).items()})
            cpu1["client"] = _own_cpu()
            cpu1["machine"] = _machine_busy()

        sampler = asyncio.create_task(sample())
        workers = [asyncio.create_task(worker(calls[i % len(calls)])) for i in range(concurrency)]
        await asyncio.gather(*workers)
        measured_s = min(duration_s, max(1e-9, time.perf_counter() - t_measure))
        if cpu0 and not cpu1:  # the payloads ran out (or stop was set) before the window's end
            sampler.cancel()
            cpu1.update({name: f() for name, f in (cpu_of or {}).items()})
            cpu1["client"] = _own_cpu()
            cpu1["machine"] = _machine_busy()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    lat = sorted(v * 1000 for v in latencies)
    out = {
        "calls": len(lat), "calls_per_s": round(len(lat) / measured_s, 1),
        "rows_per_s": round(len(lat) * rows_per_call / measured_s, 1),
        "p50_ms": _r(percentile(lat, 50)), "p90_ms": _r(percentile(lat, 90)), "p99_ms": _r(percentile(lat, 99)),
        "max_ms": _r(lat[-1] if lat else None), "errors": sum(errors.values()),
        "payloads_exhausted": next_index >= len(payloads),
    }
    if errors:
        out["error_codes"] = dict(errors)
    if cpu0 and cpu1:
        used = {name: cpu1[name] - cpu0[name] for name in cpu1}
        ours = sum(v for name, v in used.items() if name != "machine")
        out["cpu_pct"] = {name: round(100 * v / measured_s, 1) for name, v in used.items() if name != "machine"}
        # what else ran on the machine meanwhile (other users' work, the database): 100 = one core
        out["cpu_pct_others"] = round(100 * max(0.0, used["machine"] - ours) / measured_s, 1)
        if lat:
            out["cpu_ms_per_call"] = {name: round(1000 * v / len(lat), 3) for name, v in used.items()
                                      if name != "machine"}
    return out


def _machine_busy() -> float:
    """CPU seconds the whole machine spent not idle (all processes, all cores; steal excluded)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0) - getattr(t, "guest", 0.0) \
        - getattr(t, "guest_nice", 0.0)


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
