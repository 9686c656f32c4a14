#!/usr/bin/env bash
# Puts PgBouncer from Debian's `pgbouncer` package at $1 (default .venv/bin/pgbouncer), so that
# `make test` can run the ledger and the CRM behind a real PgBouncer in transaction mode
# (tests/prediction/test_crm_pgbouncer.py starts it on loopback with its own configuration).
# Only package files are downloaded and unpacked, under .venv: nothing is installed system-wide or
# started here. The binary's libraries that Debian packages apart and a bare machine may lack
# (c-ares, libevent) are unpacked beside it, and $1 is a small launcher that points the dynamic
# linker at them.
# Best effort: without apt it says so and exits 0; the tests that need PgBouncer then skip (and
# fail under CI=true).
set -euo pipefail
dest="${1:-.venv/bin/pgbouncer}"
[ -x "$dest" ] && exit 0
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "fetch-pgbouncer: apt-get/dpkg-deb not found; install PgBouncer to run the pooler tests" >&2
  exit 0
fi
packages=(pgbouncer libc-ares2 libevent-2.1-7)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
download() { (cd "$work" && apt-get download "${packages[@]}" >/dev/null 2>&1); }
# A fresh machine may have no package lists yet: refresh them once, then retry.
if ! download && ! { apt-get update -qq >/dev/null 2>&1 && download; }; then
  echo "fetch-pgbouncer: could not download Debian's pgbouncer package; pooler tests will skip" >&2
  exit 0
fi
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
mkdir -p "$(dirname "$dest")"
home="$(cd "$(dirname "$dest")/.." && pwd)/lib/pgbouncer"
rm -rf "$home" && mkdir -p "$home/lib"
install -m 0755 "$work/root/usr/sbin/pgbouncer" "$home/pgbouncer"
cp -P "$work"/root/usr/lib/*/libcares.so.* "$work"/root/usr/lib/*/libevent*-2.1.so.* "$home/lib/"
cat >"$dest" <<LAUNCHER
#!/bin/sh
LD_LIBRARY_PATH="$home/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$home/pgbouncer" "\$@"
LAUNCHER
chmod 0755 "$dest"
echo "fetch-pgbouncer: $("$dest" --version 2>&1 | head -1) -> $dest"
