"""Fencing tokens move into the lock row; the table of counters goes; the name
becomes the primary key.

Until now ``django_setnx_fence`` kept one counter per name ever locked, never
deleted: a table that grew with every ``invoice:{id}``. A token is now a hybrid
clock kept on the lock row itself (the database's clock in µs, or the row's
previous token plus one if larger), so nothing per name outlives its row.

Every token issued after this migration is larger than every one issued before: the
old counters count acquisitions (1, 2, 3, ...) and the new tokens start at the
clock's µs since 1970 (about 1.8e15). The migration checks it, and refuses to run
on a database where a counter is already that large (it cannot happen from real
use). Rows of held locks keep their counter's value until their next acquisition.

The name becomes the lock table's primary key (the unique index it had already was
the SETNX): one index to maintain per acquire and release instead of two, and no
auto-increment column, so that MySQL's insert id can carry the fencing token back.

Reversing recreates the counters from the lock rows (names without a row restart
from the token of their next acquisition, which is still larger than any old one).
"""

from django.db import migrations, models

#: The database's clock in µs since the epoch, per vendor (as the backend mints).
NOW_US = {
    "postgresql": "(EXTRACT(EPOCH FROM statement_timestamp()) * 1000000)::bigint",
    "mysql": "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)",
}


def check_counters_are_behind_the_clock(apps, schema_editor):
    """First, before any schema change (MySQL cannot roll DDL back)."""
    connection = schema_editor.connection
    fence = connection.ops.quote_name("django_setnx_fence")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT MAX(value) FROM {fence}")
        (largest,) = cursor.fetchone()
        cursor.execute(f"SELECT {NOW_US[connection.vendor]}")
        (now_us,) = cursor.fetchone()
    if largest is not None and largest >= now_us:
        raise RuntimeError(
            f"django_setnx: a fencing counter ({largest}) is at least the database clock "
            f"in µs ({now_us}); tokens issued after this migration would not all be "
            f"larger than those issued before. Is the database clock right?"
        )


def copy_counters_into_rows(apps, schema_editor):
    connection = schema_editor.connection
    quote = connection.ops.quote_name
    lock, fence = quote("django_setnx_lock"), quote("django_setnx_fence")
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {lock} SET fencing = COALESCE("
            f"(SELECT f.value FROM {fence} f WHERE f.name = {lock}.name), 0)"
        )


def copy_rows_into_counters(apps, schema_editor):
    connection = schema_editor.connection
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote('django_setnx_fence')} (name, value) "
            f"SELECT name, fencing FROM {quote('django_setnx_lock')} WHERE token <> ''"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("django_setnx", "0002_next_in_line"),
    ]

    operations = [
        migrations.RunPython(
            check_counters_are_behind_the_clock, migrations.RunPython.noop, elidable=False
        ),
        migrations.AddField(
            model_name="lockrecord",
            name="fencing",
            field=models.BigIntegerField(default=0, verbose_name="fencing token"),
        ),
        migrations.RunPython(copy_counters_into_rows, copy_rows_into_counters, elidable=False),
        migrations.DeleteModel(name="FencingCounter"),
        migrations.RemoveField(model_name="lockrecord", name="id"),
        migrations.AlterField(
            model_name="lockrecord",
            name="name",
            field=models.CharField(
                max_length=200, primary_key=True, serialize=False, verbose_name="name"
            ),
        ),
    ]
