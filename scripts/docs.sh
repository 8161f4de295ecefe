#!/usr/bin/env bash
# Build the documentation site from docs/ into site/, offline: mkdocs build --strict, so a
# broken link, a missing page or a marker of scripts/docs_reference.py that names nothing
# fails the build. The reference tables are generated from the code by that hook.
# Installs the docs extra into .venv when MkDocs is missing (EDGETB_EXTRAS=test,docs bash scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c 'import mkdocs, material' 2>/dev/null; then
  EDGETB_EXTRAS=${EDGETB_EXTRAS:-test},docs bash scripts/setup.sh
fi
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --site-dir site "$@"
echo "docs: site/index.html"
