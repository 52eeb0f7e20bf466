# Sourced by the A/B scripts (external_ab.sh, reactor_ab.sh): the wheels the GPU machines lack,
# the library at commit $OLD (or in the tar file $OLD) unpacked into /tmp/old, both it and the working tree ($NEW) built
# side by side. Needs OLD and OUT set; sets SITE (the wheels' folder for PYTHONPATH) and NEW.
# AB_COPY="FILE ...": scripts of the working tree that the old tree runs as they are here.
export DEVICEOP_CACHE_DIR=/tmp/deviceop-cache PYTHONUNBUFFERED=1
mkdir -p "$OUT"
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the GPU machines lack (see gpu_suite.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  SITE=:/tmp/site
fi
NEW=$PWD
rm -rf /tmp/old && mkdir -p /tmp/old
if [ -f "$OLD" ]; then  # a tree packed elsewhere (git archive -o old.tar COMMIT): commits the machine's checkout lacks
  tar xf "$OLD" -C /tmp/old
else
  git archive "$OLD" | tar x -C /tmp/old
fi
for f in ${AB_COPY:-}; do cp "$f" "/tmp/old/$f"; done
(cd /tmp/old && python3 setup.py -q build_ext --inplace -j 8 >"$OUT/build_old.log" 2>&1) &
python3 setup.py -q build_ext --inplace -j 8 >"$OUT/build_new.log" 2>&1 || { tail "$OUT/build_new.log"; exit 1; }
wait $! || { tail "$OUT/build_old.log"; exit 1; }
