"""Settings of the example Django service; the database comes from OUTBOX_DATABASE_URL."""

import os

from sqlalchemy.engine import make_url

_url = make_url(os.environ["OUTBOX_DATABASE_URL"])

SECRET_KEY = "example-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
# Django sets the process's time zone from this (America/Chicago when unset): the sweeper
# started through this project logs in UTC, as the relay and other sweepers do.
TIME_ZONE = "UTC"
ROOT_URLCONF = "examples.django_service.urls"
INSTALLED_APPS = ["examples.django_service.orders"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3 when installed
        "NAME": _url.database,
        "USER": _url.username,
        "PASSWORD": _url.password,
        "HOST": _url.host,
        "PORT": _url.port,
    }
}
