from django.db import migrations, models


def binary_names_on_mysql(apps, schema_editor):
    """Make lock names compare byte for byte on MySQL/MariaDB.

    Their default collations are case-insensitive and pad trailing spaces, so
    "Report" and "report " would be one lock. PostgreSQL and SQLite compare
    exactly already.
    """
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
    for table in ("django_setnx_lock", "django_setnx_fence"):
        schema_editor.execute(
            f"ALTER TABLE {connection.ops.quote_name(table)} "
            f"CONVERT TO CHARACTER SET utf8mb4 COLLATE {collation}"
        )


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="FencingCounter",
            fields=[
                (
                    "name",
                    models.CharField(
                        max_length=200, primary_key=True, serialize=False, verbose_name="name"
                    ),
                ),
                ("value", models.BigIntegerField(verbose_name="last fencing token")),
            ],
            options={
                "verbose_name": "fencing counter",
                "verbose_name_plural": "fencing counters",
                "db_table": "django_setnx_fence",
                "default_permissions": (),
            },
        ),
        migrations.CreateModel(
            name="LockRecord",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=200, unique=True, verbose_name="name")),
                ("token", models.CharField(max_length=64, verbose_name="token")),
                (
                    "owner",
                    models.TextField(
                        default="{}",
                        help_text="JSON: host, pid, thread, guards.",
                        verbose_name="owner",
                    ),
                ),
                (
                    "acquired_at",
                    models.BigIntegerField(
                        help_text="Milliseconds since the epoch, database clock.",
                        verbose_name="acquired at",
                    ),
                ),
                (
                    "expires_at",
                    models.BigIntegerField(
                        help_text="Milliseconds since the epoch, database clock.",
                        verbose_name="expires at",
                    ),
                ),
            ],
            options={
                "verbose_name": "lock",
                "verbose_name_plural": "locks",
                "db_table": "django_setnx_lock",
                "permissions": [("release_lock", "Can force-release locks")],
                "default_permissions": ("view",),
            },
        ),
        migrations.RunPython(
            binary_names_on_mysql, migrations.RunPython.noop, atomic=False, elidable=False
        ),
    ]
