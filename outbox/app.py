"""``Outbox``: the front door applications hold to publish messages transactionally."""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import os
import random
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from datetime import timedelta
from typing import Any, TypeVar, Unpack, get_type_hints, overload

import psycopg
from sqlalchemy import Engine, TextClause
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import connectors, store, unawaited
from outbox.checkers import Checker, is_coroutine_function, synchronous, to_resolution
from outbox.connectors import AsyncBind, AsyncTarget, DjangoConnection, Rows, SyncBind, SyncTarget
from outbox.encoding import (
    CONTROL,
    MAX_MESSAGE_ID,
    EncodedMessage,
    cloudevent_headers,
    delivery_time,
    encode,
    merged_headers,
)
from outbox.exceptions import (
    INSUFFICIENT_PRIVILEGE,
    MISSING_OBJECTS,
    ConfigurationError,
    DecisionConflict,
    InvalidMessage,
    MessageNotFound,
    NotInTransaction,
    SchemaNotMigrated,
    db_command,
    first_line,
    sqlstate,
)
from outbox.message import Message, PrepareOptions, PublishOptions, TransactionResult
from outbox.schema import Resolution
from outbox.settings import PublishSettings, load_settings, unknown_variables, with_overrides

#: What commits the prepare row of ``send_in_transaction`` at once, before the local
#: transaction runs: an engine, or a psycopg or Django connection outside any transaction.
SyncOwner = Engine | psycopg.Connection[Any] | DjangoConnection
AsyncOwner = AsyncEngine | psycopg.AsyncConnection[Any]
#: ``local_transaction(message)`` answers COMMIT, ROLLBACK, UNKNOWN or None (= UNKNOWN).
LocalTransaction = Callable[[Message], Resolution | str | None]
AsyncLocalTransaction = Callable[
    [Message], Awaitable[Resolution | str | None] | Resolution | str | None
]
log = logging.getLogger("outbox")
T = TypeVar("T")
C = TypeVar("C", bound=Checker)


class Outbox:
    """Writes prepare rows in the caller's transaction; the relay delivers them once committed.

    ``Outbox()`` reads ``OUTBOX_*`` environment variables; keyword arguments override them.
    """

    def __init__(
        self,
        *,
        schema: str | None = None,
        max_payload_bytes: int | None = None,
        producer_group: str = "default",
        settings: PublishSettings | None = None,
        cloudevents_source: str | None = None,
    ) -> None:
        overrides = {"schema": schema, "max_payload_bytes": max_payload_bytes}
        if settings is not None and not isinstance(settings, PublishSettings):
            raise ConfigurationError(
                f"settings must be a PublishSettings or Settings, got {type(settings).__name__}"
                " (a relay's or sweeper's settings lack the publishing ones)")
        if settings is None:
            settings = load_settings(PublishSettings, **overrides)
            for warning in unknown_variables(os.environ):  # a typo would go unnoticed
                log.warning("%s", warning)
        elif schema is not None or max_payload_bytes is not None:
            settings = with_overrides(settings, **overrides)
        self.settings: PublishSettings = settings
        self.schema = self.settings.schema_name
        self.producer_group = _name(producer_group, "producer_group")
        #: When set, every message carries CloudEvents headers with this ``ce_source``.
        self.cloudevents_source = (None if cloudevents_source is None else
                                   _name(cloudevents_source, "cloudevents_source"))
        #: Checkers by producer group, registered with :meth:`checker`.
        self.checkers: dict[str, Checker] = {}

    @overload
    def publish(
        self,
        session: SyncTarget,
        topic: str,
        payload: Any,
        **options: Unpack[PublishOptions],
    ) -> int: ...

    @overload
    def publish(
        self,
        session: AsyncTarget,
        topic: str,
        payload: Any,
        **options: Unpack[PublishOptions],
    ) -> Coroutine[Any, Any, int]: ...

    def publish(
        self,
        session: SyncTarget | AsyncTarget,
        topic: str,
        payload: Any,
        **options: Unpack[PublishOptions],
    ) -> int | Coroutine[Any, Any, int]:
        """Write a prepare row for ``payload`` inside ``session``'s open transaction.

        Returns the message id; with an async session or connection, returns an awaitable.
        The message is delivered to ``topic`` only if the transaction commits; messages with
        the same ``key`` keep their order. Payloads: bytes, str, or JSON-serialisable data.
        ``deliver_after`` / ``deliver_at`` hold it back until then (later messages of the
        same key wait behind it).
        """
        _check_options("publish", options, _PUBLISH_KEYS)
        message = self._encode(topic, payload, options)
        delivery_time = self._delivery_time(options)
        statement, params = store.publish(
            self.schema,
            message,
            producer_group=self.producer_group,
            notify=self.settings.notify,
            **delivery_time,
        )
        _refuse_engine(session)
        return self._execute(session, statement, params, _message_id,
                             f"publish() to topic {topic!r}")

    def _delivery_time(self, options: PublishOptions) -> dict[str, Any]:
        return delivery_time(options.get("deliver_after"), options.get("deliver_at"),
                             self.settings.max_delay)

    def _encode(self, topic: str, payload: Any, options: PublishOptions) -> EncodedMessage:
        headers = options.get("headers")
        event_type = options.get("cloudevent_type")
        source = options.get("cloudevent_source")
        if event_type is not None:
            _name(event_type, "cloudevent_type", InvalidMessage)
        if source is not None:
            _name(source, "cloudevent_source", InvalidMessage)
        source = source or self.cloudevents_source
        if event_type or source:
            # the caller's own headers win, as they do over trace headers
            headers = merged_headers(cloudevent_headers(event_type or topic, source), headers)
        return encode(
            topic,
            payload,
            key=options.get("key"),
            headers=headers,
            content_type=options.get("content_type"),
            max_payload_bytes=self.settings.max_payload_bytes,
            # the module's generator: reseeded in a forked child, where an Outbox's own
            # would repeat its parent's and its siblings' shards
            random_shard=random.getrandbits(16),
        )

    @overload
    def _execute(
        self,
        bind: SyncBind,
        statement: TextClause,
        params: dict[str, Any],
        read: Callable[[Rows], T],
        call: str = "",
    ) -> T: ...

    @overload
    def _execute(
        self,
        bind: AsyncBind,
        statement: TextClause,
        params: dict[str, Any],
        read: Callable[[Rows], T],
        call: str = "",
    ) -> Coroutine[Any, Any, T]: ...

    def _execute(
        self,
        bind: SyncBind | AsyncBind,
        statement: TextClause,
        params: dict[str, Any],
        read: Callable[[Rows], T],
        call: str = "",
    ) -> T | Coroutine[Any, Any, T]:
        """Run one statement in the caller's open transaction, or in an engine's own one.
        An async ``call`` is recorded until it runs (a commit without it is refused)."""
        if connectors.is_async(bind):
            coroutine = self._execute_async(bind, statement, params, read)
            return unawaited.recorded(bind, call, coroutine) if call else coroutine
        return read(connectors.execute(bind, statement, params, _setup_errors(self.schema)))

    async def _execute_async(
        self,
        bind: AsyncBind,
        statement: TextClause,
        params: dict[str, Any],
        read: Callable[[Rows], T],
    ) -> T:
        return read(await connectors.execute_async(bind, statement, params,
                                                   _setup_errors(self.schema)))

    # Two-phase messages (RocketMQ transactional messages) -------------------------------

    @overload
    def prepare(
        self,
        session: SyncTarget,
        topic: str,
        payload: Any,
        **options: Unpack[PrepareOptions],
    ) -> int: ...

    @overload
    def prepare(
        self,
        session: AsyncTarget,
        topic: str,
        payload: Any,
        **options: Unpack[PrepareOptions],
    ) -> Coroutine[Any, Any, int]: ...

    def prepare(
        self,
        session: SyncTarget | AsyncTarget,
        topic: str,
        payload: Any,
        **options: Unpack[PrepareOptions],
    ) -> int | Coroutine[Any, Any, int]:
        """Write a half message: a prepare row whose resolution is UNKNOWN, in ``session``.

        Nothing is delivered until :meth:`commit` (or a checker) says COMMIT; :meth:`rollback`
        (or a checker's ROLLBACK) drops it. With no decision the sweeper asks this outbox's
        producer group's checker, first after ``transaction_timeout`` (or ``check_immunity``).
        Later messages of the same key wait behind it. Returns the message id.
        """
        _check_options("prepare", options, _PREPARE_KEYS)
        message = self._encode(topic, payload, options)
        statement, params = self._prepare_statement(message, options)
        _refuse_engine(session)
        return self._execute(session, statement, params, _message_id,
                             f"prepare() to topic {topic!r}")

    def _prepare_statement(
        self, message: EncodedMessage, options: PrepareOptions
    ) -> tuple[TextClause, dict[str, Any]]:
        check_immunity = options.get("check_immunity")
        if check_immunity is None:
            check_after = self.settings.transaction_timeout
        elif isinstance(check_immunity, timedelta) and check_immunity >= timedelta(0):
            check_after = check_immunity.total_seconds()
        else:
            raise InvalidMessage(
                f"check_immunity must be a timedelta of zero or more, got {check_immunity!r}"
            )
        if check_immunity is not None and check_after > self.settings.max_delay:
            # an undecided row holds back its key that long
            raise InvalidMessage(
                f"check_immunity {check_immunity} is longer than max_delay "
                f"({timedelta(seconds=self.settings.max_delay)}); raise OUTBOX_MAX_DELAY to "
                "wait longer before the first check-back")
        return store.publish(
            self.schema,
            message,
            producer_group=self.producer_group,
            notify=False,  # not deliverable until decided
            resolution=Resolution.UNKNOWN,
            check_after_seconds=check_after,
            **self._delivery_time(options),
        )

    @overload
    def commit(self, bind: SyncBind, message_id: int) -> None: ...

    @overload
    def commit(self, bind: AsyncBind, message_id: int) -> Coroutine[Any, Any, None]: ...

    def commit(self, bind: SyncBind | AsyncBind, message_id: int
               ) -> Coroutine[Any, Any, None] | None:
        """Resolve a prepared message COMMIT, so the relay delivers it (endTransaction).

        ``bind`` is a session or connection in an open transaction (the decision commits
        with it), or an engine or a psycopg or Django connection outside any transaction
        (the decision commits at once). Deciding again the same way
        does nothing; the other way raises :class:`DecisionConflict`.
        """
        return self._decide(bind, message_id, Resolution.COMMIT)

    @overload
    def rollback(self, bind: SyncBind, message_id: int) -> None: ...

    @overload
    def rollback(self, bind: AsyncBind, message_id: int) -> Coroutine[Any, Any, None]: ...

    def rollback(self, bind: SyncBind | AsyncBind, message_id: int
                 ) -> Coroutine[Any, Any, None] | None:
        """Resolve a prepared message ROLLBACK: it is never delivered; an op record says so."""
        return self._decide(bind, message_id, Resolution.ROLLBACK)

    def _decide(self, bind: SyncBind | AsyncBind, message_id: int, resolution: Resolution
                ) -> Coroutine[Any, Any, None] | None:
        message_id = _decided_id(message_id, self.schema)
        if connectors.is_async(bind):
            return unawaited.recorded(bind, f"{resolution.lower()}() of message {message_id}",
                                      self._decide_async(bind, message_id, resolution))
        bind = connectors.deciding(bind)
        statement, params = store.decide(self.schema, message_id, resolution, self._actor)
        row = self._execute(bind, statement, params, _one_or_none)
        _check_decision(row, message_id, resolution, self.schema)
        return None

    async def _decide_async(self, bind: AsyncBind, message_id: int, resolution: Resolution
                            ) -> None:
        bind = await connectors.deciding_async(bind)
        statement, params = store.decide(self.schema, message_id, resolution, self._actor)
        row = await self._execute(bind, statement, params, _one_or_none)
        _check_decision(row, message_id, resolution, self.schema)

    @property
    def _actor(self) -> str:
        return f"app:{self.settings.worker_id}"

    @overload
    def send_in_transaction(
        self,
        engine: SyncOwner,
        topic: str,
        payload: Any,
        local_transaction: LocalTransaction,
        **options: Unpack[PrepareOptions],
    ) -> TransactionResult: ...

    @overload
    def send_in_transaction(
        self,
        engine: AsyncOwner,
        topic: str,
        payload: Any,
        local_transaction: AsyncLocalTransaction,
        **options: Unpack[PrepareOptions],
    ) -> Coroutine[Any, Any, TransactionResult]: ...

    def send_in_transaction(
        self,
        engine: SyncOwner | AsyncOwner,
        topic: str,
        payload: Any,
        local_transaction: LocalTransaction | AsyncLocalTransaction,
        **options: Unpack[PrepareOptions],
    ) -> TransactionResult | Coroutine[Any, Any, TransactionResult]:
        """RocketMQ's sendMessageInTransaction, for a local transaction that is not ours.

        Commits a prepare row (resolution UNKNOWN) on its own, then calls
        ``local_transaction(message)`` — which may touch other systems and may store
        ``message.id`` for the checker — and records its COMMIT or ROLLBACK. An answer of
        UNKNOWN or None, an exception (which propagates, noting the message id), or a crash
        leaves the row UNKNOWN for the check-back. Async engines take sync or async callables.
        ``engine`` may also be a psycopg or Django connection outside any transaction.
        """
        _check_options("send_in_transaction", options, _PREPARE_KEYS)
        if not callable(local_transaction):
            raise InvalidMessage(f"local_transaction must be callable (it runs your local "
                                 f"transaction), got {type(local_transaction).__name__}")
        message = self._encode(topic, payload, options)
        statement, params = self._prepare_statement(message, options)
        owner = connectors.own_transaction(engine)
        if connectors.is_async(owner):
            return self._send_async(owner, message, statement, params, local_transaction)
        assert not isinstance(owner, AsyncEngine)
        if is_coroutine_function(local_transaction):  # it would never run, its row committed
            raise InvalidMessage(
                "local_transaction is a coroutine function (async def), which a synchronous "
                f"{type(engine).__name__} cannot await: pass an AsyncEngine, AsyncConnection "
                "or async psycopg connection, or a plain function")
        message_id = self._execute(owner, statement, params, _message_id)
        prepared = self._message(message, message_id)
        with _noting_unknown(message_id):
            answer = to_resolution(local_transaction(prepared), "the local transaction")
            if answer is not Resolution.UNKNOWN:
                connectors.require_idle_after(owner)
                self._decide(owner, message_id, answer)
        return TransactionResult(message_id, answer)

    async def _send_async(
        self,
        engine: AsyncEngine | connectors.AsyncOwnTransaction,
        message: EncodedMessage,
        statement: TextClause,
        params: dict[str, Any],
        local_transaction: AsyncLocalTransaction,
    ) -> TransactionResult:
        message_id = await self._execute(engine, statement, params, _message_id)
        prepared = self._message(message, message_id)
        with _noting_unknown(message_id):
            returned = local_transaction(prepared)
            if inspect.isawaitable(returned):
                returned = await returned
            answer = to_resolution(returned, "the local transaction")
            if answer is not Resolution.UNKNOWN:
                await connectors.require_idle_after_async(engine)
                await self._decide_async(engine, message_id, answer)
        return TransactionResult(message_id, answer)

    def _message(self, message: EncodedMessage, message_id: int) -> Message:
        return Message(
            id=message_id,
            producer_group=self.producer_group,
            topic=message.topic,
            key=message.key,
            headers=dict(zip(message.header_keys or (), message.header_values or (),
                             strict=True)),
            payload=message.payload,
            content_type=message.content_type,
        )

    @overload
    def checker(self, producer_group: C) -> C: ...

    @overload
    def checker(self, producer_group: str | None = None) -> Callable[[C], C]: ...

    def checker(self, producer_group: str | C | None = None) -> Callable[[C], C] | C:
        """Register ``func(message, connection) -> COMMIT | ROLLBACK | UNKNOWN`` for a group.

        The sweeper (``outbox sweep --app module:outbox``) calls it for messages of that
        producer group (default: this outbox's) whose resolution is still UNKNOWN. Use it as
        ``@outbox.checker``, ``@outbox.checker()`` or ``@outbox.checker("group")``.
        """
        if callable(producer_group):
            return self.checker(None)(producer_group)
        group = (self.producer_group if producer_group is None else
                 _name(producer_group, "producer_group"))

        def register(func: C) -> C:
            if group in self.checkers:
                raise ConfigurationError(f"producer group {group!r} already has a checker")
            self.checkers[group] = synchronous(func, group)
            return func

        return register


def _name(value: Any, what: str, error: type[Exception] = ConfigurationError) -> str:
    """A producer group or a CloudEvents source or type: refused at once when it is not a
    usable str (an empty one would silently mean the default, or no CloudEvents at all;
    bytes would be sent as they are, where consumers read text)."""
    if not isinstance(value, str) or not value or CONTROL.search(value) \
            or store.as_text(value) != value:  # a lone surrogate: the driver refuses it
        raise error(f"{what} must be a non-empty str without control characters or lone "
                    f"surrogates, got {value!r}")
    return value


_PUBLISH_KEYS = frozenset(get_type_hints(PublishOptions))
_PREPARE_KEYS = frozenset(get_type_hints(PrepareOptions))


def _check_options(call: str, options: Mapping[str, object], allowed: frozenset[str]) -> None:
    """``**options`` accepts only the TypedDict's names, as a plain signature would."""
    unknown = options.keys() - allowed
    if unknown:
        raise TypeError(f"{call}() got an unexpected keyword argument {min(unknown)!r}")


#: How revision 0005's check words a decision refused to a login outside the producer
#: group's role (``producer_group_role``): the role it names is the one to grant.
_GROUP_ROLE_REFUSAL = "only as a member of"


@contextlib.contextmanager
def _setup_errors(schema: str) -> Iterator[None]:
    """A setup mistake, an unmigrated schema or a login without the application's role,
    says what fixes it; the driver's error is its cause."""
    try:
        yield
    except Exception as exc:
        state = sqlstate(exc) or ""
        missing = MISSING_OBJECTS.get(state)
        if missing is not None:
            raise SchemaNotMigrated(
                f"outbox schema {schema!r} {missing[1]}: run `{db_command(schema)}` "
                "(or outbox.migrate.upgrade) against this database first"
            ) from exc
        if state == INSUFFICIENT_PRIVILEGE:
            refused = first_line(exc)
            fix = ("grant it that role" if _GROUP_ROLE_REFUSAL in refused else
                   f"grant it the role {schema}_app (`GRANT {schema}_app TO <login>`; "
                   f"`{db_command(schema, 'upgrade --create-roles')}` makes the roles)")
            raise ConfigurationError(
                f"this login may not use outbox schema {schema!r} ({refused}): {fix}"
            ) from exc
        raise


def _message_id(rows: Rows) -> int:
    (row,) = rows
    return int(row[0])


def _one_or_none(rows: Rows) -> Any:
    return rows[0] if rows else None


def _refuse_engine(session: object) -> None:
    """An engine would commit the row on its own, apart from the business transaction."""
    if isinstance(session, Engine | AsyncEngine):
        raise NotInTransaction(
            "publish() and prepare() write inside your transaction: pass a session or "
            "connection with an open transaction, not an Engine"
        )


def _decided_id(message_id: Any, schema: str) -> int:
    """The id a decision names as an ``int`` (any integer type with ``__index__``, numpy's
    included). A float, bool or string is refused here: sent as one, PostgreSQL finds no
    function for it, an error that reads as an unmigrated schema."""
    if isinstance(message_id, bool):
        raise InvalidMessage("message_id must be an integer (the id prepare() returned), "
                             "got a bool")
    try:
        value = operator.index(message_id)
    except TypeError:
        raise InvalidMessage(f"message_id must be an integer (the id prepare() returned), "
                             f"got {type(message_id).__name__}") from None
    if not 0 < value <= MAX_MESSAGE_ID:
        raise MessageNotFound(f"no message {value} in outbox schema {schema!r}")
    return value


def _check_decision(row: Any, message_id: int, resolution: Resolution,
                    schema: str) -> None:
    """Deciding again the same way is a no-op; the other way is a conflict."""
    if row is None:
        raise MessageNotFound(
            f"no message {message_id} in outbox schema {schema!r}: never written, rolled back "
            "with its transaction, pruned, or not committed yet (a decision through another "
            "connection sees a prepare row only once its transaction commits)")
    if row.decided or row.was_resolution == resolution:
        return
    raise DecisionConflict(
        f"message {message_id} is already resolved {row.was_resolution}; "
        f"it cannot be resolved {resolution} now"
    )


@contextlib.contextmanager
def _noting_unknown(message_id: int) -> Iterator[None]:
    """Tell whoever sees an exception from the local transaction what became of the row."""
    try:
        yield
    except DecisionConflict as exc:
        exc.add_note(f"outbox message {message_id} was resolved while the local transaction "
                     "ran (by its check-back, if the local transaction outlasted "
                     "transaction_timeout or its check_immunity)")
        raise
    except BaseException as exc:
        exc.add_note(f"outbox message {message_id} stays UNKNOWN until its check-back "
                     "resolves it")
        raise
