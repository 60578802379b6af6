from django.db import migrations, models


class Migration(migrations.Migration):
    """The waiter next in line, kept on the lock row so that a release can leave the
    lock to the longest-waiting caller instead of whoever retries first."""

    dependencies = [
        ("django_setnx", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="lockrecord",
            name="next_token",
            field=models.CharField(
                blank=True, default="", max_length=64, verbose_name="next in line"
            ),
        ),
        migrations.AddField(
            model_name="lockrecord",
            name="next_since",
            field=models.BigIntegerField(default=0, verbose_name="waiting since"),
        ),
        migrations.AddField(
            model_name="lockrecord",
            name="next_seen",
            field=models.BigIntegerField(default=0, verbose_name="last seen waiting"),
        ),
    ]
