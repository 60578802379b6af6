"""PostgreSQL functions for the database backend's statements that acquire and
release, contended or not (``functions`` lists them).

Sent as text, PostgreSQL parses and plans the acquire on every call: that costs
more server time than the whole plain ``INSERT`` plus ``DELETE`` the backend is
measured against (see docs/benchmarks.md), and under contention every retry, queue
and release pays it again. A server-side prepared statement would avoid it, but is
not safe by default: behind a pooler in transaction mode (PgBouncer before 1.21),
it may be run on another server connection, where the same name can be another
client's statement (hence ``PREPARED_STATEMENTS``, off by default there). A PL/pgSQL
function is safe anywhere: the call is a short plain statement, and PL/pgSQL plans
its body's statement once per session (after five calls with custom plans, one
generic plan reused).

- The migrations create them (``create_functions``); nothing is created at run time,
  so the lock connection needs no privilege beyond ``EXECUTE``.
- Each is named after a hash of its SQL (``django_setnx_acquire_<hash>``), and a
  connection calls them only after checking that those found through its
  ``search_path`` have this version's body, may be executed, and are each the only
  function of that name in their schema; its calls then name that schema and cast
  their arguments, so that no other function can be called instead. A database
  migrated by another version of django-setnx, or not migrated yet, gets the
  statements as text. A migration that changes the SQL calls ``create_functions``
  again (which drops the functions of other versions); the tests check that the
  latest one lists the code's.
- A connection checks at its first acquire or release, and again at most every
  RECHECK_EVERY seconds while it finds none (a process started before ``migrate``
  ran picks them up). If they are dropped or made unexecutable under it (another
  version's migration during a rolling deploy, a reversed migration, a REVOKE), its
  call fails before anything ran (``undefined_function``, ``insufficient_privilege``,
  ``ambiguous_function``): it looks again, and sends the statement as text unless
  they are still there (then the error was the statement's own, and is raised).
"""

import hashlib
import logging
import time

from .db_sql import Dialect

logger = logging.getLogger("django_setnx")

#: SQLSTATEs of a call that may have run nothing: no such function (with those
#: argument types), no EXECUTE privilege on it, or more than one that matches. (A
#: statement inside a function can fail with the same ones: see execute.)
NOT_CALLED = frozenset({"42883", "42501", "42725"})
#: SQLSTATEs of a session that is gone: admin shutdown (pg_terminate_backend), crash
#: shutdown, cannot connect now (with every connection exception, class 08).
POSTGRESQL_DISCONNECTED = frozenset({"57P01", "57P02", "57P03"})
#: Seconds between two checks of a connection that found no usable functions.
RECHECK_EVERY = 60

#: The names of every version's functions start with this (a LIKE pattern).
_NAME_PATTERN = "django\\_setnx\\_%"


class Function:
    """One function: ``statement`` (the Dialect's text, ``%s`` placeholders) run by
    ``call`` (a plain statement taking the same parameters, giving the same rows and
    row count)."""

    def __init__(self, kind, statement, arg_types, returns, body):
        self.statement = statement
        self.arg_types = arg_types
        self.returns = returns
        identity = f"{kind}\0{','.join(arg_types)}\0{returns}\0{body}".encode()
        self.name = f"django_setnx_{kind}_{hashlib.sha256(identity).hexdigest()[:12]}"
        self.signature = f"{self.name}({','.join(arg_types)})"
        # Cast: an overload taking an int4 (what a Python int is sent as) would be
        # a better match for an uncast argument than ours, and be called instead.
        self._arguments = ", ".join(f"%s::{arg_type}" for arg_type in arg_types)
        #: The body as the server keeps it (pg_proc.prosrc).
        self.source = source = f"\n{body}\n"
        self.create = (
            f"CREATE OR REPLACE FUNCTION {self.signature} RETURNS {returns} "
            f"LANGUAGE plpgsql VOLATILE AS $django_setnx${source}$django_setnx$"
        )

    def call_in(self, schema):
        """The statement that calls this function in ``schema`` (a plain statement
        with the parameters of ``statement``, named with the schema so that no
        function of another schema on the ``search_path`` is called instead)."""
        # The driver formats the call: a % in the schema's name must be doubled.
        quoted = '"' + schema.replace('"', '""').replace("%", "%%") + '"'
        return f"SELECT * FROM {quoted}.{self.name}({self._arguments})"


def _positional(statement):
    """``statement`` with its ``%s`` placeholders numbered (``$1``, ``$2``...), as a
    function body refers to its arguments, and its whitespace collapsed (the
    statements have none inside literals), so that the hash in a function's name
    changes with the SQL, not with the layout of the Python source."""
    if "%%" in statement:
        raise ValueError(f"cannot number the placeholders of a statement with '%%': {statement}")
    parts = statement.split("%s")
    numbered = [parts[0]]
    for number, part in enumerate(parts[1:], start=1):
        numbered.append(f"${number}{part}")
    return " ".join("".join(numbered).split())


def functions(dialect):
    """The functions of a PostgreSQL ``dialect``: (acquire, release, acquire_queued,
    release_any, queue_and_holder), each giving the rows its statement gives (the
    columns the backend reads) and, for the release, its row count."""
    acquire = _positional(dialect.acquire)
    # A refused acquire returns no row, as the statement does.
    take = Function(
        "acquire",
        dialect.acquire,
        ("text", "text", "text", "bigint"),
        "SETOF bigint",
        "DECLARE won bigint;\n"
        f"BEGIN\n{acquire} INTO won;\n"
        "IF won IS NOT NULL THEN RETURN NEXT won; END IF;\nEND",
    )
    # One row if it updated one: the call's row count is the statement's.
    release = Function(
        "release",
        dialect.release,
        ("text", "text"),
        "SETOF integer",
        f"BEGIN\n{_positional(dialect.release)};\nIF FOUND THEN RETURN NEXT 1; END IF;\nEND",
    )
    # The acquire of a caller that queued: NOTIFY (channel, name) if it took the lock.
    take_queued = Function(
        "acquire_queued",
        dialect.acquire_queued,
        ("text", "text", "text", "bigint", "text", "text"),
        "SETOF bigint",
        "DECLARE won bigint;\n"
        f"BEGIN\n{acquire} INTO won;\n"
        "IF won IS NOT NULL THEN PERFORM pg_notify($5, $6); RETURN NEXT won; END IF;\nEND",
    )
    # The SELECT of release_any, as PL/pgSQL: the waiter the lock was left to ('' for
    # none), and the same NOTIFY.
    release_any = Function(
        "release_any",
        dialect.release_any,
        ("text", "text", "text", "text"),
        "SETOF text",
        "DECLARE released_name text; kept text; seen bigint;\n"
        f"BEGIN\n{_positional(dialect.release_any_update)} "
        "RETURNING name, next_token, next_seen INTO released_name, kept, seen;\n"
        "IF NOT FOUND THEN RETURN; END IF;\n"
        "IF seen > 0 THEN\n"
        "  PERFORM pg_notify($3, chr(30) || kept || chr(30) || released_name);\n"
        "  RETURN NEXT kept;\n"
        "ELSE\n"
        "  IF kept <> '' THEN PERFORM pg_notify($4, released_name); END IF;\n"
        "  RETURN NEXT '';\n"
        "END IF;\nEND",
    )
    # Always one row (the holder's columns, NULLs for no row), as the statement.
    queue_and_holder = Function(
        "queue_and_holder",
        dialect.queue_and_holder,
        ("text", "bigint", "text", "text", "text", "bigint", "text", "bigint", "text"),
        "TABLE (remaining_ms bigint, holder_token text, holder_fencing bigint, "
        "free_in_ms bigint, queued bigint, place_was_free boolean)",
        f"BEGIN\n{_positional(dialect.queue_and_holder)}\n"
        "INTO remaining_ms, holder_token, holder_fencing, free_in_ms, queued, place_was_free;\n"
        "RETURN NEXT;\nEND",
    )
    return take, release, take_queued, release_any, queue_and_holder


def _dialect(connection):
    return Dialect("postgresql", connection.ops.quote_name, False)


def create_statements(connection):
    """The ``CREATE OR REPLACE FUNCTION`` statements of this version's functions
    for ``connection`` (a PostgreSQL one), to apply by hand where migrations are
    applied as SQL (``sqlmigrate`` cannot show a RunPython operation)."""
    return [function.create for function in functions(_dialect(connection))]


def create_functions(connection):
    """Create (or replace) this version's functions in ``connection``'s current
    schema, and drop those of other versions there. Nothing on other databases."""
    if connection.vendor != "postgresql":
        return
    current = functions(_dialect(connection))
    with connection.cursor() as cursor:
        for function in current:
            cursor.execute(function.create)
        names = {function.name for function in current}
        for name, signature in _installed(cursor):
            if name not in names:
                cursor.execute(f"DROP FUNCTION IF EXISTS {signature}")


def drop_functions(connection):
    """Drop every version's functions from ``connection``'s current schema."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for _, signature in _installed(cursor):
            cursor.execute(f"DROP FUNCTION IF EXISTS {signature}")


def _installed(cursor):
    """``(name, signature)`` of the functions of any version in the current schema
    (``signature`` as DROP FUNCTION takes it)."""
    cursor.execute(
        "SELECT p.proname, p.oid::regprocedure::text FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = current_schema() AND p.proname LIKE %s "
        "AND p.proname ~ '_[0-9a-f]{12}$'",
        (_NAME_PATTERN,),
    )
    return cursor.fetchall()


def installed_names(connection):
    """The names of the functions of any version in ``connection``'s current schema."""
    with connection.cursor() as cursor:
        return sorted(name for name, _ in _installed(cursor))


class PostgresFunctions:
    """Runs a PostgreSQL connection's hot statements through this version's
    functions when it can (see the module docstring). A connection's
    ConnectionState keeps ``functions``: the calls it makes, by statement (schema-
    qualified), or None while it has none."""

    def __init__(self, dialect, driver_error):
        self.functions = functions(dialect)
        self._driver_error = driver_error  # the base class of the driver's errors
        self._statements = frozenset(function.statement for function in self.functions)
        self._calls = {}  # schema -> {statement: the call of its function there}
        self._told = False  # that a connection found none (INFO, once until found)
        self._warned = False  # that they went under a connection (once until found)

    def available(self, cursor):
        """The schema of the functions that the calls resolve to for the connection
        of ``cursor`` (through its ``search_path``), if every one is this version's
        (its body as the server keeps it), the only function of its name there, and
        may be executed; else None."""
        expected = [(function.signature, function.source) for function in self.functions]
        cursor.execute(
            "SELECT count(*), count(DISTINCT n.nspname), min(n.nspname) FROM "
            f"(VALUES {', '.join(['(%s, %s)'] * len(expected))}) AS f(signature, source) "
            "JOIN pg_proc p ON p.oid = to_regprocedure(f.signature) "
            "JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE p.prosrc = f.source AND has_function_privilege(p.oid, 'EXECUTE') "
            "AND (SELECT count(*) FROM pg_proc o "
            "WHERE o.proname = p.proname AND o.pronamespace = p.pronamespace) = 1",
            [value for pair in expected for value in pair],
        )
        found, schemas, schema = cursor.fetchone()
        return schema if found == len(expected) and schemas == 1 else None

    def execute(self, cursor, state, statement, params):
        """Run ``statement`` with ``params`` on ``cursor``: through its function if
        it has one and the connection (``state``, its ConnectionState) may use
        them, else as text. The rows and row count are the statement's."""
        calls = state.functions
        if calls is None:
            if statement not in self._statements or not self._check_due(state):
                cursor.execute(statement, params)
                return
            calls = self._check(cursor, state)
        call = calls.get(statement) if calls is not None else None
        if call is None:
            cursor.execute(statement, params)
            return
        try:
            cursor.execute(call, params)
            return
        except self._driver_error as exc:
            if _sqlstate(exc) not in NOT_CALLED or self._check(cursor, state) == calls:
                # The statement's own error (a permission denied on the table, say),
                # or not one of calling: the functions are still there.
                raise
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        # Dropped, revoked, overloaded or moved since the check: the call ran nothing
        # (the lock connection is in autocommit: no transaction was spoilt either).
        if state.functions is not None:
            cursor.execute(state.functions[statement], params)  # found in another schema
            return
        if not self._warned:
            self._warned = True
            logger.warning(
                "django-setnx's PostgreSQL functions cannot be called (%s): the lock "
                "statements are sent as text, which costs the server a parse and a plan "
                "each time, until they can be again",
                why,
            )
        cursor.execute(statement, params)

    @staticmethod
    def _check_due(state):
        checked_at = state.functions_checked_at
        return checked_at is None or time.monotonic() - checked_at >= RECHECK_EVERY

    def _check(self, cursor, state):
        """Look for the functions (see ``available``); sets and returns
        ``state.functions``. An error the server answers with (a catalog the role
        may not read, say) counts as none found; a broken connection's is raised,
        for the operation to handle."""
        try:
            schema = self.available(cursor)
        except self._driver_error as exc:  # not a bug of ours: that is raised
            if connection_lost(exc, cursor.connection):
                raise
            schema, refused = None, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        else:
            refused = None
        state.functions_checked_at = time.monotonic()
        state.functions = None if schema is None else self._calls_in(schema)
        if state.functions is not None:
            self._told = self._warned = False
        elif not self._told:  # once, until they are found
            self._told = True
            if refused is not None:
                logger.warning(
                    "Could not look for django-setnx's PostgreSQL functions (%s): the "
                    "lock statements are sent as text",
                    refused,
                )
            else:
                logger.info(
                    "This version's django-setnx PostgreSQL functions (created by its "
                    "latest migration, 0005) are not in this database, are another "
                    "version's or may not be executed: the lock statements are sent as "
                    "text until they are"
                )
        return state.functions

    def _calls_in(self, schema):
        calls = self._calls.get(schema)
        if calls is None:
            calls = self._calls[schema] = {
                function.statement: function.call_in(schema) for function in self.functions
            }
        return calls


def _sqlstate(exc):
    return getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)


def connection_lost(exc, raw):
    """Whether ``exc``, raised on the PostgreSQL connection ``raw`` (the driver's),
    is the connection's failure rather than the server's answer: the session was
    ended, a connection exception (class 08), or the driver closed the connection.
    The backend's classification of errors, for an operation to reconnect."""
    state = _sqlstate(exc) or ""
    return state in POSTGRESQL_DISCONNECTED or state.startswith("08") or raw.closed
