#!/usr/bin/env bash
# The programs the tests drive as an operator would: a real Prometheus server scraping the
# workers, headless Chromium for Flower's pages, tmux for progress bars in a terminal.
# Installs Debian's packages of those that are missing (as root); otherwise names them.
set -euo pipefail
missing=()
for pair in prometheus:prometheus chromium:chromium tmux:tmux; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair##*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "the tests need these Debian packages: ${missing[*]} (apt-get install them as root)" >&2
  exit 1
fi
