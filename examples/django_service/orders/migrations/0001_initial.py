from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []  # noqa: RUF012
    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("customer", models.TextField()),
                ("total", models.DecimalField(decimal_places=2, max_digits=10)),
                ("state", models.TextField(default="placed")),
            ],
        ),
    ]
