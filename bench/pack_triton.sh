#!/usr/bin/env bash
# Pack the project's pinned triton for a GPU machine that has another one and no network (the lent
# `device` machines: triton 3.6.0, Python 3.12, a 64 MiB carry limit). The wheel is 190 MB; without
# the parts a kernel run does not load (CUPTI, the Blackwell ptxas, instrumentation and plugin test
# libraries) and with debug info stripped from its two big libraries it packs to ~51 MB of tar.xz.
#
#   bash bench/pack_triton.sh                  # writes .t37/triton.tar.xz (ignored by git)
#   # on the device, carry .t37, then:
#   mkdir -p /tmp/t37 && tar -C /tmp/t37 -xJf .t37/triton.tar.xz && export PYTHONPATH=/tmp/t37:$PWD
#
# The AMD backend stays: triton discovers backends through entry points, and the machine's own
# triton advertises it too.
set -euo pipefail
VERSION=${TRITON_VERSION:-$(python3 -c "import re; print(re.search(r'^triton==(\S+)', open('constraints.txt').read(), re.M).group(1))")}
PY=${PY_VERSION:-3.12}
OUT_DIR=${OUT_DIR:-.t37}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$work" "triton==$VERSION"
mkdir "$work/x"
unzip -q "$work"/triton-*.whl -d "$work/x"
rm -rf "$work/x/triton/backends/nvidia/lib/cupti" \
    "$work/x/triton/backends/nvidia/bin/ptxas-blackwell" "$work/x/triton/instrumentation" \
    "$work/x/triton/plugins" "$work/x/triton/FileCheck"
strip --strip-unneeded "$work/x/triton/_C/libtriton.so" "$work/x/triton/_C/libproton.so"
mkdir -p "$OUT_DIR"
tar -C "$work/x" -cf - . | xz -T0 -6 >"$OUT_DIR/triton.tar.xz.tmp"
mv "$OUT_DIR/triton.tar.xz.tmp" "$OUT_DIR/triton.tar.xz"
echo "triton $VERSION for Python $PY: $(du -h "$OUT_DIR/triton.tar.xz" | cut -f1) in $OUT_DIR/triton.tar.xz"
