"""PostgreSQL only: the functions that run the lock backend's statements of acquire
and release (see django_setnx.backends.db_functions), so that the server parses
and plans them once per session instead of on every call. Nothing on other
databases.

A later version whose statements differ adds a migration that runs
``create_functions`` again, and lists their new names in its ``FUNCTIONS`` (a test
compares the latest list with the code's): it creates that version's functions
(named after their SQL) and drops the others. Reversing drops them; the backend
then sends the statements as text, as before.
"""

from django.db import migrations

#: The names of the functions this migration creates (their SQL's hash).
FUNCTIONS = (
    "django_setnx_acquire_5317debb154b",
    "django_setnx_release_0081650d1a1f",
    "django_setnx_acquire_queued_3f11ff319314",
    "django_setnx_release_any_fee765d7ae5f",
    "django_setnx_queue_and_holder_b2a7481ea7c7",
)


def create_functions(apps, schema_editor):
    from django_setnx.backends.db_functions import create_functions

    create_functions(schema_editor.connection)


def drop_functions(apps, schema_editor):
    from django_setnx.backends.db_functions import drop_functions

    drop_functions(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("django_setnx", "0003_fencing_in_the_lock_row"),
    ]

    operations = [
        # The hint lets a router that routes by model put them where the table is.
        migrations.RunPython(
            create_functions,
            drop_functions,
            elidable=False,
            hints={"model_name": "lockrecord"},
        ),
    ]
