#!/usr/bin/env bash
# mypy over the package as it installs: relay/, spark/ and migrations/ become outbox.relay,
# outbox.spark and outbox.migrations (pyproject's package-dir). mypy cannot follow that
# mapping through the editable install's import hook, so this links the tree as installed
# under build/typecheck/ and checks it there (errors name build/typecheck/outbox/<path>).
set -euo pipefail
cd "$(dirname "$0")/.."
view=build/typecheck/outbox
rm -rf build/typecheck
mkdir -p "$view"
for entry in outbox/*; do ln -s "$PWD/$entry" "$view/"; done
for part in relay spark migrations; do ln -s "$PWD/$part" "$view/$part"; done
exec .venv/bin/mypy "$@"
