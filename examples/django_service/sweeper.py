"""The example's sweeper entry point: ``outbox sweep --app examples.django_service.sweeper:outbox``.

The sweeper imports the module it is given before Django is set up, and the views import
the models, which need it: this module sets Django up first, then takes the views' outbox
(with its checker)."""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_service.settings")
django.setup()

from examples.django_service.orders.views import outbox  # noqa: E402

__all__ = ["outbox"]
