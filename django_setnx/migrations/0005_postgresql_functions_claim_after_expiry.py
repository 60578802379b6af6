"""PostgreSQL only: this version's functions (see 0004): the acquire statements give
the waiter next in line CLAIM_MS after the holder's expiry to take the lock, then
let anyone take it, instead of keeping its place for PG_NEXT_LAPSE_MS after its last
renewal (a waiter killed with the holder kept an expired lock from everyone for up
to 8 s). ``create_functions`` creates them and drops the others. Nothing on other
databases.
"""

from django.db import migrations

#: The names of the functions this migration creates (their SQL's hash).
FUNCTIONS = (
    "django_setnx_acquire_97fa9714a1b1",
    "django_setnx_release_0081650d1a1f",
    "django_setnx_acquire_queued_554d7f69572a",
    "django_setnx_release_any_fee765d7ae5f",
    "django_setnx_queue_and_holder_f5260d2632b0",
)


def create_functions(apps, schema_editor):
    from django_setnx.backends.db_functions import create_functions

    create_functions(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("django_setnx", "0004_postgresql_functions"),
    ]

    operations = [
        # Reversed, this version's functions stay: the previous version's code finds
        # none of its own and sends its statements as text (as it does before
        # 0004), and reversing 0004 drops them all.
        migrations.RunPython(
            create_functions,
            migrations.RunPython.noop,
            elidable=False,
            hints={"model_name": "lockrecord"},
        ),
    ]
