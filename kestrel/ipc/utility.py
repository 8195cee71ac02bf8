"""Utility calls to N engine cores: wait for every engine, compensate safely, one guard for cleanup.

A *utility call* is ``(call_id, method, args)`` sent to one engine core; the engine answers
``(call_id, ok, value_or_failure_message)``. A fan-out to several engines follows three rules:

* **Wait for all.** Every engine's outcome is gathered (``return_exceptions`` semantics, never a
  fail-fast ``gather``), in engine order, and only then is one error raised that carries all of them.
  Raising at the first failure would leave calls running unobserved: nobody would know which engines
  applied a mutation, and an undo would race calls still in flight.
* **Compensate after everything settled.** A mutating call (sleep, wake_up) that failed on some live
  engine is undone on exactly the engines where it succeeded (:meth:`UtilityClient.call_all_or_undo`).
  An engine that is *dead* is no reason to undo: its state is gone, and undoing would change the live
  engines' state for nothing (a restarted engine starts fresh).
* **One guard owns cleanup.** Every waiter is registered through a :class:`WaiterGuard`; on every exit
  (preparation error, send error, timeout, cancellation, normal return) it removes what it registered
  and is still there. Late or unknown replies are dropped with a debug log.

This module knows no sockets: the core client is its :class:`UtilityTransport` (which also owns the one
record of dead engines) and feeds replies in through :meth:`UtilityClient.deliver`. Everything here runs
on the event loop's thread.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Container, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kestrel.errors import EngineDead

logger = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")
_MISSING = object()


# --------------------------------------------------------------------------------------- errors
class UtilityError(Exception):
    """Base class of the errors raised by utility calls; ``method`` and ``engine_index`` say where."""

    def __init__(self, message: str, method: str = "?", engine_index: int = -1):
        super().__init__(message)
        self.method = method
        self.engine_index = engine_index


class UtilityCallError(UtilityError):
    """The engine ran the method and it failed; ``message`` is the engine's failure message."""

    def __init__(self, method: str, engine_index: int, message: str):
        super().__init__(f"utility {method!r} failed on engine {engine_index}: {message}", method, engine_index)
        self.message = message


class UtilityPrepareError(UtilityError):
    """Encoding the call for one engine failed; nothing was sent to any engine."""


class UtilitySendError(UtilityError):
    """The call could not be handed to one engine (send raised, or the engine is known dead)."""


class UtilityTimeoutError(UtilityError, TimeoutError):
    """No reply (or no completed send) before the call's deadline."""


class UtilityFanoutError(UtilityError):
    """A fan-out did not succeed everywhere; raised only after every engine settled. ``result`` holds every
    per-engine outcome in engine order, ``undo`` the outcomes of the compensating call when one was sent."""

    def __init__(self, result: FanoutResult, undo: FanoutResult | None = None, message: str | None = None):
        self.result, self.undo = result, undo
        super().__init__(message or _failure_message(result, undo), result.method)

    @property
    def failed_engines(self) -> list[int]:
        return self.result.failed_engines()


class AlreadyRegisteredError(ValueError):
    """A guard was asked to register a key that is already in the registry (never clobbered)."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UtilityCallError):
        return exc.message
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def engine_lost(exc: BaseException) -> bool:
    """Did this outcome fail because the engine is dead (rather than because the call failed on it)?"""
    return isinstance(exc, EngineDead) or isinstance(exc.__cause__, EngineDead)


def _failure_message(result: FanoutResult, undo: FanoutResult | None) -> str:
    errs = result.errors()
    msg = f"utility {result.method!r} failed on {len(errs)} of {len(result)} engines: " + "; ".join(
        f"engine {e.engine_index}: {_reason(e.exception)}" for e in errs)
    if result.ok_engines():
        msg += f" (succeeded on engines {result.ok_engines()})"
    if undo is not None:
        msg += f"; undo {undo.method!r}: ok on {undo.ok_engines()}, failed on {undo.failed_engines()}"
    return msg


# ------------------------------------------------------------------------------------- outcomes
@dataclass(frozen=True, slots=True)
class Ok:
    value: Any
    engine_index: int


@dataclass(frozen=True, slots=True)
class Err:
    exception: BaseException
    engine_index: int

    @property
    def value(self) -> Any:
        raise self.exception


Outcome = Ok | Err


class FanoutResult(tuple):
    """Every engine's outcome of one fan-out, in engine order, plus the aggregation policies."""

    def __new__(cls, method: str, outcomes: Iterable[Outcome]):
        self = super().__new__(cls, outcomes)
        self.method = method
        return self

    def ok_engines(self) -> list[int]:
        return [o.engine_index for o in self if isinstance(o, Ok)]

    def failed_engines(self) -> list[int]:
        return [o.engine_index for o in self if isinstance(o, Err)]

    def errors(self) -> list[Err]:
        return [o for o in self if isinstance(o, Err)]

    def values_or_raise(self) -> list[Any]:
        """The values in engine order, or one :class:`UtilityFanoutError` carrying every outcome."""
        if self.errors():
            raise UtilityFanoutError(self)
        return [o.value for o in self]

    def all_true(self) -> bool:
        """AND of the values (operation-style utilities: reset_prefix_cache, sleep, ...)."""
        return all(bool(v) for v in self.values_or_raise())

    def consensus(self) -> Any:
        """The common value when every engine agrees (is_sleeping); names each distinct value's engines if not."""
        values = self.values_or_raise()
        if not values:
            raise ValueError(f"consensus of utility {self.method!r} over no engines")
        if any(v != values[0] for v in values):
            parts = "; ".join(f"engine {o.engine_index} returned {o.value!r}" for o in self)
            raise UtilityFanoutError(self, message=f"inconsistent results for utility {self.method!r}: {parts}")
        return values[0]


# ---------------------------------------------------------------------------------------- guard
def discard_waiter(value: Any) -> None:
    """Default cleanup of a removed entry: cancel a pending future (and mark a settled one's exception read)."""
    if isinstance(value, asyncio.Future):
        if not value.done():
            value.cancel()
        elif not value.cancelled():
            value.exception()


class WaiterGuard(Generic[K, V]):
    """Owns the entries it registers in ``registry`` until it exits or disarms them.

    On exit by any path, every entry it registered that is still present *with the same value* is removed
    and passed to ``on_discard``. Entries someone else already removed (a delivered reply, a failed engine)
    or replaced are left alone."""

    def __init__(self, registry: MutableMapping[K, V], *, on_discard: Callable[[V], None] | None = discard_waiter):
        self.registry = registry
        self._owned: dict[K, V] = {}
        self._on_discard = on_discard
        self._closed = False

    def register(self, key: K, value: V) -> V:
        if self._closed:
            raise RuntimeError("WaiterGuard is closed; it cannot register more entries")
        if key in self.registry:
            raise AlreadyRegisteredError(f"key {key!r} is already registered")
        self.registry[key] = self._owned[key] = value
        return value

    def release(self, key: K) -> None:
        """Remove one owned entry now, as exit would."""
        value = self._owned.pop(key, _MISSING)
        if value is not _MISSING:
            self._remove(key, value)

    def disarm(self, *keys: K) -> None:
        """Stop owning ``keys`` (all when none given): they stay registered after exit."""
        for key in keys or list(self._owned):
            self._owned.pop(key, None)

    def close(self) -> None:
        self._closed = True
        owned, self._owned = self._owned, {}
        for key, value in owned.items():
            self._remove(key, value)

    def _remove(self, key: K, value: V) -> None:
        if self.registry.get(key, _MISSING) is value:
            del self.registry[key]
        if self._on_discard is not None:
            try:
                self._on_discard(value)
            except Exception:  # cleanup of one entry must not skip the others
                logger.exception("error while discarding registry entry %r", key)

    def __enter__(self) -> WaiterGuard[K, V]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ transport
class UtilityTransport(Protocol):
    """What :class:`UtilityClient` needs from a core client."""

    num_engines: int
    dead: Mapping[int, BaseException]  # the one record of dead engines: calls to them settle at once, unsent
    restoring: Container[int]  # restarted engines, still in `dead`, that utility calls reach (their state restore)

    def encode(self, engine_index: int, call_id: int, method: str, args: tuple) -> bytes: ...
    async def send(self, engine_index: int, payload: bytes) -> None: ...


class _Waiter(asyncio.Future):
    """A reply future that remembers where its call went."""

    def __init__(self, engine_index: int, method: str, *, loop: asyncio.AbstractEventLoop):
        super().__init__(loop=loop)
        self.engine_index, self.method = engine_index, method


# --------------------------------------------------------------------------------------- client
class UtilityClient:
    """Utility calls over a :class:`UtilityTransport`; ``pending`` maps call_id -> reply future."""

    def __init__(self, transport: UtilityTransport):
        self.transport = transport
        self.pending: dict[int, _Waiter] = {}
        self._call_ids = itertools.count(1)

    async def call(self, engine_index: int, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``method`` on one engine and return its value (or raise its :class:`UtilityError`)."""
        return (await self.call_all(method, *args, timeout=timeout, engines=(engine_index,)))[0].value

    async def call_all(self, method: str, *args: Any, timeout: float | None = None,
                       engines: Iterable[int] | None = None) -> FanoutResult:
        """Call ``method`` on every engine (or on ``engines``) and return once every engine settled.

        1. Prepare every payload first: if one encode raises, nothing is sent (:class:`UtilityPrepareError`).
        2. Send to all together; a failed send (or a known-dead engine) settles that engine only.
        3. Await every reply; ``timeout`` (one deadline for the whole call) settles only the late engines.
        The result never raises by itself. Cancelling the caller removes every waiter of this call."""
        targets = self._targets(engines)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        outcomes: dict[int, Outcome] = {}
        with WaiterGuard(self.pending) as guard:
            calls: list[tuple[int, int, _Waiter, bytes]] = []
            for i in targets:
                if i in self.transport.dead and i not in self.transport.restoring:
                    exc = UtilitySendError(f"could not send utility {method!r} to engine {i}: "
                                           f"{_reason(self.transport.dead[i])}", method, i)
                    exc.__cause__ = self.transport.dead[i]
                    outcomes[i] = Err(exc, i)
                    continue
                call_id = next(self._call_ids)
                waiter = guard.register(call_id, _Waiter(i, method, loop=loop))
                try:
                    payload = self.transport.encode(i, call_id, method, args)
                except Exception as exc:
                    raise UtilityPrepareError(f"could not prepare utility {method!r} for engine {i}: "
                                              f"{_reason(exc)}", method, i) from exc
                calls.append((i, call_id, waiter, payload))
            sent = await asyncio.gather(*(self._send_one(method, i, p, deadline, timeout) for i, _, _, p in calls))
            waiting = []
            for (i, call_id, waiter, _), failure in zip(calls, sent):
                if failure is None:
                    waiting.append((i, call_id, waiter))
                else:
                    guard.release(call_id)
                    outcomes[i] = Err(failure, i)
            settled = await asyncio.gather(*(self._wait_one(guard, method, *w, deadline, timeout) for w in waiting))
            outcomes.update((o.engine_index, o) for o in settled)
        return FanoutResult(method, (outcomes[i] for i in targets))

    async def call_all_or_undo(self, method: str, args: Sequence[Any], undo_method: str, undo_args: Sequence[Any],
                               *, timeout: float | None = None, engines: Iterable[int] | None = None) -> FanoutResult:
        """A mutating fan-out that is applied everywhere or undone where it was applied.

        If every engine returned ``Ok`` the result is returned. Otherwise, after all settled,
        ``undo_method(*undo_args)`` is called on exactly the engines that returned ``Ok`` and
        :class:`UtilityFanoutError` is raised carrying both outcomes. Engines that timed out are reported, not
        undone (their state is unknown). Engines that are dead trigger no undo at all."""
        result = await self.call_all(method, *args, timeout=timeout, engines=engines)
        errors = result.errors()
        if not errors:
            return result
        undo = None
        if result.ok_engines() and not all(engine_lost(e.exception) for e in errors):
            try:
                undo = await self.call_all(undo_method, *undo_args, timeout=timeout, engines=result.ok_engines())
            except UtilityError as exc:  # nothing of the undo was sent; report it per engine
                undo = FanoutResult(undo_method, [Err(exc, i) for i in result.ok_engines()])
        raise UtilityFanoutError(result, undo)

    # -- fed by the core client ----------------------------------------------------------------
    def deliver(self, call_id: int, ok: bool, payload: Any, *, engine_index: int) -> bool:
        """Settle the waiter of ``call_id`` (``payload``: the value, or the failure message). Never raises;
        unknown, settled or wrong-engine replies are dropped with a log. Returns whether a waiter was settled."""
        waiter = self.pending.get(call_id) if isinstance(call_id, int) else None
        if waiter is None or waiter.done():
            logger.debug("dropping reply for unknown or finished utility call %r", call_id)
            return False
        if engine_index != waiter.engine_index:
            logger.warning("dropping reply for utility call %r from engine %s: the call went to engine %s",
                           call_id, engine_index, waiter.engine_index)
            return False
        del self.pending[call_id]
        if ok:
            waiter.set_result(payload)
        else:
            waiter.set_exception(UtilityCallError(waiter.method, engine_index, str(payload)))
            waiter.exception()  # read by the fan-out as an outcome; never logged as unretrieved
        return True

    def fail_engine(self, engine_index: int | None, exc: BaseException) -> int:
        """Fail every waiter of calls sent to ``engine_index`` (every waiter when None) with ``exc``."""
        hits = [cid for cid, w in self.pending.items() if engine_index is None or w.engine_index == engine_index]
        for call_id in hits:
            waiter = self.pending.pop(call_id)
            waiter.set_exception(exc)
            waiter.exception()
        return len(hits)

    # -- internals -----------------------------------------------------------------------------
    def _targets(self, engines: Iterable[int] | None) -> list[int]:
        n = self.transport.num_engines
        targets = list(range(n)) if engines is None else sorted(engines)
        if len(set(targets)) != len(targets) or any(not 0 <= i < n for i in targets):
            raise ValueError(f"bad engine indices {targets} for {n} engines")
        return targets

    async def _send_one(self, method: str, i: int, payload: bytes, deadline: float | None,
                        timeout: float | None) -> UtilityError | None:
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                await self.transport.send(i, payload)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and scope.expired():
                return UtilityTimeoutError(f"utility {method!r} to engine {i} timed out after {timeout:g}s "
                                           f"waiting for the send", method, i)
            err = UtilitySendError(f"could not send utility {method!r} to engine {i}: {_reason(exc)}", method, i)
            err.__cause__ = exc
            return err
        return None

    async def _wait_one(self, guard: WaiterGuard, method: str, i: int, call_id: int, waiter: _Waiter,
                        deadline: float | None, timeout: float | None) -> Outcome:
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                return Ok(await waiter, i)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and scope.expired():
                guard.release(call_id)  # a reply after this is late and gets dropped
                exc = UtilityTimeoutError(f"utility {method!r} to engine {i} timed out after {timeout:g}s",
                                          method, i)
            return Err(exc, i)
