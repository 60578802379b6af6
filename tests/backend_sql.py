"""SQL on a database lock backend's own connection, for tests that read or write its
rows directly."""

from django_setnx import locks


def run_sql(alias, statement, params):
    """Run ``statement`` on the backend's own autocommit connection (the test's ORM
    connection sits in a transaction whose snapshot would not see the backend's
    writes). ``{table}`` is the lock table, ``{p}`` the driver's placeholder. Returns
    the first row of a query, else None."""

    def work(cursor, sql, raw):
        cursor.execute(statement.format(table=sql.lock_table, p=sql.placeholder), params)
        return cursor.fetchone() if cursor.description else None

    return locks[alias]._run("test", work)


def before_statements(monkeypatch, backend, action, hook):
    """Make ``hook(statement)`` run just before each statement that ``backend``
    sends for ``action`` (its ``_run`` action name, e.g. "clear"), on the same
    connection and thread: a test's way to put another client's operation at an
    exact point between two statements of one operation."""
    run = backend._run

    class Cursor:
        def __init__(self, cursor):
            self._cursor = cursor

        def __getattr__(self, attr):
            return getattr(self._cursor, attr)

        def execute(self, statement, params=()):
            hook(statement)
            return self._cursor.execute(statement, params)

    def hooked_run(name, work, **kwargs):
        def hooked_work(cursor, sql, raw):
            return work(Cursor(cursor), sql, raw)

        return run(name, hooked_work if name == action else work, **kwargs)

    monkeypatch.setattr(backend, "_run", hooked_run)
