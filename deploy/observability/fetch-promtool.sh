#!/usr/bin/env bash
# Puts promtool from Debian's `prometheus` package at $1 (default .venv/bin/promtool), so that
# `make test` can validate the alerting rules offline (`promtool check rules`, `promtool test rules`).
# Only the package file is downloaded and unpacked: nothing is installed or started.
# Best effort: without apt it says so and exits 0; the rule tests then skip (and fail under CI=true).
set -euo pipefail
dest="${1:-.venv/bin/promtool}"
[ -x "$dest" ] && exit 0
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "fetch-promtool: apt-get/dpkg-deb not found; install promtool (Prometheus) to run the rule tests" >&2
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
download() { (cd "$work" && apt-get download prometheus >/dev/null 2>&1); }
# A fresh machine may have no package lists yet: refresh them once, then retry.
if ! download && ! { apt-get update -qq >/dev/null 2>&1 && download; }; then
  echo "fetch-promtool: could not download Debian's prometheus package; rule tests will skip" >&2
  exit 0
fi
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
mkdir -p "$(dirname "$dest")"
install -m 0755 "$work/root/usr/bin/promtool" "$dest"
echo "fetch-promtool: $("$dest" --version 2>&1 | head -1) -> $dest"
