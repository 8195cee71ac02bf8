"""Utility calls to N engine cores: wait for every engine, compensate safely, one guard for cleanup.

A *utility call* is ``(call_id, method, args)`` sent to one engine core; the engine answers
``(call_id, ok, value_or_failure_message)``. A fan-out to several engines follows three rules:

* **Wait for all.** Every engine's outcome is gathered (``return_exceptions`` semantics, never a
  fail-fast ``gather`` nor a ``TaskGroup``), in engine order, and only then is one error raised that
  carries all of them. Raising at the first failure would leave the other calls running unobserved:
  the caller would not know which engines applied a mutation, and an undo would race calls still
  in flight.
* **Compensate after everything settled.** A mutating call (add_lora, sleep, pause) that failed on
  some engines is undone on exactly the engines where it succeeded, once no reply is outstanding
  (:meth:`UtilityClient.call_utility_all_or_undo`).
* **One guard owns cleanup.** Every waiter is registered through a :class:`WaiterGuard`; on every
  exit (preparation error, send error, timeout, caller cancellation, normal return) it removes what
  it registered and is still there. Late or unknown replies are dropped with a debug log, so the
  client's output loop never dies on them. ``add_request`` uses the same guard for its output stream
  (:func:`register_and_send`).

This module knows no sockets: it is handed a small :class:`UtilityTransport` and fed replies by the
core client's output loop through :meth:`UtilityClient.deliver`. Everything here runs on the event
loop's thread.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, Union, overload

logger = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

_MISSING = object()


# --------------------------------------------------------------------------------------- errors


class UtilityError(Exception):
    """Base class of the errors raised by utility calls."""


class UtilityCallError(UtilityError):
    """The engine ran the method and it failed; ``message`` is the engine's failure message."""

    def __init__(self, method: str, engine_index: int, message: str):
        super().__init__(f"utility {method!r} failed on engine {engine_index}: {message}")
        self.method = method
        self.engine_index = engine_index
        self.message = message


class UtilityPrepareError(UtilityError):
    """Encoding the call for one engine failed; nothing was sent to any engine."""

    def __init__(self, method: str, engine_index: int, cause: BaseException):
        super().__init__(f"could not prepare utility {method!r} for engine {engine_index}: {_reason(cause)}")
        self.method = method
        self.engine_index = engine_index
        self.__cause__ = cause


class UtilitySendError(UtilityError):
    """The call could not be handed to one engine (send raised, or the engine is known dead)."""

    def __init__(self, method: str, engine_index: int, cause: BaseException):
        super().__init__(f"could not send utility {method!r} to engine {engine_index}: {_reason(cause)}")
        self.method = method
        self.engine_index = engine_index
        self.__cause__ = cause


class UtilityTimeoutError(UtilityError, TimeoutError):
    """No reply (or no completed send) before the call's deadline. Is a ``TimeoutError``."""

    def __init__(self, method: str, engine_index: int, timeout: float, waiting_for: str = "reply"):
        super().__init__(
            f"utility {method!r} to engine {engine_index} timed out after {timeout:g}s waiting for {waiting_for}"
        )
        self.method = method
        self.engine_index = engine_index
        self.timeout = timeout


class UtilityFanoutError(UtilityError):
    """A fan-out did not succeed everywhere. Raised only after every engine settled.

    ``result`` holds every per-engine outcome in engine order; ``undo`` holds the outcomes of the
    compensating call when one was sent (see :meth:`UtilityClient.call_utility_all_or_undo`).
    """

    def __init__(self, result: FanoutResult, undo: FanoutResult | None = None, message: str | None = None):
        self.result = result
        self.undo = undo
        super().__init__(message if message is not None else _failure_message(result, undo))

    @property
    def method(self) -> str:
        return self.result.method

    @property
    def outcomes(self) -> tuple[Outcome, ...]:
        return self.result.outcomes

    @property
    def failed_engines(self) -> list[int]:
        return self.result.failed_engines()

    @property
    def ok_engines(self) -> list[int]:
        return self.result.ok_engines()


class InconsistentResultsError(UtilityFanoutError):
    """Every engine answered, but not all with the same value. ``groups``: (value, engines) pairs."""

    def __init__(self, result: FanoutResult, groups: list[tuple[Any, list[int]]]):
        self.groups = groups
        parts = "; ".join(f"{_engines_phrase(engines)} returned {value!r}" for value, engines in groups)
        super().__init__(result, message=f"inconsistent results for utility {result.method!r}: {parts}")


class AlreadyRegisteredError(ValueError):
    """A guard was asked to register a key that is already in the registry (never clobbered)."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, UtilityCallError):
        return exc.message
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _engines_phrase(engines: Sequence[int]) -> str:
    if len(engines) == 1:
        return f"engine {engines[0]}"
    return f"engines {list(engines)}"


def _failure_message(result: FanoutResult, undo: FanoutResult | None) -> str:
    errs = result.errors()
    head = f"utility {result.method!r} failed on {len(errs)} of {len(result)} engines: "
    head += "; ".join(f"engine {e.engine_index}: {_reason(e.exception)}" for e in errs)
    ok = result.ok_engines()
    if ok:
        head += f" (succeeded on {_engines_phrase(ok)})"
    if undo is not None:
        undo_errs = undo.errors()
        if undo_errs:
            head += f"; undo {undo.method!r} failed on " + "; ".join(
                f"engine {e.engine_index}: {_reason(e.exception)}" for e in undo_errs
            )
            if undo.ok_engines():
                head += f" (undone on {_engines_phrase(undo.ok_engines())})"
        else:
            head += f"; undone with {undo.method!r} on {_engines_phrase(undo.ok_engines())}"
    return head


# ------------------------------------------------------------------------------------- outcomes


@dataclass(frozen=True, slots=True)
class Ok:
    """The engine answered with ``value``."""

    value: Any
    engine_index: int

    @property
    def ok(self) -> bool:
        return True

    def unwrap(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class Err:
    """The call failed for this engine: engine-side failure, send failure, timeout, or engine death."""

    exception: BaseException
    engine_index: int

    @property
    def ok(self) -> bool:
        return False

    def unwrap(self) -> Any:
        raise self.exception


Outcome = Union[Ok, Err]


class FanoutResult(Sequence[Outcome]):
    """Every engine's outcome of one fan-out, in engine order, plus the aggregation policies."""

    __slots__ = ("method", "_outcomes")

    def __init__(self, method: str, outcomes: Iterable[Outcome]):
        self.method = method
        self._outcomes = tuple(outcomes)

    @overload
    def __getitem__(self, index: int) -> Outcome: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Outcome, ...]: ...
    def __getitem__(self, index):
        return self._outcomes[index]

    def __len__(self) -> int:
        return len(self._outcomes)

    def __repr__(self) -> str:
        return f"FanoutResult({self.method!r}, {list(self._outcomes)!r})"

    @property
    def outcomes(self) -> tuple[Outcome, ...]:
        return self._outcomes

    def ok_engines(self) -> list[int]:
        return [o.engine_index for o in self._outcomes if isinstance(o, Ok)]

    def failed_engines(self) -> list[int]:
        return [o.engine_index for o in self._outcomes if isinstance(o, Err)]

    def errors(self) -> list[Err]:
        return [o for o in self._outcomes if isinstance(o, Err)]

    def raise_for_errors(self) -> None:
        """Raise one :class:`UtilityFanoutError` carrying every outcome if any engine failed."""
        if any(isinstance(o, Err) for o in self._outcomes):
            raise UtilityFanoutError(self)

    def values_or_raise(self) -> list[Any]:
        """The values in engine order, or one :class:`UtilityFanoutError` if any engine failed."""
        self.raise_for_errors()
        return [o.value for o in self._outcomes]

    def all_true(self) -> bool:
        """AND of the values' truth (operation-style utilities: reset_prefix_cache, add_lora, ...)."""
        return all(bool(v) for v in self.values_or_raise())

    def consensus(self) -> Any:
        """The common value when every engine agrees (is_sleeping, is_paused, ...).

        Raises :class:`UtilityFanoutError` if an engine failed and :class:`InconsistentResultsError`
        (naming the engines of each distinct value) if they disagree. Values need not be hashable.
        """
        values = self.values_or_raise()
        if not values:
            raise ValueError(f"consensus of utility {self.method!r} over no engines")
        groups: list[tuple[Any, list[int]]] = []
        for outcome in self._outcomes:
            for value, engines in groups:
                if value == outcome.value:
                    engines.append(outcome.engine_index)
                    break
            else:
                groups.append((outcome.value, [outcome.engine_index]))
        if len(groups) > 1:
            raise InconsistentResultsError(self, groups)
        return values[0]

    def flatten(self) -> list[Any]:
        """Concatenate per-engine list values (collective RPC: one list of worker results per engine)."""
        return [item for value in self.values_or_raise() for item in value]


# ---------------------------------------------------------------------------------------- guard


def discard_waiter(value: Any) -> None:
    """Default cleanup for a removed registry entry: cancel a pending future.

    A future that already holds an exception is marked as retrieved, so a call abandoned on the
    way out never leaves a "Future exception was never retrieved" log behind. Other values (an
    output-stream queue) need nothing.
    """
    if isinstance(value, asyncio.Future):
        if not value.done():
            value.cancel()
        elif not value.cancelled():
            value.exception()


class WaiterGuard(Generic[K, V]):
    """Owns the entries it registers in ``registry`` until it exits or is disarmed.

    Use it as a (sync or async) context manager around the whole life of a call. On exit, by any
    path (exception, ``CancelledError``, timeout, normal return), every entry it registered that is
    still present *with the same value* is removed and passed to ``on_discard`` (default: cancel a
    pending future). Entries someone else already removed (a delivered reply, ``fail_engine``) or
    replaced are left alone. :meth:`disarm` hands entries over to the registry for good (e.g. an
    output stream after a successful send).
    """

    __slots__ = ("registry", "_owned", "_on_discard", "_closed")

    def __init__(self, registry: MutableMapping[K, V], *, on_discard: Callable[[V], None] | None = discard_waiter):
        self.registry = registry
        self._owned: dict[K, V] = {}
        self._on_discard = on_discard
        self._closed = False

    def register(self, key: K, value: V) -> V:
        """Add ``key -> value`` to the registry, owned by this guard. Never overwrites an entry."""
        if self._closed:
            raise RuntimeError("WaiterGuard is closed; it cannot register more entries")
        if key in self.registry:
            raise AlreadyRegisteredError(f"key {key!r} is already registered")
        self.registry[key] = value
        self._owned[key] = value
        return value

    def release(self, key: K) -> None:
        """Remove one owned entry now (e.g. the waiter of a failed send), as exit would."""
        value = self._owned.pop(key, _MISSING)
        if value is not _MISSING:
            self._remove(key, value)

    def disarm(self, *keys: K) -> None:
        """Stop owning ``keys`` (all entries when none given): they stay registered after exit."""
        if not keys:
            self._owned.clear()
        for key in keys:
            self._owned.pop(key, None)

    @property
    def owned(self) -> tuple[K, ...]:
        return tuple(self._owned)

    def close(self) -> None:
        """Remove every entry still owned. Idempotent; never raises for a single bad entry."""
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

    async def __aenter__(self) -> WaiterGuard[K, V]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


async def register_and_send(
    registry: MutableMapping[K, V],
    key: K,
    value: V,
    send_coro_fn: Callable[[], Awaitable[object]],
) -> V:
    """Register ``key -> value``, await ``send_coro_fn()``, and keep the entry only if the send succeeded.

    For ``add_request``: the output stream is registered before the send (so outputs can be routed
    as soon as the engine answers) and removed again if the send raises or the caller is cancelled.
    """
    with WaiterGuard(registry) as guard:
        guard.register(key, value)
        await send_coro_fn()
        guard.disarm()
    return value


# ------------------------------------------------------------------------------------ transport


class UtilityTransport(Protocol):
    """What :class:`UtilityClient` needs from the core client's sockets."""

    @property
    def num_engines(self) -> int: ...

    def encode(self, engine_index: int, call_id: int, method: str, args: tuple) -> bytes:
        """Build the wire payload for one engine. May raise (preparation failure)."""
        ...

    async def send(self, engine_index: int, payload: bytes) -> None:
        """Hand the payload to one engine. May raise (send failure)."""
        ...


class _UtilityWaiter(asyncio.Future):
    """A reply future that remembers where its call went (for ``fail_engine`` and error messages)."""

    def __init__(self, engine_index: int, method: str, *, loop: asyncio.AbstractEventLoop):
        super().__init__(loop=loop)
        self.engine_index = engine_index
        self.method = method


# --------------------------------------------------------------------------------------- client


class UtilityClient:
    """Utility calls over a :class:`UtilityTransport`; ``pending`` maps call_id -> reply future."""

    def __init__(self, transport: UtilityTransport):
        self.transport = transport
        self.pending: dict[int, asyncio.Future] = {}
        self.dead_engines: dict[int, BaseException] = {}
        self._call_ids = itertools.count(1)

    # -- calls ---------------------------------------------------------------------------------

    async def call_utility(self, engine_index: int, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Call ``method`` on one engine and return its value.

        Raises :class:`UtilityCallError` (engine-side failure), :class:`UtilityTimeoutError` (a
        ``TimeoutError``), :class:`UtilityPrepareError` or :class:`UtilitySendError`.
        """
        result = await self.call_utility_all(method, *args, timeout=timeout, engines=(engine_index,))
        return result[0].unwrap()

    async def call_utility_all(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        engines: Iterable[int] | None = None,
    ) -> FanoutResult:
        """Call ``method`` on every engine (or on ``engines``) and return once every engine settled.

        1. Prepare: encode for every target first. If one encode raises, nothing is sent to anyone
           and :class:`UtilityPrepareError` (naming the engine) is raised.
        2. Send: all sends run together; a failed send becomes ``Err(UtilitySendError)`` for that
           engine (its waiter is removed) and the others carry on.
        3. Wait: all replies are awaited; ``timeout`` (seconds, one deadline for the whole call)
           becomes ``Err(UtilityTimeoutError)`` for the engines that missed it, only.

        The result never raises by itself: use ``values_or_raise()``, ``all_true()`` or
        ``consensus()``. Cancelling the caller removes every waiter of this call.
        """
        targets = self._targets(engines)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        outcomes: dict[int, Outcome] = {}
        with WaiterGuard(self.pending) as guard:
            # Phase 1: prepare every payload before anything leaves this process.
            calls: list[tuple[int, int, asyncio.Future, bytes]] = []
            for engine_index in targets:
                dead = self.dead_engines.get(engine_index)
                if dead is not None:
                    outcomes[engine_index] = Err(UtilitySendError(method, engine_index, dead), engine_index)
                    continue
                call_id = next(self._call_ids)
                waiter = guard.register(call_id, _UtilityWaiter(engine_index, method, loop=loop))
                try:
                    payload = self.transport.encode(engine_index, call_id, method, args)
                except Exception as exc:
                    raise UtilityPrepareError(method, engine_index, exc) from exc
                calls.append((engine_index, call_id, waiter, payload))

            # Phase 2: send to all; a failed send settles that engine only.
            sent = await asyncio.gather(
                *(self._send_one(method, i, payload, deadline, timeout) for i, _, _, payload in calls),
                return_exceptions=True,
            )
            waiting: list[tuple[int, int, asyncio.Future]] = []
            for (engine_index, call_id, waiter, _), failure in zip(calls, sent):
                if failure is None:
                    waiting.append((engine_index, call_id, waiter))
                    continue
                if not isinstance(failure, UtilityError):
                    failure = UtilitySendError(method, engine_index, failure)
                guard.release(call_id)
                outcomes[engine_index] = Err(failure, engine_index)

            # Phase 3: wait for every reply (or its timeout); nobody is cancelled by a sibling.
            settled = await asyncio.gather(
                *(self._wait_one(guard, method, i, cid, w, deadline, timeout) for i, cid, w in waiting),
                return_exceptions=True,
            )
            for (engine_index, _, _), outcome in zip(waiting, settled):
                if not isinstance(outcome, (Ok, Err)):
                    outcome = Err(outcome, engine_index)
                outcomes[engine_index] = outcome
        return FanoutResult(method, (outcomes[i] for i in targets))

    async def call_utility_all_or_undo(
        self,
        method: str,
        args: Sequence[Any],
        undo_method: str,
        undo_args_fn: Callable[[tuple], Sequence[Any]] | None = None,
        *,
        timeout: float | None = None,
        undo_timeout: float | None = None,
        engines: Iterable[int] | None = None,
    ) -> FanoutResult:
        """A mutating fan-out that is either applied everywhere or undone where it was applied.

        Calls ``method(*args)`` on every target and waits for all. If every engine returned ``Ok``
        the result is returned. Otherwise -- only after all settled -- ``undo_method`` is called on
        exactly the engines that returned ``Ok``, with ``undo_args_fn(args)`` (default: the same
        args), and :class:`UtilityFanoutError` is raised carrying both the forward outcomes and the
        undo outcomes (``.undo``). Engines that timed out are reported, not undone: their state is
        unknown. Examples: add_lora -> remove_lora, sleep -> wake_up, pause -> resume.
        """
        args = tuple(args)
        result = await self.call_utility_all(method, *args, timeout=timeout, engines=engines)
        if not result.failed_engines():
            return result
        succeeded = result.ok_engines()
        undo: FanoutResult | None = None
        if succeeded:
            undo_timeout = timeout if undo_timeout is None else undo_timeout
            try:
                undo_args = tuple(args if undo_args_fn is None else undo_args_fn(args))
                undo = await self.call_utility_all(undo_method, *undo_args, timeout=undo_timeout, engines=succeeded)
            except Exception as exc:  # nothing of the undo was sent; report it per engine, keep the forward outcomes
                undo = FanoutResult(undo_method, [Err(exc, i) for i in succeeded])
        raise UtilityFanoutError(result, undo=undo)

    # -- fed by the core client ----------------------------------------------------------------

    def deliver(self, call_id: int, ok: bool, payload: Any, *, engine_index: int | None = None) -> bool:
        """Settle the waiter of ``call_id`` with a reply from the output loop. Never raises.

        ``payload`` is the value when ``ok``, else the engine's failure message (becomes
        :class:`UtilityCallError`). Unknown, already-cleaned or already-settled ids are dropped with a
        debug log; if ``engine_index`` is given and differs from the call's engine, the reply is
        dropped too (warning). Returns whether a waiter was settled.
        """
        try:
            waiter = self.pending.get(call_id)
        except TypeError:  # unhashable garbage from the wire
            waiter = None
        if waiter is None:
            logger.debug("dropping reply for unknown or finished utility call %r", call_id)
            return False
        expected = getattr(waiter, "engine_index", None)
        if engine_index is not None and expected is not None and engine_index != expected:
            logger.warning(
                "dropping reply for utility call %r from engine %s: the call went to engine %s",
                call_id, engine_index, expected,
            )
            return False
        del self.pending[call_id]
        if waiter.done():
            logger.debug("dropping late reply for utility call %r (already settled)", call_id)
            return False
        if ok:
            waiter.set_result(payload)
        else:
            method = getattr(waiter, "method", "?")
            waiter.set_exception(UtilityCallError(method, -1 if expected is None else expected, str(payload)))
            waiter.exception()  # the awaiting fan-out reads it as an outcome; never log it as unretrieved
        return True

    def fail_engine(self, engine_index: int, exc: BaseException, *, dead: bool = True) -> int:
        """Fail every waiter of calls sent to ``engine_index`` with ``exc`` (the engine died).

        With ``dead`` (default) later calls to that engine settle at once as ``Err`` without being
        sent, instead of waiting for a reply that cannot come; :meth:`revive_engine` undoes that.
        Returns the number of waiters failed.
        """
        if dead:
            self.dead_engines[engine_index] = exc
        return self._fail(lambda w: getattr(w, "engine_index", None) == engine_index, exc)

    def fail_all(self, exc: BaseException, *, dead: bool = True) -> int:
        """Fail every pending waiter with ``exc`` (all engines gone, client shutting down)."""
        if dead:
            for engine_index in range(self.transport.num_engines):
                self.dead_engines[engine_index] = exc
        return self._fail(lambda w: True, exc)

    def revive_engine(self, engine_index: int) -> None:
        """Forget that ``engine_index`` was marked dead (it was restarted)."""
        self.dead_engines.pop(engine_index, None)

    # -- internals -----------------------------------------------------------------------------

    def _fail(self, match: Callable[[asyncio.Future], bool], exc: BaseException) -> int:
        hits = [call_id for call_id, waiter in self.pending.items() if match(waiter)]
        for call_id in hits:
            waiter = self.pending.pop(call_id)
            if not waiter.done():
                waiter.set_exception(exc)
                waiter.exception()  # see deliver()
        return len(hits)

    def _targets(self, engines: Iterable[int] | None) -> list[int]:
        n = self.transport.num_engines
        if engines is None:
            return list(range(n))
        targets = sorted(engines)
        if len(set(targets)) != len(targets):
            raise ValueError(f"duplicate engine indices in {targets}")
        bad = [i for i in targets if not 0 <= i < n]
        if bad:
            raise ValueError(f"engine indices {bad} out of range for {n} engines")
        return targets

    async def _send_one(
        self, method: str, engine_index: int, payload: bytes, deadline: float | None, timeout: float | None
    ) -> BaseException | None:
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                await self.transport.send(engine_index, payload)
        except TimeoutError as exc:
            if scope.expired():
                return UtilityTimeoutError(method, engine_index, timeout or 0.0, "the send")
            return UtilitySendError(method, engine_index, exc)
        except Exception as exc:
            return UtilitySendError(method, engine_index, exc)
        return None

    async def _wait_one(
        self,
        guard: WaiterGuard,
        method: str,
        engine_index: int,
        call_id: int,
        waiter: asyncio.Future,
        deadline: float | None,
        timeout: float | None,
    ) -> Outcome:
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                value = await waiter
        except TimeoutError as exc:
            if not scope.expired():  # a TimeoutError the engine failure carried, not our deadline
                return Err(exc, engine_index)
            guard.release(call_id)  # a reply after this is late and gets dropped
            return Err(UtilityTimeoutError(method, engine_index, timeout or 0.0), engine_index)
        except Exception as exc:
            return Err(exc, engine_index)
        return Ok(value, engine_index)


__all__ = [
    "AlreadyRegisteredError",
    "Err",
    "FanoutResult",
    "InconsistentResultsError",
    "Ok",
    "Outcome",
    "UtilityCallError",
    "UtilityClient",
    "UtilityError",
    "UtilityFanoutError",
    "UtilityPrepareError",
    "UtilitySendError",
    "UtilityTimeoutError",
    "UtilityTransport",
    "WaiterGuard",
    "discard_waiter",
    "register_and_send",
]
