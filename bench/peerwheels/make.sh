#!/bin/bash
# Makes the git-ignored carry folders .peerwheels/ (and .testwheels/, below) that bench/serve_h200.sh installs on the lent GPU machine
# (no package registry there): the exact wheels of MANIFEST (our server's and mlx_lm.server's runtime
# dependencies beyond what the machine's image and .mlxcuda2 hold), for CPython 3.12 manylinux x86_64,
# unzipped into one tree and packed as site.tar.xz (12 MB instead of 28 MB of wheels, so that it fits one
# device call's 64 MiB beside .mlxcuda2), plus install.sh. Run from the repo root: bash bench/peerwheels/make.sh
set -euo pipefail
out=.peerwheels; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
specs=$(awk '{print $2}' bench/peerwheels/MANIFEST | python3 -c '
import sys, re
for w in sys.stdin.read().split():
    name, version = w.split("-")[:2]
    print(f"{name}=={version}")')
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$tmp/wheels" $specs
(cd "$tmp/wheels" && sha256sum *.whl) | diff <(sort -k2 bench/peerwheels/MANIFEST) <(sort -k2 -) \
  || { echo "make.sh: the downloaded wheels differ from MANIFEST" >&2; exit 1; }
mkdir -p "$tmp/site"
python3 -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob(sys.argv[2] + '/*.whl')]" \
  "$tmp/site" "$tmp/wheels"
mkdir -p "$out"
tar cf - -C "$tmp/site" . | xz -9 > "$out/site.tar.xz"
cp bench/peerwheels/MANIFEST bench/peerwheels/install.sh "$out/"
du -sh "$out"
# .testwheels/: pytest-xdist and execnet alone (~0.1 MB), for a GPU test call that carries the kernel cache
# instead of .peerwheels (bench/h200.sh's tests step unzips them and runs WORKERS processes)
mkdir -p .testwheels && rm -f .testwheels/*.whl && cp "$tmp"/wheels/pytest_xdist-*.whl "$tmp"/wheels/execnet-*.whl .testwheels/
du -sh .testwheels
