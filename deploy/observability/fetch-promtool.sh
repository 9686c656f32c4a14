#!/usr/bin/env bash
# Puts promtool or prometheus (by the destination's file name) from Debian's `prometheus` package at
# $1 (default .venv/bin/promtool), so that `make test` can validate the alerting rules offline
# (`promtool check rules`, `promtool test rules`) and prove them on a live Prometheus server
# (tests/observability/test_live_prometheus.py, which starts .venv/bin/prometheus on loopback).
# Only the package file is downloaded and unpacked: nothing is installed system-wide or started here.
# Best effort: without apt it says so and exits 0; the tests that need the binary then skip (and
# fail under CI=true).
set -euo pipefail
dest="${1:-.venv/bin/promtool}"
name="$(basename "$dest")"
case "$name" in
  promtool|prometheus) ;;
  *) echo "fetch-promtool: $name is not a binary of the prometheus package (promtool, prometheus)" >&2; exit 2 ;;
esac
[ -x "$dest" ] && exit 0
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "fetch-promtool: apt-get/dpkg-deb not found; install $name (Prometheus) to run the rule tests" >&2
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
install -m 0755 "$work/root/usr/bin/$name" "$dest"
echo "fetch-promtool: $("$dest" --version 2>&1 | head -1) -> $dest"
