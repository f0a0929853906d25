# source .gdnb/setup.sh  (device, call 2, after call 1 on the same warm machine): z3-solver into /tmp/site, next to
# tilelang and fla-core; says so where call 1's install is not there (a fresh machine).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gdnb/w/*.whl
export PYTHONPATH=/tmp/site
if python3 -c "import tilelang, fla" 2>/dev/null; then
  echo "GDN: tilelang and fla-core import"
else
  echo "GDN: tilelang or fla-core missing (call 1 with .gdna did not run on this machine); the reference backend runs"
fi
