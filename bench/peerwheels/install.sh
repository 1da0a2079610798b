#!/bin/bash
# Unpacks site.tar.xz (the wheels listed in MANIFEST, each unzipped into one tree) into ${SITE:-/tmp/site}.
# Idempotent (a stamp file per archive). From the repo root on the GPU machine, after .mlxcuda2/setup.sh or
# alone:   bash .peerwheels/install.sh && export PYTHONPATH=/tmp/site:$PWD
# Made from `pip download --only-binary=:all: --python-version 3.12 --implementation cp --platform
# manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 ...` (by
# bench/peerwheels/make.sh): pure Python and cp312/abi3 manylinux x86_64 wheels.
set -e
d=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
site=${SITE:-/tmp/site}
stamp="$site/.peerwheels-$(cksum < "$d/site.tar.xz" | cut -d' ' -f1)"
if [ -f "$stamp" ]; then echo "peerwheels: already unpacked in $site"; exit 0; fi
mkdir -p "$site"
if command -v xz >/dev/null; then
  xz -dc "$d/site.tar.xz" | tar xf - -C "$site" --no-same-owner
else
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$d/site.tar.xz" "$site"
fi
touch "$stamp"
echo "peerwheels: unpacked $(wc -l < "$d/MANIFEST") wheels into $site"
