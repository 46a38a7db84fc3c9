#!/usr/bin/env python
"""Django's command line for the example: `python examples/django_service/manage.py migrate`."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "examples.django_service.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
