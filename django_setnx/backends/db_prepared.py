"""MariaDB's prepared statements for the database backend's hot statements.

Neither MySQL driver Django supports (mysqlclient, PyMySQL) speaks the binary
protocol's prepared statements, so every statement is parsed by the server on every
call. For the acquire (an upsert with its takeover rule) that parse costs about as
much as the whole plain ``INSERT`` of the floor it is measured against. MariaDB's
SQL-level ``PREPARE`` works with any driver, and its ``EXECUTE ... USING`` takes
literals (MySQL's takes only user variables, which would cost a second statement:
not offered there). So the lock connection sends ``PREPARE <name> FROM '<text>'``
once per connection and statement, then ``EXECUTE <name> USING <the parameters>``:
a short statement the driver fills in exactly as it fills in the plain one.

Safe wherever the plain statement is:

- A statement's name is a hash of its text and of the database the connection uses
  (``SELECT DATABASE()`` when it is made; MariaDB resolves the table at PREPARE,
  not at EXECUTE), so two sessions (or django-setnx versions, or projects on one
  server) never give one name to two statements: a proxy that moves a client's
  statements between server connections can only run the same statement on the
  same table, or none.
- ``EXECUTE`` of a name the session does not know (a proxy or pooler reset the
  session, or moved it) fails with ``ER_UNKNOWN_STMT_HANDLER`` before anything ran:
  the statement is prepared again and run once more. If it is unknown again at
  once, the connection goes back to plain statements.
- A server that refuses ``PREPARE`` (``max_prepared_stmt_count`` reached, say)
  leaves the connection on plain statements, with a warning in the log, and gets
  back the statements it had prepared. Any other error of a ``PREPARE`` is the
  operation's (see REFUSALS).
"""

import hashlib
import logging

logger = logging.getLogger("django_setnx")

#: ER_UNKNOWN_STMT_HANDLER: EXECUTE of a name this session has not prepared. The
#: statement did not run.
UNKNOWN_STATEMENT = 1243
#: The server's refusals of a PREPARE that will not change on this connection: too
#: many prepared statements on the server (max_prepared_stmt_count), a statement
#: kind it cannot prepare, a text it cannot parse (a proxy that rewrites
#: statements). Any other error (a lock-wait timeout behind a migration's ALTER, a
#: killed query, a lost connection) is the operation's: raised as it is, so the
#: backend retries or reports it, and the connection keeps preparing.
REFUSALS = frozenset({1461, 1295, 1064, 1149})


class PreparedSession:
    """What one connection has prepared: the names, or ``plain`` once the server
    refused (then every statement of that connection is sent as text), and the
    settings to restore after a session reset (``setup``).
    ``database``: the one the connection uses (``SELECT DATABASE()`` when it was
    made: ``OPTIONS`` or an option file may name another than ``NAME``), part of
    every statement's name."""

    __slots__ = ("database", "names", "plain", "setup")

    def __init__(self, database=None, setup=()):
        self.database = database
        self.names = set()
        self.plain = False
        #: ``(statement, params)`` the connection ran when it was made (its lock wait
        #: timeouts), run again when its prepared statements turn out to be gone: a
        #: session reset (COM_RESET_CONNECTION from a proxy) undoes those too.
        self.setup = list(setup)


class MariaDBStatements:
    """Runs the backend's hot statements on MariaDB through ``PREPARE``/``EXECUTE``
    (see the module docstring). ``errors``: the driver's base exception class."""

    def __init__(self, errors):
        self._errors = errors
        self._forms = {}  # (database, statement) -> (name, PREPARE text, EXECUTE text)

    def _form(self, statement, database):
        form = self._forms.get((database, statement))
        if form is None:
            if "?" in statement or "%%" in statement:
                # Once prepared, a ? would be read as a parameter, and a %% would stay
                # doubled (the driver no longer formats the text).
                raise ValueError(f"cannot prepare a statement with '?' or '%%': {statement}")
            named = f"{database}\0{statement}".encode()
            name = "setnx_" + hashlib.sha1(named).hexdigest()[:20]
            count = statement.count("%s")
            using = f" USING {', '.join(['%s'] * count)}" if count else ""
            form = self._forms[database, statement] = (
                name,
                f"PREPARE {name} FROM %s",
                f"EXECUTE {name}{using}",
            )
        return form

    def execute(self, cursor, session, statement, params):
        """Run ``statement`` (``%s`` placeholders) with ``params`` on ``cursor``, as
        ``cursor.execute(statement, params)`` would: rowcount, lastrowid and rows are
        the statement's. ``session`` is the connection's PreparedSession."""
        if session.plain:
            cursor.execute(statement, params)
            return
        name, prepare, execute = self._form(statement, session.database)
        for _ in range(2):
            if name not in session.names and not self._prepare(
                cursor, session, name, prepare, statement
            ):
                break  # refused by the server: the session is plain now
            try:
                cursor.execute(execute, params)
                return
            except self._errors as exc:
                if _code(exc) != UNKNOWN_STATEMENT:
                    raise
            # The session lost it (a pooler's or a proxy's reset): nothing ran. The
            # reset also undid the connection's session settings (review r127: a
            # blocked acquire then waited the server's 50 s default, not
            # OPERATION_TIMEOUT, and outlived its read timeout).
            session.names.discard(name)
            for setup in session.setup:
                cursor.execute(*setup)
        else:
            # Prepared, and unknown again at once: something between us and the
            # server does not keep a session's statements. Plain text from now on;
            # nothing to deallocate (where it went, other clients of this database
            # may use the same names).
            self._go_plain(
                cursor,
                session,
                "its prepared statements are not kept between statements",
                deallocate=False,
            )
        cursor.execute(statement, params)

    def _prepare(self, cursor, session, name, prepare, statement):
        """PREPARE ``name``; True if done. A refusal (REFUSALS) leaves ``session``
        plain (False); any other error is raised."""
        try:
            cursor.execute(prepare, (statement.replace("%s", "?"),))
        except self._errors as exc:
            if _code(exc) not in REFUSALS:
                raise
            self._go_plain(cursor, session, f"the server refused PREPARE: {exc}")
            return False
        session.names.add(name)
        return True

    def _go_plain(self, cursor, session, why, deallocate=True):
        """Plain statements for the rest of the connection. After a refusal the
        statements it prepared are deallocated (a server at max_prepared_stmt_count
        gets them back); one the session no longer has is skipped, any other error
        raised."""
        session.plain = True
        logger.warning("MariaDB lock connection: plain statements from now on, because %s", why)
        names, session.names = session.names, set()
        if not deallocate:
            return
        for name in names:
            try:
                cursor.execute(f"DEALLOCATE PREPARE {name}")
            except self._errors as exc:
                if _code(exc) != UNKNOWN_STATEMENT:
                    raise


def _code(exc):
    """The server's (or client library's) error number of a MySQL driver error."""
    return exc.args[0] if exc.args else None
