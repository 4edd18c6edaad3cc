#!/usr/bin/env sh
# The report's browser tests drive Debian's Chromium through Playwright (no `playwright install` download).
# Installs the chromium package when it is missing and this is a root shell with apt-get; otherwise says
# that those tests will skip. Never fails: the rest of the suite does not need a browser.
if command -v chromium >/dev/null 2>&1 || [ -n "$DTYPELAB_CHROMIUM" ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the report's browser tests" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
        || echo "chromium could not be installed: the browser tests will skip" >&2
else
    echo "no chromium (install it, or set DTYPELAB_CHROMIUM=/path/to/chrome): the browser tests will skip" >&2
fi
exit 0
