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
